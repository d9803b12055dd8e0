"""`kvchat serve`: an OpenAI-compatible HTTP server that keeps the model, the encoder and recent episode caches
warm (docs/serve.md). The server needs the `serve` extra (FastAPI, uvicorn); the client does not.

- `kvchat.serve.app.create_app(config)`: the ASGI app
- `kvchat.serve.engine.Engine`: the worker that answers, without HTTP
- `kvchat.serve.server.serve(config)`: the app on uvicorn
- `kvchat.serve.client.Client`: `kvchat ask --server` (standard library only, no torch)

Nothing is imported here, so that the client and the announcement stay light.
"""
