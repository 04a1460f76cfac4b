"""Process assembly: command line, app construction, serving."""
