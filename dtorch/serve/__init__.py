"""The OpenAI-compatible HTTP server: ``python -m dtorch serve`` (FastAPI + uvicorn over the engine)."""

from dtorch.serve.app import build_app as build_app

__all__ = ["build_app"]
