"""The OpenAI-compatible HTTP server: ``python -m dtorch serve`` (FastAPI + uvicorn over the engine).

``build_app`` is imported on first use, so ``dtorch.serve.cli`` (the serve command's flags, which the command line
builds its parser from) imports without the ``serve`` extra installed."""

__all__ = ["build_app"]


def __getattr__(name: str) -> object:
    if name == "build_app":
        from dtorch.serve.app import build_app

        return build_app
    raise AttributeError(f"module 'dtorch.serve' has no attribute {name!r}")
