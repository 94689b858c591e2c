"""The OpenAI-compatible HTTP server: ``python -m sangam.serve --model DIR`` (or ``sangam serve``).

``build_app(engine, ServerConfig(...))`` gives the FastAPI app for embedding in another server.
"""

from sangam.serve.app import build_app
from sangam.serve.config import ServerConfig

__all__ = ["ServerConfig", "build_app"]
