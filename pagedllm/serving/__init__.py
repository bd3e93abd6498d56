"""The OpenAI-compatible HTTP server, its engine thread, metrics, log and dashboard."""
