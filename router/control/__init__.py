"""Talking to servers outside the request path: typed client, discovery, health, load polls."""
