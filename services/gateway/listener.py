"""One listener of a run's stream: how a run hub's frames reach its client.

A listener is pushed or pulled. Pushed (`Listener.deliver`): on uvicorn's HTTP/1.1 protocols
the response is chunked and the hub writes the prepared chunk straight to the connection's
transport, the write uvicorn's own `send` would do without its per-message dict and coroutine
(large rounds go through `parallel_write` on every core). That holds only while the
connection keeps up (transport write buffer below `_LAG_BYTES`). Pulled (`Listener.pull`): a
listener that lags, joins with a backlog over `PULL_SLICE_BYTES`, or has no uvicorn transport
(e.g. an in-process ASGI test transport) gets a writer task that takes the frames itself from
the hub's shared list, at most `PULL_SLICE_BYTES` a send, through the ASGI `send` that honours
flow control; once caught up it is pushed again. So a slow listener never holds up the others,
and one that stops reading holds an index into the shared frames and one slice, not a copy of
all it has not read. A client that takes nothing of a send for `send_timeout_s`
(LOOPLINE_HTTP_SEND_TIMEOUT_S) has its connection closed, so a dead client does not keep an
ended run's frames alive.

The response's start and its end (`more_body: False`) always go through ASGI `send`, the end
after the listener's own last frame (`RunHub.end_frame`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, ClassVar

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from services.common import metrics
from services.common.errors import stream_interrupted
from services.gateway import sse
from services.gateway.parallel_write import socket_fd

if TYPE_CHECKING:
    from services.gateway.fanout import RunFanout, RunHub

log = logging.getLogger(__name__)

SERVER_SEND = "loopline.server_send"  # scope key where the gateway leaves the server's `send`
# a connection with more unsent bytes than this is pulled, through ASGI send (flow control)
_LAG_BYTES = 64 * 1024
# a pulled listener's writer sends at most this much a send (one frame at least)
PULL_SLICE_BYTES = 64 * 1024
_UVICORN_CYCLES = frozenset(
    {
        "uvicorn.protocols.http.httptools_impl.RequestResponseCycle",
        "uvicorn.protocols.http.h11_impl.RequestResponseCycle",
    }
)


def broken_frame(position: int) -> bytes:
    """The gateway's own `error` frame ending a listener's stream when the upstream stream broke
    (the orchestrator died or restarted). It names `position`, the `?after=` value to resume
    from: the run's frames the listener has, counting its own `after` (heartbeats and this
    frame are not counted)."""
    message = stream_interrupted(position)
    return b"data: " + orjson.dumps({"type": "error", "data": {"message": message}}) + b"\n\n"


def http_chunk(body: bytes) -> bytes:
    """`body` as one HTTP/1.1 chunk (RFC 9112 section 7.1)."""
    return b"%x\r\n%b\r\n" % (len(body), body)


HEARTBEAT_CHUNK = http_chunk(sse.HEARTBEAT_FRAME)


class Listener:
    """One open stream: its position in the hub's frames and how bytes reach its client.

    `index` is the number of the run's frames handed to it (its `?after=` position). While
    `writer` is None it is pushed by the hub's rounds; while a writer task runs it is pulled
    (module docstring), and the hub's rounds leave it alone. `pending` holds the few frames
    of its own (a heartbeat for an ASGI-only listener, its end frame) that its writer sends.
    """

    __slots__ = (
        "ended",
        "fd",
        "fed",
        "finishing",
        "gone",
        "hub",
        "index",
        "last",
        "pending",
        "send",
        "transport",
        "writer",
    )

    def __init__(
        self, hub: RunHub, index: int, send: Send, transport: asyncio.Transport | None
    ) -> None:
        self.hub = hub
        self.index = index
        self.send = send
        self.transport = transport  # None: always through ASGI send
        # >= 0: may be written by ParallelWriter
        self.fd = -1 if transport is None else socket_fd(transport)
        self.last = 0.0  # loop time of the last bytes handed over
        self.pending: list[bytes] = []  # frames of its own for the writer task
        self.writer: asyncio.Task[None] | None = None
        self.finishing = False
        self.ended = False  # its end frame (if any) has been decided
        self.gone = False
        self.fed = False  # handed at least one of the run's frames (heartbeats aside)

    def pushable(self) -> bool:
        """Whether the hub may write to it now: pushed, on an open uvicorn transport that keeps
        up."""
        transport = self.transport
        return (
            self.writer is None
            and not self.gone
            and transport is not None
            and not transport.is_closing()
            and transport.get_write_buffer_size() < _LAG_BYTES
        )

    def deliver(self, body: bytes, chunk: bytes | None = None) -> None:
        """Write `body` (whole SSE frames) to the transport; only for a `pushable` listener
        (`chunk` is `http_chunk(body)` when already built)."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(chunk if chunk is not None else http_chunk(body))

    def direct(self) -> bool:
        """Whether the next bytes may go straight to the socket (`ParallelWriter`): a plain TCP
        connection, pushed, open, with nothing buffered that they would overtake."""
        transport = self.transport
        return (
            self.fd >= 0
            and self.writer is None
            and not self.gone
            and transport is not None
            and not transport.is_closing()
            and transport.get_write_buffer_size() == 0
        )

    def pull(self) -> None:
        """Serve it by its own writer task until it has caught up (no-op when one runs)."""
        if self.writer is None and not self.gone:
            self.writer = asyncio.create_task(self._write(), name="sse-writer")

    def finish(self) -> None:
        """The run's stream ended: its writer sends what is left, its end frame, then ends the
        response."""
        self.finishing = True
        self.pull()

    async def _send(self, message: dict[str, Any]) -> None:
        """ASGI `send` of `message`, bounded: a client that takes none of it for
        `hub.send_timeout_s` (it stopped reading, or its host is gone without a FIN) has its
        connection closed and TimeoutError is raised, so it cannot hold its run's frames (and
        the hub) for as long as its TCP connection stays open."""
        try:
            async with asyncio.timeout(self.hub.send_timeout_s):
                await self.send(message)
        except TimeoutError:
            self.gone = True
            log.info(
                "closing a stream whose client took nothing for %.0f s", self.hub.send_timeout_s
            )
            if self.transport is not None:
                self.transport.abort()
            raise

    async def _write(self) -> None:
        hub = self.hub
        try:
            while not self.gone:
                frames = hub.frames
                start = self.index
                if start < len(frames):
                    stop, size = start, 0
                    while stop < len(frames) and (
                        stop == start or size + len(frames[stop]) <= PULL_SLICE_BYTES
                    ):
                        size += len(frames[stop])
                        stop += 1
                    body = frames[start] if stop - start == 1 else b"".join(frames[start:stop])
                    self.index = stop
                    self.fed = True
                    self.last = hub.loop.time()
                    await self._send(
                        {"type": "http.response.body", "body": body, "more_body": True}
                    )
                elif self.pending:
                    body = b"".join(self.pending)
                    self.pending.clear()
                    await self._send(
                        {"type": "http.response.body", "body": body, "more_body": True}
                    )
                elif self.finishing and not self.ended:
                    self.ended = True
                    # every frame is handed over: its position is final
                    frame = hub.end_frame(self)
                    if frame is not None:
                        self.pending.append(frame)
                elif self.finishing:
                    await self._send(
                        {"type": "http.response.body", "body": b"", "more_body": False}
                    )
                    return
                else:
                    return  # caught up: pushed again by the hub's rounds
        except Exception:  # noqa: BLE001 - a broken client connection ends only this listener
            self.gone = True
        finally:
            self.writer = None


