"""The OpenAI-compatible HTTP server (docs/server.md)."""
