"""The gateway's HTTP API (FastAPI): the assistant routes of the spec and the official SDK.

Every route authenticates (`identity.Authenticator`) before it looks anything up
(AIP-193: permission before existence), calls the orchestrator over gRPC, and renders
failures through the one error table (`errors.py`). Request bodies are parsed here,
not by FastAPI's validator, so that every bad body gets the documented 400 (or 413)
with `{"detail": ...}` instead of a 422.

The two requests of every turn (the turn POST and the listen GET) are served by lean ASGI
handlers ahead of FastAPI (`GatewayApp`); they share their logic, error table and OpenAPI
declaration with the FastAPI endpoints of the same routes (issue 9, gateway CPU per turn).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import grpc
import orjson
from cachetools import LRUCache
from fastapi import Depends, FastAPI, Query, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import BaseRoute, Match
from starlette.types import Message, Receive, Scope, Send

from loopline.assistant.v1 import assistant_pb2, assistant_pb2_grpc
from services.common import pb
from services.common.errors import (
    ASSISTANT_DOMAIN,
    MAX_MESSAGE_CHARS,
    bounded,
    status_details,
)
from services.gateway.config import GatewaySettings
from services.gateway.errors import (
    SAFE_MESSAGES,
    BodyError,
    detail,
    grpc_error_response,
    storage_error_response,
    unavailable_response,
    unexpected_error_response,
)
from services.gateway.fanout import (
    SERVER_SEND,
    EventStreamResponse,
    RunFanout,
    StreamTimeout,
    StreamUnavailable,
    TooManyListens,
)
from services.gateway.http_limits import listens_refusal
from services.gateway.idempotency import (
    IdempotencyConflict,
    IdempotencyStore,
    body_hash,
    outcome_unknown,
)
from services.gateway.idempotency import (
    request_id as turn_request_id,
)  # "request_id" is also a question's id here
from services.gateway.identity import Authenticator, AuthError, Principal, user_email
from services.gateway.openapi import error_responses, json_schema_bounds
from services.gateway.org_settings import DefaultModels, settings_router
from services.gateway.query import TrueOrFalse, WholeNumber, single_query_values
from services.gateway.ratelimit import RateLimited, RequestLimits, key_of

log = logging.getLogger(__name__)


_LLM_PROPERTIES = {
    "integration_name": {"type": "string", "minLength": 1, "pattern": r"\S"},
    "provider_id": {"type": "string", "minLength": 1, "pattern": r"\S"},
    "model_id": {"type": "string", "minLength": 1, "pattern": r"\S"},
    "credential_id": {"type": ["string", "null"]},
}
_LLM_SCHEMA = {
    "type": ["object", "null"],
    "properties": _LLM_PROPERTIES,
    "required": ["integration_name", "provider_id", "model_id"],
    "additionalProperties": False,
}


# No Connection header: persistence is HTTP/1.1's default and the server's to decide (with an
# HTTP/1.0 client uvicorn adds "connection: close"; ours said keep-alive beside it).
_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def read_body(request: Request, limit: int) -> bytes:
    """The request body's bytes; BodyError 413 past `limit` bytes (by Content-Length, else as read)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise BodyError(413, f"Request body exceeds {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyError(413, f"Request body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json_object(request: Request, limit: int) -> dict[str, Any]:
    """The request body as a JSON object; BodyError 413 past `limit` bytes, 400 as `json_object` (not a
    JSON object, or nested too deep)."""
    return json_object(await read_body(request, limit))


async def refuse_body(request: Request, limit: int) -> None:
    """The check of a route that takes no body (a cancel, a delete, set-default), after its
    caller is known: no body, or an empty JSON object `{}` (what a client that always sends one
    sends), is taken; anything else is refused as any body is (README "Errors"): over `limit`
    bytes 413, not a JSON object 400, a field 400 `Unknown field(s): …` (a fresh-eyes test's
    `{"reason": "mine"}` on a cancel was ignored without a word, and a 2 MiB body taken)."""
    raw = await read_body(request, limit)
    if raw.strip():
        check_fields(json_object(raw), set())


class ClientGone(Exception):
    """The client disconnected before its request body was complete (nothing is answered)."""