def _transport_of(scope: Scope) -> asyncio.Transport | None:
    """The transport of a uvicorn HTTP/1.1 GET response that uses chunked encoding, else None.

    Relies on uvicorn's `RequestResponseCycle` (pinned uvicorn==0.54.0 in pyproject.toml):
    the server's `send` is its bound method, with `.transport` and `.chunked_encoding`.
    """
    cycle = getattr(scope.get(SERVER_SEND), "__self__", None)
    if (
        cycle is None
        or f"{type(cycle).__module__}.{type(cycle).__qualname__}" not in _UVICORN_CYCLES
    ):
        return None
    transport = getattr(cycle, "transport", None)
    if scope.get("method") != "GET" or getattr(cycle, "chunked_encoding", None) is not True:
        return None
    # asyncio's and uvloop's TCP transports (uvloop's are not asyncio.Transport subclasses).
    if all(
        callable(getattr(transport, name, None))
        for name in ("write", "get_write_buffer_size", "is_closing")
    ):
        return transport
    return None


class EventStreamResponse(Response):
    """The `text/event-stream` response of one listener of a run (status 200, frames from `after`).

    Joined to `hub` by `RunFanout.open` (with the caller's API key `key`); the response leaves
    the hub when the client goes away or the run's stream ended (then the response ends after
    the last frame).
    """

    media_type = "text/event-stream"

    # rendered once per header set
    _raw_headers: ClassVar[dict[tuple[tuple[str, str], ...], list[tuple[bytes, bytes]]]] = {}

    def __init__(
        self,
        fanout: RunFanout,
        hub: RunHub,
        after: int,
        headers: dict[str, str] | None = None,
        key: str | None = None,
    ) -> None:
        self.fanout, self.hub, self.after, self.key = fanout, hub, after, key
        self.status_code = 200
        self.background = None
        header_set = tuple(headers.items()) if headers else ()
        raw = self._raw_headers.get(header_set)
        if raw is None:
            self.init_headers(headers)
            if len(self._raw_headers) < 64:
                self._raw_headers[header_set] = self.raw_headers
        else:
            self.raw_headers = list(raw)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve the stream until it ends or the client disconnects (ASGI `http.disconnect`)."""
        hub = self.hub
        listener: Listener | None = None
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            listener = Listener(hub, self.after, send, _transport_of(scope))
            metrics.OPEN_LISTENERS.inc()
            hub.attach(listener)
            while True:  # returns once the response is complete (uvicorn) or the client has gone
                message = await receive()
                if message["type"] == "http.disconnect":
                    break
        finally:
            if listener is not None:
                metrics.OPEN_LISTENERS.dec()
                hub.detach(listener)
                if listener.writer is not None and not listener.finishing:
                    listener.writer.cancel()
            self.fanout.leave(hub, self.key)
        if listener is not None and listener.writer is not None:
            # An in-process transport reports the end before the last send: let the writer
            # finish. asyncio.wait, not an await of the task: a writer cancelled above (the
            # client left) must not raise CancelledError out of the response (uvicorn would log
            # it as an ERROR with a traceback).
            await asyncio.wait({listener.writer})
