"""The two requests of every turn, served lean: POST /assistant/chat and GET .../listen/{run_id}.

`GatewayApp` hands them straight to plain ASGI handlers before Starlette's middleware stack,
router and FastAPI's request handling (dependency solving, validation), which cost ~1 ms of CPU
per turn. `TurnRequests` answers them, for these handlers and for the FastAPI endpoints of the
same routes (routes/turns.py) alike, which stay registered: they produce the OpenAPI document
and serve every other shape of request (a listen with another query string goes through
FastAPI's validation and its 400s).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import orjson
from fastapi import FastAPI
from fastapi.responses import Response
from starlette.types import Message, Receive, Scope, Send

from loopline.assistant.v1 import assistant_pb2
from services.common.errors import ASSISTANT_DOMAIN, MAX_MESSAGE_CHARS, bounded, status_details
from services.gateway.access_log import ROUTE, RequestLog
from services.gateway.bodies import ClientGone, check_fields, parse_llm, receive_json_object
from services.gateway.context import GatewayContext, auth_error_response
from services.gateway.errors import (
    SAFE_MESSAGES,
    BodyError,
    detail,
    grpc_error_response,
    unavailable_response,
    unexpected_error_response,
)
from services.gateway.fanout import StreamTimeout, StreamUnavailable, TooManyListens
from services.gateway.http_limits import listens_refusal
from services.gateway.idempotency import IdempotencyConflict, body_hash, outcome_unknown
from services.gateway.idempotency import request_id as turn_request_id
from services.gateway.identity import AuthError, Principal
from services.gateway.listener import SERVER_SEND, EventStreamResponse
from services.gateway.openapi import finish_document
from services.gateway.ratelimit import key_of
from services.gateway.schemas import TurnStarted

ASGIHandler = Callable[[Scope, Receive, Send], Awaitable[None]]
MAX_AFTER = 2**53  # the largest `after` of a listen (JSON's exact integers)
# No Connection header: persistence is HTTP/1.1's default and the server's to decide (with an
# HTTP/1.0 client uvicorn adds "connection: close").
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
STREAM_NEEDS_HTTP_1_1 = (
    "Event streams need HTTP/1.1 (they are sent with chunked transfer encoding);"
    " retry with HTTP/1.1"
)
NUL_IN_URL = (
    "A path or query value contains a NUL character (%00); ids and text values cannot hold it"
)
# Appended to the orchestrator's 400 about an unusable model when the turn named none and the
# organization's saved default was used: without it the client cannot tell where the model
# came from.
FROM_SAVED_DEFAULT = (
    " (from the organization's default model, PUT /organizations/settings/composer-llm)"
)
_REQUEST_ERRORS = (AuthError, BodyError, IdempotencyConflict, grpc.aio.AioRpcError)


class GatewayApp(FastAPI):
    """The gateway's FastAPI application, with the two requests of every turn served lean.

    `POST /assistant/chat` and `GET /assistant/chat/{chat_id}/listen/{run_id}` (with no query
    or only `after=<digits>`) go to the handlers in `lean` (`lean_handlers`); everything else
    to FastAPI. Every HTTP request also gets the server's own `send` in
    `scope["loopline.server_send"]` (`listener.SERVER_SEND`; the SSE fast path finds the
    connection with it).
    """

    lean: dict[str, ASGIHandler]
    _finished: dict[str, Any] | None = None

    def openapi(self) -> dict[str, Any]:
        """FastAPI's OpenAPI document, completed by `openapi.finish_document`."""
        document = super().openapi()
        if self._finished is not document:  # FastAPI caches it; completed once
            finish_document(document)
            self._finished = document
        return document

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one ASGI connection scope.

        A request still unanswered when the server's graceful shutdown runs out (uvicorn then
        cancels it) is answered 503 with Retry-After like any "down or busy, retry" answer, not
        uvicorn's text/plain 500. Every request gets a request id and an access line
        (access_log.py)."""
        if scope["type"] != "http":
            return await super().__call__(scope, receive, send)
        # the server's own (put there already when the app is traced: http_tracing.py): the SSE
        # fast path finds the connection with it
        scope.setdefault(SERVER_SEND, send)
        access = RequestLog(scope)  # the request id, and the access line at the end

        async def tracked(message: Message) -> None:
            if not access.status:  # the first message: http.response.start
                message = access.response_start(message)
            await send(message)

        try:
            await self._http(scope, receive, tracked)
        except asyncio.CancelledError:
            if access.status:
                raise
            with contextlib.suppress(Exception):
                await unavailable_response()(scope, receive, tracked)
        except Exception:
            access.status = access.status or 500  # uvicorn answers 500 for an app that raised
            raise
        finally:
            access.end(scope)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The HTTP dispatch: NUL and HTTP/1.0-stream refusals, the lean routes, else FastAPI."""
        if "\x00" in scope["path"] or b"%00" in scope.get("query_string", b""):
            # PostgreSQL's text types cannot hold U+0000: refused on either backend
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