async def receive_json_object(receive: Receive, declared: str | None, limit: int) -> dict[str, Any]:
    """`read_json_object` straight from ASGI `receive` (the lean routes of `GatewayApp`).

    `declared` is the Content-Length header (str or None); BodyError 413 past `limit` bytes,
    400 as `json_object` (not a JSON object, or nested too deep); ClientGone when the client
    disconnects first.
    """
    if declared and declared.isdigit() and int(declared) > limit:
        raise BodyError(413, f"Request body exceeds {limit} bytes")
    message = await receive()
    if message["type"] == "http.request" and not message.get("more_body", False):
        raw = message.get("body", b"")  # the whole body in one message: the common case
        if len(raw) > limit:
            raise BodyError(413, f"Request body exceeds {limit} bytes")
        return json_object(raw)
    chunks, size = [], 0
    while True:
        if message["type"] == "http.disconnect":
            raise ClientGone
        if message["type"] == "http.request":
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BodyError(413, f"Request body exceeds {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return json_object(b"".join(chunks))
        message = await receive()


def json_object(raw: bytes) -> dict[str, Any]:
    """`raw` parsed as a JSON object; BodyError 400 when empty, not JSON (UTF-8), not an object,
    nested deeper than `pb.MAX_JSON_DEPTH` levels of objects and arrays (the body itself is level 1),
    holding U+0000 in a string, or giving a name twice in one object (RFC 8259 §4, RFC 7493 §2.3).

    Every JSON body of the API is read here (`read_json_object`, `receive_json_object`), so the
    depth rule of values that cross a gRPC boundary (services/common/pb.py: protobuf decodes at
    most 100 message levels, 3 per JSON level in a Struct) is one check for every route: a body
    the orchestrator or the tools service could not decode is a 400 naming the limit, not a 500.
    """
    if not raw.strip():
        raise BodyError(400, "Request body must be a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        # orjson refuses past 1,024 levels ("depth limit exceeded") before reading the rest: valid
        # JSON, too deep, so the depth answer (not "not valid JSON")
        if any(word in str(exc).lower() for word in ("depth limit", "recursion")):
            raise BodyError(400, _TOO_DEEP) from None
        raise BodyError(400, "Request body is not valid JSON (UTF-8, no lone surrogates)") from None
    except RecursionError:  # a parser that recurses instead (none today): the same answer
        raise BodyError(400, _TOO_DEEP) from None
    if not isinstance(body, dict):
        raise BodyError(400, "Request body must be a JSON object")
    # Fewer brackets than the limit cannot nest deeper than it (a count in C, so the common small
    # body is never walked; brackets inside strings only make the walk happen).
    if (
        raw.count(b"{") + raw.count(b"[") > pb.MAX_JSON_DEPTH
        and pb.json_depth(body, pb.MAX_JSON_DEPTH) > pb.MAX_JSON_DEPTH
    ):
        raise BodyError(400, _TOO_DEEP)
    # PostgreSQL's text types cannot hold U+0000 (and it is never meaningful text), so a body with
    # one in a string is refused on either backend alike. In valid JSON it can only be written as
    # the escape \u0000 (a raw control character is invalid), so the common body is never walked.
    if b"\\u0000" in raw and pb.holds_nul(body):
        raise BodyError(400, _NUL)
    # A name given twice in one object is refused, not read as its last value (RFC 8259 §4: the
    # names of an object SHOULD be unique, and parsers differ on which value wins; I-JSON, RFC
    # 7493 §2.3, forbids it). orjson keeps the last silently, so the few bodies with more than
    # one name are read again by the standard library with a hook that sees every name.
    if raw.count(b":") > 1:
        try:
            json.loads(raw, object_pairs_hook=_unique_names)
        except _RepeatedName as exc:
            raise BodyError(
                400,
                f"Request body gives the name {bounded(json.dumps(exc.name, ensure_ascii=False), 200)} more than once in one object; give it once",
            ) from None
        except (
            ValueError,
            RecursionError,
        ):  # a limit of the second parser only: orjson read the body
            pass
    return body


class _RepeatedName(Exception):
    def __init__(self, name: str) -> None:
        self.name = name


def _unique_names(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json.loads' object hook: the object, or _RepeatedName for a name it has twice."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                raise _RepeatedName(name)
            seen.add(name)
    return obj


_NUL = "Request body contains a NUL character (\\u0000) in a string; text fields cannot hold it"
STREAM_NEEDS_HTTP_1_1 = "Event streams need HTTP/1.1 (they are sent with chunked transfer encoding); retry with HTTP/1.1"
NUL_IN_URL = (
    "A path or query value contains a NUL character (%00); ids and text values cannot hold it"
)
_TOO_DEEP = f"Request body is nested deeper than {pb.MAX_JSON_DEPTH} levels of objects and arrays (the body itself counts as one)"


def check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    """BodyError 400 naming the fields of `body` outside `allowed` (unknown fields are refused)."""
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BodyError(400, f"Unknown field(s): {', '.join(unknown)}")


def parse_llm(value: Any) -> assistant_pb2.LlmConfig | None:
    """The `llm` object {integration_name, provider_id, model_id, credential_id?} or None; BodyError 400 when malformed."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BodyError(
            400, "llm must be an object {integration_name, provider_id, model_id, credential_id?}"
        )
    check_fields(value, {"integration_name", "provider_id", "model_id", "credential_id"})
    fields = {}
    for name in ("integration_name", "provider_id", "model_id"):
        item = value.get(name)
        if not isinstance(item, str) or not item.strip():
            raise BodyError(400, f"llm.{name} must be a non-empty string")
        fields[name] = item
    credential = value.get("credential_id")
    if credential is not None and not isinstance(credential, str):
        raise BodyError(400, "llm.credential_id must be a string")
    return (
        assistant_pb2.LlmConfig(**fields, credential_id=credential)
        if credential
        else assistant_pb2.LlmConfig(**fields)
    )


def auth_error_response(error: AuthError) -> JSONResponse:
    """`{"detail": ...}` with the status of `error` (401 adds `WWW-Authenticate: Bearer`); a rate
    limit's refusal (ratelimit.py) is the rate denial envelope with 429."""
    if isinstance(error, RateLimited):
        return error.response()
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return detail(error.status, error.detail, headers)


def request_error_response(error: Exception) -> Response:
    """The response for an AuthError, BodyError, IdempotencyConflict or grpc.aio.AioRpcError
    (the same as the app's exception handlers give); TypeError for anything else."""
    if isinstance(error, AuthError):
        return auth_error_response(error)
    if isinstance(error, BodyError):
        return detail(error.status, error.message)
    if isinstance(error, IdempotencyConflict):
        return detail(error.status, error.detail)
    if isinstance(error, grpc.aio.AioRpcError):
        return grpc_error_response(error)
    raise TypeError(f"not a request error: {type(error).__name__}")


_REQUEST_ERRORS = (AuthError, BodyError, IdempotencyConflict, grpc.aio.AioRpcError)
# Appended to the orchestrator's 400 about an unusable model when the turn named none and the
# organization's saved default was used: without it the client cannot tell where the model came from.
FROM_SAVED_DEFAULT = (
    " (from the organization's default model, PUT /organizations/settings/composer-llm)"
)


def from_saved_default(message: str) -> BodyError:
    """BodyError 400 with `message` about a turn's model and FROM_SAVED_DEFAULT appended (the
    message cut to fit the detail's bound, never the suffix)."""
    return BodyError(
        400, bounded(message, MAX_MESSAGE_CHARS - len(FROM_SAVED_DEFAULT)) + FROM_SAVED_DEFAULT
    )


def saved_default_error(error: grpc.aio.AioRpcError) -> BodyError | None:
    """The 400 for a turn whose model, the organization's saved default, the orchestrator refused
    (INVALID_ARGUMENT UNKNOWN_MODEL: unknown or disabled provider or model, or an unusable
    credential, e.g. a deleted one): `from_saved_default` of its message. None for any other
    error, which the error table renders as it is."""
    parsed = status_details(error)
    if (
        parsed.domain != ASSISTANT_DOMAIN
        or parsed.reason != "UNKNOWN_MODEL"
        or parsed.code != grpc.StatusCode.INVALID_ARGUMENT
    ):
        return None
    return from_saved_default(parsed.message or "the model cannot be used")


_MAX_AFTER = 2**53
ASGIHandler = Callable[[Scope, Receive, Send], Awaitable[None]]


class GatewayApp(FastAPI):
    """The gateway's FastAPI application, with the two requests of every turn served lean.

    `POST /assistant/chat` and `GET /assistant/chat/{chat_id}/listen/{run_id}` (with no query
    or only `after=<digits>`) are handed straight to the plain ASGI handlers in `lean` before
    Starlette's middleware stack, router and FastAPI's request handling (dependency solving,
    validation), which cost ~1 ms of CPU per turn (issue 9). The handlers share their logic and
    error table with the FastAPI endpoints of the same routes, which stay registered: they
    produce the OpenAPI document and serve every other shape of request (a listen with any
    other query string goes through FastAPI's validation and its 400s).

    Every HTTP request also gets the server's own `send` in `scope["loopline.server_send"]`
    (`fanout.SERVER_SEND`; the SSE fast path finds the connection with it).
    """

    lean: dict[str, ASGIHandler]

    def openapi(self) -> dict[str, Any]:
        """FastAPI's OpenAPI document with numeric bounds as JSON Schema keywords (`json_schema_bounds`)."""
        document = super().openapi()
        if getattr(self, "_bounds_fixed", None) is not document:  # FastAPI caches it; repaired once
            json_schema_bounds(document)
            self._bounds_fixed = document
        return document

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one ASGI connection scope (see the class docstring for the lean routes).

        A request still unanswered when the server's graceful shutdown runs out (uvicorn then
        cancels it) is answered 503 with Retry-After like any "down or busy, retry" answer
        (README error table), not uvicorn's text/plain 500 (fresh-eyes test)."""
        if scope["type"] != "http":
            return await super().__call__(scope, receive, send)
        scope[SERVER_SEND] = (
            send  # the server's own: the SSE fast path finds the connection with it
        )
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self._http(scope, receive, tracked)
        except asyncio.CancelledError:
            if started:
                raise
            with contextlib.suppress(Exception):
                await unavailable_response()(scope, receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The HTTP dispatch: NUL and HTTP/1.0-stream refusals, the lean routes, else FastAPI."""
        if "\x00" in scope["path"] or b"%00" in scope.get("query_string", b""):
            # PostgreSQL's text types cannot hold U+0000 (fresh-eyes re-test: an id or query
            # value with %00 reached a WHERE clause there and was a 500): refused on either backend
            return await detail(400, NUL_IN_URL)(scope, receive, send)
        if (
            scope.get("http_version") == "1.0"
            and scope["method"] == "GET"
            and "/listen/" in scope["path"]
        ):
            # an event stream is sent chunked (uvicorn frames every body without a length so,
            # and HTTP/1.0 has no chunked encoding): say so instead of a stream the client misreads
            return await detail(505, STREAM_NEEDS_HTTP_1_1)(scope, receive, send)
        lean = getattr(self, "lean", None)
        if lean and not scope.get("root_path"):
            method, path = scope["method"], scope["path"]
            if method == "POST":
                if path == "/assistant/chat":
                    return await lean["start_turn"](scope, receive, send)
            elif method == "GET" and path.startswith("/assistant/chat/") and path.count("/") == 5:
                return await lean["listen"](scope, receive, send)
        await super().__call__(scope, receive, send)


def _listen_target(scope: Scope) -> tuple[str, str, int] | None:
    """(chat_id, run_id, after) of a listen request the lean route serves, else None.

    The path must be exactly /assistant/chat/<chat_id>/listen/<run_id> (non-empty segments, as
    Starlette's `{param}` matches) and the query empty or `after=<1-16 digits>` <= 2**53.
    """
    parts = scope["path"].split("/")  # "", "assistant", "chat", chat_id, "listen", run_id
    if len(parts) != 6 or parts[4] != "listen" or not parts[3] or not parts[5]:
        return None
    query = scope.get("query_string", b"")
    if not query:
        return parts[3], parts[5], 0
    if query[:6] != b"after=" or not 6 < len(query) <= 22 or not query[6:].isdigit():
        return None
    after = int(query[6:])
    return (parts[3], parts[5], after) if after <= _MAX_AFTER else None


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT")


def allowed_methods(routes: list[BaseRoute], scope: Scope) -> list[str]:
    """The methods some route of `routes` serves at the path of `scope`: a 405's `Allow` (RFC 9110
    section 15.5.6: every method the target supports).

    Starlette's 405 lists the methods of the first route whose path matches; a path has a route per
    method here (GET and POST /credentials), so `OPTIONS /credentials` answered `Allow: POST`
    (security tester). Every route is asked with each method, through Starlette's `matches`, which
    FastAPI's included routers answer too.
    """
    allowed = []
    for method in _METHODS:
        probe = {**scope, "method": method}
        if any(route.matches(probe)[0] == Match.FULL for route in routes):
            allowed.append(method)
    return allowed


def _headers(scope: Scope, *names: bytes) -> list[str | None]:
    """The first value (latin-1, as Starlette's `Headers.get`) of each header in `names` (lower case)."""
    values: list[str | None] = [None] * len(names)
    for name, value in scope["headers"]:
        if name in names:
            index = names.index(name)
            if values[index] is None:
                values[index] = value.decode("latin-1")
    return values


def create_app(
    settings: GatewaySettings,
    authenticator: Authenticator,
    channel: grpc.aio.Channel,
    idempotency: IdempotencyStore,
    default_models: DefaultModels,
    tools_channel: grpc.aio.Channel | None = None,
) -> FastAPI:
    """The FastAPI application serving the assistant API against the orchestrator on `channel`
    (and, with `tools_channel`, the credentials and knowledge routes of `tools_routes.py`)."""
    app = GatewayApp(
        title="Loopline",
        version="0.1.0",
        description="Assistant turns (reason -> act -> observe) streamed as Server-Sent Events.",
        # No OpenTelemetry here: without this FastAPI looks up the global tracer, meter and logger
        # providers on every request (issue 9, gateway CPU per turn).
        telemetry={"tracing": False, "metrics": False, "logs": False},
        dependencies=[
            Depends(single_query_values)
        ],  # a query parameter given twice is 400 (services/gateway/query.py)
        # A path with a trailing slash is the 404 of any unknown path: Starlette's default redirect
        # (307) answered before any API key was checked and wrote the request's Host header into
        # its Location (fresh-eyes test: `Host: evil.example` gave `location: http://evil.example/…`).
        redirect_slashes=False,
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
    fanout = RunFanout(
        orchestrator,
        settings.heartbeat_interval_s,
        settings.write_threads,
        settings.http_send_timeout_s,
        settings.http_listens_per_key,
    )
    app.state.fanout = fanout

    async def principal(request: Request) -> Principal:
        return await limits.authenticate(
            request.scope,
            request.headers.get("authorization"),
            request.headers.get("x-organization-id"),
        )

    # built once per principal (only ever copied into requests); least recently used out past 10,000
    callers: LRUCache[Principal, assistant_pb2.Caller] = LRUCache(10_000)

    def caller(who: Principal) -> assistant_pb2.Caller:
        built = callers.get(who)
        if built is None:
            built = callers[who] = assistant_pb2.Caller(
                organization_id=who.organization_id, user_id=who.user_id
            )
        return built

    @app.exception_handler(Exception)
    async def _unexpected_error(_: Request, error: Exception) -> JSONResponse:
        # Starlette's ServerErrorMiddleware sends this answer, then re-raises the error, and
        # uvicorn closes the connection: say so (RFC 9112 section 9.6), or a keep-alive client
        # sends its next request into a closed socket (fresh-eyes test: "connection reset").
        response = unexpected_error_response(error)
        response.headers["Connection"] = "close"
        return response

    async def _storage_error(_: Request, error: Exception) -> JSONResponse:
        # A storage failure that is not a bug (the database cannot be reached or answers nothing in
        # LOOPLINE_DB_TIMEOUT_S, a lost race, a value it cannot store) is an answer like any other,
        # here, before Starlette's ServerErrorMiddleware, which re-raises: it was logged as an
        # "Exception in ASGI application" ERROR traceback per request and closed the connection
        # (F5 re-test). Anything else of these types goes on to `_unexpected_error` (500, logged).
        response = storage_error_response(error)
        if response is None:
            raise error
        return response

    # the exception types of a storage failure (`storage_error_response`): SQLAlchemy's, and
    # OSError for a raw ConnectionError / TimeoutError (asyncpg's timeouts come through unwrapped)
    for storage_error in (SQLAlchemyError, OSError):
        app.add_exception_handler(storage_error, _storage_error)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> Response:
        if (
            error.status_code == 405
        ):  # Starlette names only the methods of the first route on the path
            error.headers = {
                **(error.headers or {}),
                "Allow": ", ".join(allowed_methods(request.app.router.routes, request.scope)),
            }
        return await http_exception_handler(request, error)

    @app.exception_handler(AuthError)
    async def _auth_error(_: Request, error: AuthError) -> JSONResponse:
        return auth_error_response(error)

    @app.exception_handler(IdempotencyConflict)
    async def _idempotency_error(_: Request, error: IdempotencyConflict) -> JSONResponse:
        return detail(error.status, error.detail)

    @app.exception_handler(BodyError)
    async def _body_error(_: Request, error: BodyError) -> JSONResponse:
        return detail(error.status, error.message)

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(_: Request, _error: ClientDisconnect) -> JSONResponse:
        # The client broke its own body (a malformed chunk: uvicorn has answered 400 and logged one
        # warning) or left before sending it whole: nothing is logged here, and this answer goes
        # nowhere when the connection is gone.
        return detail(400, "The request body was not received whole")

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in item.get('loc', ())[1:]) or 'request'}: {item.get('msg')}"
            for item in error.errors()
        )
        return detail(400, problems or "Invalid request")

    @app.exception_handler(grpc.aio.AioRpcError)
    async def _grpc_error(_: Request, error: grpc.aio.AioRpcError) -> JSONResponse:
        return grpc_error_response(error)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post(
        "/assistant/chat",
        summary="Start a turn (new chat, or continue one)",
        responses=error_responses(402, 404, 409, 413, 422, 429, denial=True),
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "properties": {
                                "message": {"type": "string", "minLength": 1, "pattern": r"\S"},
                                "chat_id": {"type": ["string", "null"]},
                                "llm": _LLM_SCHEMA,
                            },
                            "required": ["message"],
                            "additionalProperties": False,
                        }
                    }
                },
            }
        },
    )
    async def start_turn(request: Request) -> Response:
        who = await principal(request)
        body = await read_json_object(request, settings.max_body_bytes)
        return await turn_response(who, body, request.headers.get("idempotency-key"))

    async def start_turn_lean(scope: Scope, receive: Receive, send: Send) -> None:
        authorization, organization, length, key = _headers(
            scope, b"authorization", b"x-organization-id", b"content-length", b"idempotency-key"
        )
        try:
            who = await limits.authenticate(scope, authorization, organization)
            body = await receive_json_object(receive, length, settings.max_body_bytes)
            response = await turn_response(who, body, key)
        except _REQUEST_ERRORS as error:
            response = request_error_response(error)
        except ClientGone:
            return
        except Exception as error:  # noqa: BLE001 - the same answer as FastAPI's handler below
            response = unexpected_error_response(error)
        await response(scope, receive, send)

    async def turn_response(who: Principal, body: dict[str, Any], key: str | None) -> Response:
        """The answer to a turn POST of `who` with JSON `body` and Idempotency-Key `key` (or None);
        raises BodyError, IdempotencyConflict or grpc.aio.AioRpcError (the error table renders them).

        Without `llm` the organization's saved default is used; when the orchestrator refuses it
        the 400 says so (`saved_default_error`)."""
        check_fields(body, {"message", "chat_id", "llm"})
        message = body.get("message")
        if not isinstance(message, str):
            raise BodyError(400, "message must be a JSON string (v1 is text-only)")
        if not message.strip():
            raise BodyError(400, "message must not be empty")
        chat_id = body.get("chat_id")
        if chat_id is not None and not isinstance(chat_id, str):
            raise BodyError(400, "chat_id must be a string")
        llm = parse_llm(body.get("llm"))
        from_default = False
        if llm is None:
            saved = await default_models.get(who.organization_id)
            try:
                llm = parse_llm(saved) if saved else None
            except (
                BodyError
            ) as malformed:  # saved by an admin command, which checks less than PUT does
                raise from_saved_default(malformed.message) from None
            from_default = llm is not None
        rpc = assistant_pb2.StartTurnRequest(
            caller=caller(who), message=message, chat_id=chat_id or "", kind="assistant"
        )
        if llm is not None:
            rpc.llm.CopyFrom(llm)
        if key is None:
            return await _start(rpc, from_default)
        route = "POST /assistant/chat"
        digest = body_hash(route, orjson.dumps(body, option=orjson.OPT_SORT_KEYS))
        replay = await idempotency.claim(who.organization_id, who.user_id, key, route, digest)
        if replay is not None:
            return Response(
                replay[1],
                status_code=replay[0],
                media_type="application/json",
                headers={"Idempotent-Replayed": "true"},
            )
        # the orchestrator's own idempotency key (AIP-155 request_id): a retry of a start that
        # failed here (504, 503) after the turn did start answers that turn instead of a second one
        rpc.request_id = turn_request_id(who.organization_id, who.user_id, key, digest)
        try:
            response = await _start(rpc, from_default)
        except BaseException as failure:
            if outcome_unknown(failure):  # it may have started: only the same body may retry
                await idempotency.release_unknown(who.organization_id, who.user_id, key)
            else:
                await idempotency.release(who.organization_id, who.user_id, key)
            raise
        await idempotency.complete(
            who.organization_id,
            who.user_id,
            key,
            response.status_code,
            bytes(response.body).decode(),
        )
        return response

    async def _start(rpc: assistant_pb2.StartTurnRequest, from_default: bool = False) -> Response:
        call = orchestrator.StartTurn(rpc, timeout=30)
        try:
            response = await call
        except grpc.aio.AioRpcError as error:
            refused = saved_default_error(error) if from_default else None
            if refused is not None:
                raise refused from None
            raise
        headers = {}
        for key, value in await call.trailing_metadata() or ():
            if key.startswith("x-ratelimit-"):
                headers["X-RateLimit-" + key[len("x-ratelimit-") :].capitalize()] = value
        # orjson: the same compact JSON as JSONResponse's json.dumps for these ASCII fields, cheaper
        return Response(
            orjson.dumps(_turn_json(response)), headers=headers, media_type="application/json"
        )

    @app.get(
        "/assistant/chat/{chat_id}/listen/{run_id}",
        summary="Stream a run's events as Server-Sent Events",
        responses={
            **error_responses(404),
            200: {
                "description": "text/event-stream of `data: <json>` frames",
                "content": {"text/event-stream": {}},
            },
        },
    )
    async def listen(
        chat_id: str,
        run_id: str,
        request: Request,
        after: Annotated[WholeNumber, Query(ge=0, le=_MAX_AFTER)] = 0,
    ) -> Response:
        who = await principal(request)
        return await stream_response(
            who, chat_id, run_id, after, request.headers.get("authorization")
        )

    async def listen_lean(scope: Scope, receive: Receive, send: Send) -> None:
        target = _listen_target(scope)
        if target is None:  # another path shape or query: FastAPI's routing and validation decide
            await FastAPI.__call__(app, scope, receive, send)
            return
        authorization, organization = _headers(scope, b"authorization", b"x-organization-id")
        try:
            who = await limits.authenticate(scope, authorization, organization)
            response: Response = await stream_response(who, *target, authorization)
        except AuthError as error:
            response = auth_error_response(error)
        except Exception as error:  # noqa: BLE001 - the same answer as FastAPI's handler below
            response = unexpected_error_response(error)
        await response(scope, receive, send)

    async def stream_response(
        who: Principal, chat_id: str, run_id: str, after: int, authorization: str | None
    ) -> Response:
        """The SSE response of `who` (with `authorization`, whose key's listens are counted) listening
        to a run from frame `after`, or the error response."""
        key = key_of(authorization or "")
        try:
            hub = await fanout.open(caller(who), chat_id, run_id, key)
        except TooManyListens as refused:
            return listens_refusal(refused.limit)
        except grpc.aio.AioRpcError as error:
            return grpc_error_response(error)
        except StreamUnavailable:
            return unavailable_response()
        except StreamTimeout:
            return detail(504, SAFE_MESSAGES[504])
        return EventStreamResponse(fanout, hub, after, headers=_STREAM_HEADERS, key=key)

    app.lean = {"start_turn": start_turn_lean, "listen": listen_lean}

    @app.post(
        "/assistant/chat/{chat_id}/resume",
        summary="Answer a pending question and resume",
        responses=error_responses(404, 409, 413),
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "properties": {
                                "request_id": {"type": "string", "minLength": 1},
                                "response": {
                                    "type": "object",
                                    "properties": {"kind": {"type": "string"}},
                                    "required": ["kind"],
                                },
                                "llm": _LLM_SCHEMA,
                            },
                            "required": ["request_id", "response"],
                            "additionalProperties": False,
                        }
                    }
                },
            }
        },
    )
    async def resume(chat_id: str, request: Request) -> Response:
        who = await principal(request)
        body = await read_json_object(request, settings.max_body_bytes)
        check_fields(body, {"request_id", "response", "llm"})
        request_id, answer = body.get("request_id"), body.get("response")
        if not isinstance(request_id, str) or not request_id:
            raise BodyError(400, "request_id must be a non-empty string")
        if not isinstance(answer, dict) or not isinstance(answer.get("kind"), str):
            raise BodyError(
                400, "response must be an object with a 'kind' (the SDK's UserInputResponse)"
            )
        llm = parse_llm(body.get("llm"))
        # the answer as JSON text (numbers exact, keys in the client's order), and as a Struct beside it
        # for an orchestrator of an older version (it reads only `response`)
        rpc = assistant_pb2.ResumeRequest(
            caller=caller(who),
            chat_id=chat_id,
            request_id=request_id,
            response=pb.to_struct(answer),
            response_json=pb.json_bytes(answer),
        )
        if llm is not None:
            rpc.llm.CopyFrom(llm)
        return JSONResponse(_turn_json(await orchestrator.Resume(rpc, timeout=30)))

    @app.post(
        "/assistant/chat/{chat_id}/cancel",
        summary="Cancel the chat's active run",
        responses=error_responses(404),
    )
    async def cancel(chat_id: str, request: Request) -> Response:
        who = await principal(request)
        await refuse_body(request, settings.max_body_bytes)
        response = await orchestrator.Cancel(
            assistant_pb2.CancelRequest(
                caller=caller(who), chat_id=chat_id, reason="cancelled by user"
            ),
            timeout=30,
        )
        return JSONResponse(
            {"status": response.status, "chat_id": response.chat_id, "run_id": response.run_id}
        )

    @app.get(
        "/assistant/chat/{chat_id}",
        summary="A chat with its messages and pending question",
        responses=error_responses(404),
    )
    async def get_chat(
        chat_id: str,
        request: Request,
        page_size: Annotated[WholeNumber, Query(ge=0, le=1000)] = 0,
        page_token: str | None = None,
    ) -> Response:
        who = await principal(request)
        response = await orchestrator.GetChat(
            assistant_pb2.GetChatRequest(
                caller=caller(who),
                chat_id=chat_id,
                page_size=page_size,
                page_token=page_token or "",
            ),
            timeout=30,
        )
        chat = response.chat
        older = (
            {"next_page_token": response.next_page_token} if response.next_page_token else {}
        )  # only when there are older messages
        # orjson: the JSON fields' text (`*_json`) goes into the body as the orchestrator wrote it
        # (pb.field_fragment: numbers exact, keys in their stored order); an older orchestrator's Struct
        # or Value is converted
        return Response(
            orjson.dumps(
                {
                    "id": chat.id,
                    "kind": "assistant",  # the spec's chat: the surface discriminator, and never workflow-bound
                    "workflow_id": None,
                    "title": chat.title,
                    "running_id": chat.running_id or None,
                    "pending_user_input_request": pb.field_fragment(
                        chat, "pending_user_input_request"
                    ),
                    "created_at": pb.iso(chat.create_time),
                    "updated_at": pb.iso(chat.update_time),
                    "messages": [
                        {
                            "id": m.id,
                            "role": m.role,
                            "content": pb.field_fragment(m, "content"),
                            "thinking": pb.field_fragment(m, "thinking"),
                            "run_id": m.run_id or None,
                            "running_status": m.running_status or None,
                            "created_at": pb.iso(m.create_time),
                        }
                        for m in response.messages
                    ],
                    **older,
                }
            ),
            media_type="application/json",
        )

    @app.get(
        "/assistant/chats", summary="The caller's chats, newest first", responses=error_responses()
    )
    async def list_chats(
        request: Request,
        limit: Annotated[WholeNumber, Query(ge=1, le=100)] = 20,
        cursor: str | None = None,
    ) -> Response:
        who = await principal(request)
        response = await orchestrator.ListChats(
            assistant_pb2.ListChatsRequest(caller=caller(who), limit=limit, cursor=cursor or ""),
            timeout=30,
        )
        return JSONResponse(
            {
                "items": [
                    {
                        "id": c.id,
                        "title": c.title,
                        "created_at": pb.iso(c.create_time),
                        "updated_at": pb.iso(c.update_time),
                        "is_running": bool(c.running_id) and not _pending(c),
                    }
                    for c in response.chats
                ],
                "next_cursor": response.next_cursor or None,
            }
        )

    @app.get(
        "/assistant/chat/{chat_id}/status",
        summary="Whether the chat is running or awaiting input",
        responses=error_responses(404),
    )
    async def status(chat_id: str, request: Request) -> Response:
        who = await principal(request)
        r = await orchestrator.GetChatStatus(
            assistant_pb2.GetChatStatusRequest(caller=caller(who), chat_id=chat_id), timeout=30
        )
        return JSONResponse(
            {
                "chat_id": r.chat_id,
                "is_running": r.is_running,
                "awaiting_input": r.awaiting_input,
                "pending_request_id": r.pending_request_id or None,
                "running_id": r.running_id or None,
                "run_status": pb.from_struct(r.run_status) if r.HasField("run_status") else None,
            }
        )

    @app.delete(
        "/assistant/chat/{chat_id}",
        summary="Delete a chat (soft unless permanent=true)",
        responses=error_responses(404, 409),
    )
    async def delete_chat(
        chat_id: str, request: Request, permanent: TrueOrFalse = False
    ) -> Response:
        who = await principal(request)
        await refuse_body(request, settings.max_body_bytes)
        r = await orchestrator.DeleteChat(
            assistant_pb2.DeleteChatRequest(
                caller=caller(who), chat_id=chat_id, permanent=permanent
            ),
            timeout=30,
        )
        return JSONResponse({"status": r.status, "chat_id": r.chat_id, "permanent": r.permanent})

    if tools_channel is not None:
        from services.gateway.tools_routes import tools_router  # noqa: PLC0415 - tools_routes imports this module

        app.include_router(
            tools_router(
                settings,
                principal,
                tools_channel,
                channel,
                user_email=lambda user_id: user_email(authenticator.sessions, user_id),
                hold_default_model=default_models.exclusive,
            )
        )

    async def check_model(who: Principal, llm: assistant_pb2.LlmConfig) -> None:
        await orchestrator.CheckModel(
            assistant_pb2.CheckModelRequest(caller=caller(who), llm=llm), timeout=30
        )

    app.include_router(
        settings_router(
            default_models,
            principal,
            parse_llm,
            lambda r: read_json_object(r, settings.max_body_bytes),
            check_model,
            lambda r: refuse_body(r, settings.max_body_bytes),
        )
    )
    return app


def _turn_json(response: Any) -> dict[str, Any]:
    return {
        "status": response.status,
        "chat_id": response.chat_id,
        "run_id": response.run_id,
        "thread_id": response.thread_id,
        "stream_url": response.stream_url,
    }


def _pending(chat: assistant_pb2.Chat) -> bool:
    """Whether `chat` (of ListChats) has a pending question: its `pending_user_input_request_json`,
    or the Struct an orchestrator of an older version sets instead."""
    return bool(chat.pending_user_input_request_json) or chat.HasField("pending_user_input_request")
