"""The HTTP server: requests, the batcher, the app."""
