"""`pd-router ctl`: the operators' command line for a running router (see `pd-router ctl --help`).

A plain HTTP client of the admin API (stdlib only: it imports nothing of the router's server side, so
`pd-router ctl --help` starts fast). Exit codes: 0 ok; 1 the operation failed or the router refused it
(its message is printed); 2 usage error; 3 the router is unreachable or did not answer in time; 4 the
router refused the key.
"""
