"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) and its Prometheus metrics; talks only to the engine."""
