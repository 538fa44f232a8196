"""The gateway's FastAPI routes, one module per resource; each exposes `router`.

Endpoints find the shared state in `app.state.context` (context.py `context_of`).
"""
