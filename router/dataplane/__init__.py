"""The request path: proxy, legs' HTTP client, relay helpers, live attempts, admission."""
