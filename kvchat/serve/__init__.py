"""`kvchat serve`: an OpenAI-compatible HTTP server that keeps the model, the encoder and recent episode caches
warm (docs/serve.md). Needs the `serve` extra (FastAPI, uvicorn).

`create_app(config)` builds the ASGI app (kvchat.serve.app); `Engine` is the worker that answers
(kvchat.serve.engine); `serve(config)` runs it on uvicorn (kvchat.serve.server).
"""

from kvchat.serve.app import create_app
from kvchat.serve.engine import ChatRequest, Engine
from kvchat.serve.server import serve

__all__ = ["ChatRequest", "Engine", "create_app", "serve"]
