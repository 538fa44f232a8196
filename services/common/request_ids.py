"""Request ids: one id per HTTP request, on every log line of that request in every service.

The gateway takes the client's `X-Request-ID` when it is 1-128 characters of
`[A-Za-z0-9._-]`, else makes one (32 hex characters), returns it on the response and binds it
in the log context as `request_id` (`services.common.logging`). Every internal channel
(`RequestIdChannel`, made by `internal_auth.internal_channel`) sends the id bound where a call
is made as the gRPC metadata `x-request-id`, and every servicer wrapper (`errors.rpc_handler`,
`stream_rpc_handler`) binds the id a call carries (`adopt`), so the orchestrator's, billing's and
the tools service's lines of that request carry it too, and so do the tasks a call starts (a
turn's loop: its billing and tool calls).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from typing import Any

import grpc

from services.common import logging as loopline_logging
from services.common import tracing

#: The HTTP header (lower case, as ASGI gives header names) and the gRPC metadata key.
HEADER = b"x-request-id"
METADATA_KEY = "x-request-id"
#: The log context's (and access line's) field.
FIELD = "request_id"

_VALID = re.compile(rb"[A-Za-z0-9._-]{1,128}")


def accept_or_make(given: bytes | None) -> str:
    """`given` (a header's raw value) when it is a valid request id, else a new one."""
    if given is not None and _VALID.fullmatch(given):
        return given.decode("ascii")
    return secrets.token_hex(16)


def current() -> str | None:
    """The request id bound in this context, if any."""
    value: str | None = loopline_logging.bound(FIELD)
    return value


def adopt(context: Any) -> None:
    """Bind the request id a gRPC call carries (metadata `x-request-id`, when valid) for the rest
    of the call's task (grpc.aio serves each call in a task of its own). `context`: the call's
    grpc.aio.ServicerContext (a stand-in without metadata binds nothing)."""
    metadata = getattr(context, "invocation_metadata", None)
    if metadata is None:
        return
    for key, value in metadata() or ():
        if key == METADATA_KEY:
            if isinstance(value, str) and _VALID.fullmatch(value.encode("latin-1")):
                loopline_logging.bind_task(request_id=value)
                tracing.set_request_id(value)  # on the call's server span (tracing on only)
            return


class _SendsRequestId:
    """A multicallable that adds the bound request id to the call's metadata."""

    __slots__ = ("_call",)

    def __init__(self, call: Callable[..., Any]) -> None:
        self._call = call

    def __call__(self, request: Any, **options: Any) -> Any:
        request_id = loopline_logging.bound(FIELD)
        if request_id is not None:
            metadata = options.get("metadata")
            pair = (METADATA_KEY, request_id)
            options["metadata"] = (*metadata, pair) if metadata else (pair,)
        return self._call(request, **options)


class RequestIdChannel(grpc.aio.Channel):
    """A grpc.aio channel whose calls send the request id bound where they are made.

    Wraps the multicallables the stubs get, which costs a function call per call; a client
    interceptor would cost every call ~50 µs of CPU (measured on grpcio 1.85)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel

    async def __aenter__(self) -> RequestIdChannel:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.channel.close(None)

    async def close(self, grace: float | None = None) -> None:
        await self.channel.close(grace)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self.channel.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self.channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self.channel.channel_ready()

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _SendsRequestId(self.channel.unary_unary(method, *args, **kwargs))

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _SendsRequestId(self.channel.unary_stream(method, *args, **kwargs))

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _SendsRequestId(self.channel.stream_unary(method, *args, **kwargs))

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _SendsRequestId(self.channel.stream_stream(method, *args, **kwargs))
