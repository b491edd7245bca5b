"""``patchbay serve``: the OpenAI-compatible HTTP server."""