def lean_handlers(
    app: FastAPI, context: GatewayContext, turns: TurnRequests
) -> dict[str, ASGIHandler]:
    """The lean ASGI handlers of the turn POST ("start_turn") and the listen GET ("listen")."""
    authenticate, settings = context.limits.authenticate, context.settings
    start, listen = turns.start, turns.listen

    async def start_turn_lean(scope: Scope, receive: Receive, send: Send) -> None:
        scope[ROUTE] = "/assistant/chat"
        authorization, organization, length, key = _headers(
            scope, b"authorization", b"x-organization-id", b"content-length", b"idempotency-key"
        )
        try:
            who = await authenticate(scope, authorization, organization)
            body = await receive_json_object(receive, length, settings.max_body_bytes)
            response = await start(who, body, key)
        except _REQUEST_ERRORS as error:
            response = request_error_response(error)
        except ClientGone:
            return
        except Exception as error:  # noqa: BLE001 - the same answer as FastAPI's handler
            response = unexpected_error_response(error)
        await response(scope, receive, send)

    async def listen_lean(scope: Scope, receive: Receive, send: Send) -> None:
        target = _listen_target(scope)
        if target is None:  # another path shape or query: FastAPI's routing and validation decide
            await FastAPI.__call__(app, scope, receive, send)
            return
        scope[ROUTE] = "/assistant/chat/{chat_id}/listen/{run_id}"
        authorization, organization = _headers(scope, b"authorization", b"x-organization-id")
        try:
            who = await authenticate(scope, authorization, organization)
            response: Response = await listen(who, *target, authorization)
        except AuthError as error:
            response = auth_error_response(error)
        except Exception as error:  # noqa: BLE001 - the same answer as FastAPI's handler
            response = unexpected_error_response(error)
        await response(scope, receive, send)

    return {"start_turn": start_turn_lean, "listen": listen_lean}


class TurnRequests:
    """The answers to a turn POST (`start`) and a listen GET (`listen`), for either path."""

    __slots__ = ("_context",)

    def __init__(self, context: GatewayContext) -> None:
        self._context = context

    async def start(self, who: Principal, body: dict[str, Any], key: str | None) -> Response:
        """The answer to a turn POST of `who` with JSON `body` and Idempotency-Key `key` (or None);
        raises BodyError, IdempotencyConflict or grpc.aio.AioRpcError (the error table renders
        them). Without `llm` the organization's saved default is used; when the orchestrator
        refuses it the 400 says so (`saved_default_error`)."""
        context = self._context
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
            saved = await context.default_models.get(who.organization_id)
            try:
                llm = parse_llm(saved) if saved else None
            except BodyError as malformed:  # saved by an admin command, which checks less than PUT
                raise from_saved_default(malformed.message) from None
            from_default = llm is not None
        rpc = assistant_pb2.StartTurnRequest(
            caller=context.caller(who), message=message, chat_id=chat_id or "", kind="assistant"
        )
        if llm is not None:
            rpc.llm.CopyFrom(llm)
        if key is None:
            return await self._start(rpc, from_default)
        idempotency = context.idempotency
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
            response = await self._start(rpc, from_default)
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

    async def _start(self, rpc: assistant_pb2.StartTurnRequest, from_default: bool) -> Response:
        call = self._context.orchestrator.StartTurn(rpc, timeout=30)
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
        # orjson: the same compact JSON as JSONResponse's json.dumps for these ASCII fields
        return Response(
            orjson.dumps(turn_json(response)), headers=headers, media_type="application/json"
        )

    async def listen(
        self, who: Principal, chat_id: str, run_id: str, after: int, authorization: str | None
    ) -> Response:
        """The SSE response of `who` (with `authorization`, whose key's listens are counted)
        listening to a run from frame `after`, or the error response."""
        fanout = self._context.fanout
        key = key_of(authorization or "")
        try:
            hub = await fanout.open(self._context.caller(who), chat_id, run_id, key)
        except TooManyListens as refused:
            return listens_refusal(refused.limit)
        except grpc.aio.AioRpcError as error:
            return grpc_error_response(error)
        except StreamUnavailable:
            return unavailable_response()
        except StreamTimeout:
            return detail(504, SAFE_MESSAGES[504])
        return EventStreamResponse(fanout, hub, after, headers=STREAM_HEADERS, key=key)


def turn_json(response: Any) -> TurnStarted:
    """The JSON answer of a started or resumed turn (its OpenAPI schema is TurnStarted's)."""
    return {
        "status": response.status,
        "chat_id": response.chat_id,
        "run_id": response.run_id,
        "thread_id": response.thread_id,
        "stream_url": response.stream_url,
    }


def from_saved_default(message: str) -> BodyError:
    """BodyError 400 with `message` about a turn's model and FROM_SAVED_DEFAULT appended (the
    message cut to fit the detail's bound, never the suffix)."""
    return BodyError(
        400, bounded(message, MAX_MESSAGE_CHARS - len(FROM_SAVED_DEFAULT)) + FROM_SAVED_DEFAULT
    )


def saved_default_error(error: grpc.aio.AioRpcError) -> BodyError | None:
    """The 400 for a turn whose model, the organization's saved default, the orchestrator refused
    (INVALID_ARGUMENT UNKNOWN_MODEL): `from_saved_default` of its message. None for any other
    error, which the error table renders as it is."""
    parsed = status_details(error)
    if (
        parsed.domain != ASSISTANT_DOMAIN
        or parsed.reason != "UNKNOWN_MODEL"
        or parsed.code != grpc.StatusCode.INVALID_ARGUMENT
    ):
        return None
    return from_saved_default(parsed.message or "the model cannot be used")


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
    return (parts[3], parts[5], after) if after <= MAX_AFTER else None


def _headers(scope: Scope, *names: bytes) -> list[str | None]:
    """The first value (latin-1, as Starlette's `Headers.get`) of each header in `names`."""
    values: list[str | None] = [None] * len(names)
    for name, value in scope["headers"]:
        if name in names:
            index = names.index(name)
            if values[index] is None:
                values[index] = value.decode("latin-1")
    return values
