"""``patchbay serve``: an OpenAI-compatible HTTP server on the engine (FastAPI + uvicorn)."""
