"""Shared foundations: config, errors, app keys, the worker registry, request shape."""
