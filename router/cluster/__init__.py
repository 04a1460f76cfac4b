"""Shared state between router replicas: an etcd v3 client over etcd's JSON gateway, and a local etcd process.

Nothing here is imported by the request path; a router started without etcd endpoints never loads it.
"""
