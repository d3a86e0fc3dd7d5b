"""The OpenAI-compatible server: the continuous-batching engine thread (engine.py), the FastAPI app
(app.py) and a response's assembly (respond.py), wire shapes (protocol.py), options (options.py),
metrics (metrics.py), ASGI guards and uvicorn's setup (asgi.py), Ray Serve replicas (ray.py)."""
