"""HTTP endpoints other than generation, and access control."""
