"""The gateway's HTTP application: `create_app` builds the shared state, includes the routers of
`routes/` and installs the exception handlers that render every failure through the error table.

Every route authenticates before it looks anything up (AIP-193: permission before existence).
Request bodies are parsed by bodies.py, not by FastAPI's validator, so every bad body gets the
documented 400 (or 413) with `{"detail": ...}` instead of a 422. The two requests of every turn
are served lean ahead of FastAPI (hot_path.py).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import grpc
from fastapi import Depends, FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import BaseRoute, Match
from starlette.types import Scope

from loopline.assistant.v1 import assistant_pb2_grpc
from loopline.billing.v1 import billing_pb2_grpc
from loopline.tools.v1 import tools_pb2_grpc
from services.common import metrics
from services.common.readiness import Readiness
from services.gateway.config import GatewaySettings
from services.gateway.console import serve_console
from services.gateway.context import GatewayContext, auth_error_response
from services.gateway.default_models import DefaultModels
from services.gateway.errors import (
    BodyError,
    detail,
    grpc_error_response,
    storage_error_response,
    unexpected_error_response,
)
from services.gateway.fanout import RunFanout
from services.gateway.hot_path import GatewayApp, TurnRequests, lean_handlers
from services.gateway.idempotency import IdempotencyConflict, IdempotencyStore
from services.gateway.identity import Authenticator, AuthError
from services.gateway.openapi import serve_docs
from services.gateway.query import single_query_values
from services.gateway.ratelimit import RequestLimits
from services.gateway.routes import (
    account,
    api_keys,
    chats,
    credentials,
    dashboard,
    integrations,
    knowledge,
    knowledge_search,
    organizations,
    turns,
)


def create_app(
    settings: GatewaySettings,
    authenticator: Authenticator,
    channel: grpc.aio.Channel,
    idempotency: IdempotencyStore,
    default_models: DefaultModels,
    tools_channel: grpc.aio.Channel | None = None,
    billing_channel: grpc.aio.Channel | None = None,
) -> FastAPI:
    """The FastAPI application serving the assistant API against the orchestrator on `channel`
    (and, with `tools_channel`, the credentials, knowledge and integrations routes; with both it
    and `billing_channel`, the usage overview)."""
    app = GatewayApp(
        title="Loopline",
        version="0.1.0",
        description="Assistant turns (reason -> act -> observe) streamed as Server-Sent Events.",
        # No OpenTelemetry here: without this FastAPI looks up the global tracer, meter and logger
        # providers on every request (gateway CPU per turn).
        telemetry={"tracing": False, "metrics": False, "logs": False},
        # a query parameter given twice is 400 (services/gateway/query.py)
        dependencies=[Depends(single_query_values)],
        # A path with a trailing slash is the 404 of any unknown path: Starlette's default redirect
        # (307) answered before any API key was checked and wrote the request's Host header into
        # its Location.
        redirect_slashes=False,
        exception_handlers=_exception_handlers(),
        # /docs and /redoc with local assets (serve_docs), not FastAPI's CDN ones
        docs_url=None,
        redoc_url=None,
    )
    orchestrator = assistant_pb2_grpc.AssistantServiceStub(channel)
    # every authentication goes through the per-key and per-client limits
    limits = app.state.request_limits = RequestLimits(
        authenticator,
        settings.key_requests_per_minute,
        settings.failed_auths_per_minute,
        settings.rate_limit_storage_url,
        settings.redis_key_prefix,
    )
    fanout = app.state.fanout = RunFanout(
        orchestrator,
        settings.heartbeat_interval_s,
        settings.write_threads,
        settings.http_send_timeout_s,
        settings.http_listens_per_key,
    )
    tools = tools_pb2_grpc.ToolsServiceStub(tools_channel) if tools_channel is not None else None
    context = app.state.context = GatewayContext(
        settings, authenticator, limits, orchestrator, idempotency, default_models, fanout, tools
    )
    requests = app.state.turns = TurnRequests(context)
    app.lean = lean_handlers(app, context, requests)
    # HEAD too: uptime monitors send it (the same status, no body)
    app.add_api_route("/healthz", healthz, methods=["GET", "HEAD"], include_in_schema=False)
    app.add_api_route("/readyz", readyz, methods=["GET", "HEAD"], include_in_schema=False)
    app.add_api_route("/metrics", metrics_page, methods=["GET"], include_in_schema=False)
    app.include_router(turns.router)
    app.include_router(chats.router)
    if tools is not None:
        app.include_router(credentials.router)
        app.include_router(knowledge_search.router)  # before knowledge's /knowledge-bases/{id}
        app.include_router(knowledge.router)
        app.include_router(integrations.router)
    if tools is not None and billing_channel is not None:
        context.billing = billing_pb2_grpc.BillingServiceStub(billing_channel)
        app.include_router(dashboard.router)
    app.include_router(organizations.router)
    app.include_router(account.router)  # system.health, auth.me
    app.include_router(api_keys.router)
    serve_docs(app)
    serve_console(app)
    return app


async def healthz() -> dict[str, str]:
    """Liveness: 200 while the process serves, whatever its database or Redis do."""
    return {"status": "ok"}


async def readyz(request: Request) -> JSONResponse:
    """Readiness: 200 `{"status": "ready"}` while the database and Redis answered the last probe,
    else 503 naming the ones that did not (`{"status": "not ready", "failing": ["database"]}`;
    services/common/readiness.py)."""
    readiness: Readiness | None = getattr(request.app.state, "readiness", None)
    if readiness is None or readiness.ready:
        return JSONResponse({"status": "ready"}, headers=_NOT_CACHED)
    return JSONResponse(
        {"status": "not ready", "failing": list(readiness.failing)},
        status_code=503,
        headers=_NOT_CACHED,
    )


_NOT_CACHED = {"Cache-Control": "no-store"}


async def metrics_page(request: Request) -> Response:
    """The Prometheus metrics of this process (no authentication and no ids: docs/metrics.md)."""
    body, content_type = metrics.exposition(request.headers.get("accept"))
    return Response(body, media_type=content_type)


async def _unexpected_error(_: Request, error: Exception) -> JSONResponse:
    # Starlette's ServerErrorMiddleware sends this answer, then re-raises the error, and uvicorn
    # closes the connection: say so (RFC 9112 section 9.6), or a keep-alive client sends its next
    # request into a closed socket.
    response = unexpected_error_response(error)
    response.headers["Connection"] = "close"
    return response


async def _storage_error(_: Request, error: Exception) -> JSONResponse:
    # A storage failure that is not a bug (the database cannot be reached or answers nothing in
    # LOOPLINE_DB_TIMEOUT_S, a lost race, a value it cannot store) is an answer like any other,
    # here, before Starlette's ServerErrorMiddleware, which would log a traceback per request and
    # close the connection. Anything else of these types goes on to `_unexpected_error` (500).
    response = storage_error_response(error)
    if response is None:
        raise error
    return response


async def _http_error(request: Request, error: StarletteHTTPException) -> Response:
    if error.status_code == 405:  # Starlette names only the methods of the first route on the path
        error.headers = {
            **(error.headers or {}),
            "Allow": ", ".join(allowed_methods(request.app.router.routes, request.scope)),
        }
    return await http_exception_handler(request, error)


async def _auth_error(_: Request, error: AuthError) -> JSONResponse:
    return auth_error_response(error)


async def _idempotency_error(_: Request, error: IdempotencyConflict) -> JSONResponse:
    return detail(error.status, error.detail)


async def _body_error(_: Request, error: BodyError) -> JSONResponse:
    return detail(error.status, error.message)


async def _client_gone(_: Request, _error: ClientDisconnect) -> JSONResponse:
    # The client broke its own body (a malformed chunk: uvicorn has answered 400 and logged one
    # warning) or left before sending it whole: nothing is logged here, and this answer goes
    # nowhere when the connection is gone.
    return detail(400, "The request body was not received whole")


async def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
    problems = "; ".join(
        f"{'.'.join(str(p) for p in item.get('loc', ())[1:]) or 'request'}: {item.get('msg')}"
        for item in error.errors()
    )
    return detail(400, problems or "Invalid request")


async def _grpc_error(_: Request, error: grpc.aio.AioRpcError) -> JSONResponse:
    return grpc_error_response(error)


_Handler = Callable[[Request, Any], Coroutine[Any, Any, Response]]


def _exception_handlers() -> dict[int | type[Exception], _Handler]:
    """Every failure rendered through the error table (errors.py)."""
    return {
        Exception: _unexpected_error,
        # a storage failure (`storage_error_response`): SQLAlchemy's, and OSError for a raw
        # ConnectionError / TimeoutError (asyncpg's timeouts come through unwrapped)
        SQLAlchemyError: _storage_error,
        OSError: _storage_error,
        StarletteHTTPException: _http_error,
        AuthError: _auth_error,
        IdempotencyConflict: _idempotency_error,
        BodyError: _body_error,
        ClientDisconnect: _client_gone,
        RequestValidationError: _validation_error,
        grpc.aio.AioRpcError: _grpc_error,
    }


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT")


def allowed_methods(routes: list[BaseRoute], scope: Scope) -> list[str]:
    """The methods some route of `routes` serves at the path of `scope`: a 405's `Allow` (RFC 9110
    section 15.5.6: every method the target supports).

    Starlette's 405 lists the methods of the first route whose path matches; a path has a route per
    method here (GET and POST /credentials). Every route is asked with each method, through
    Starlette's `matches`, which FastAPI's included routers answer too.
    """
    allowed = []
    for method in _METHODS:
        probe = {**scope, "method": method}
        if any(route.matches(probe)[0] == Match.FULL for route in routes):
            allowed.append(method)
    return allowed
