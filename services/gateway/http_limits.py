"""Bounds on the gateway's HTTP connections that uvicorn's httptools protocol lacks.

uvicorn offers a keep-alive timeout between requests and `limit_concurrency`; its httptools
protocol has no bound on a request's head (size, number of header lines, time to arrive), on
how slowly a body may come, or on how long a client may leave a response's bytes untaken.
`LimitedHttpToolsProtocol` adds those to uvicorn's protocol (set with `uvicorn.Config(http=...)`,
`protocol_class`), before any application code runs, so before authentication:

- a head (request line and header lines) past `max_header_bytes` or `max_headers` is answered
  431; one that has not arrived `header_timeout_s` after the connection opened, or after its
  first byte on a kept-alive connection, 408 (a connection that sent nothing is just closed);
- a body that brings less than `body_min_rate` bytes a second (at least one byte) over any
  `body_timeout_s` is answered 408 (time the server itself is not reading does not count);
- those answers are `{"detail": ...}` with `Connection: close`; the connection then takes no
  more requests: what the client still sends is read and dropped for up to LINGER_S (so that
  it reads the answer instead of a reset) and the connection is closed;
- a request that finds `max_connections` connections open (or requests being served: uvicorn's
  `limit_concurrency` count) is answered 503 with `Retry-After` and its connection closed;
- a connection whose client takes none of a response's waiting bytes for `send_timeout_s`
  (its buffer stays full, above the transport's high-water mark) is aborted;
- a chunked body's trailer fields count against the head's limits and are dropped (uvicorn
  added each to the request's headers, without bound); past them the connection is closed;
- a client that pipelines more than MAX_PIPELINED requests ahead of the responses it has read
  has its connection closed (uvicorn parsed and queued every request of a read, ~2.5 KB each).

Size is counted as bytes arrive, before the parser buffers them (httptools keeps a header's
value until its line ends, so counting whole headers would not bound one endless line); a
head is also counted at most one read beyond its limit when it follows another request in
the same read (pipelining). Timers: one per connection at a time, armed at its opening or at
the first byte of a later head and moved only to an earlier time, so a kept-alive request
costs two clock reads and seldom a timer (~2 µs a request, measured).

`listens_refusal` is the 429 of a listen past LOOPLINE_HTTP_LISTENS_PER_KEY (counted by
`fanout.RunFanout`).

`tune_listener` sets TCP keepalive and TCP_USER_TIMEOUT on the listening socket; Linux gives
them to every accepted connection, so the kernel drops one whose peer vanished (no FIN, no
RST) within a known time, whether it was idle or owed bytes (docs/security.md).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from services.gateway.config import GatewaySettings
from services.gateway.errors import detail, unavailable_response
from services.gateway.ratelimit import RateLimited

log = logging.getLogger(__name__)

#: Seconds a refused connection is kept for its client to read the answer (its data dropped).
LINGER_S = 2.0
#: Requests a connection may have queued behind the one being answered (HTTP/1.1 pipelining).
MAX_PIPELINED = 16


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a connection that was just closed."""


HEAD_TOO_LARGE = (
    "The request's header fields are too large (at most {} bytes with the request line)"
)
TOO_MANY_HEADERS = "The request has too many header fields (at most {})"
HEAD_TOO_SLOW = "The request's header fields did not arrive in time ({:g} s)"
BODY_TOO_SLOW = "The request body arrives too slowly (at least {} bytes a second over {:g} s)"
#: The `key` of the denial of a listen past LOOPLINE_HTTP_LISTENS_PER_KEY, and its Retry-After (s).
LISTENS_LIMIT = "listens_per_api_key"
LISTENS_RETRY_AFTER_S = 5


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """The bounds of `LimitedHttpToolsProtocol` (GatewaySettings `http_*`, README settings)."""

    max_header_bytes: int = 65_536
    max_headers: int = 100
    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    body_min_rate: int = 1_024
    send_timeout_s: float = 60.0
    max_connections: int = 20_000

    @classmethod
    def of(cls, settings: GatewaySettings) -> HttpLimits:
        return cls(
            settings.http_max_header_bytes,
            settings.http_max_headers,
            settings.http_header_timeout_s,
            settings.http_body_timeout_s,
            settings.http_body_min_rate,
            settings.http_send_timeout_s,
            settings.http_max_connections,
        )


def protocol_class(limits: HttpLimits) -> type[LimitedHttpToolsProtocol]:
    """`LimitedHttpToolsProtocol` bound to `limits`, for `uvicorn.Config(http=...)`."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})


def tune_listener(sock: socket.socket, settings: GatewaySettings) -> None:
    """TCP keepalive (`tcp_keepalive_*`) and TCP_USER_TIMEOUT (`tcp_user_timeout_s`, 0 = left to
    the kernel) on the listening socket `sock`; accepted connections inherit them (Linux). An
    option this platform does not have is skipped."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    options = [
        ("TCP_KEEPIDLE", settings.tcp_keepalive_idle_s),
        ("TCP_KEEPINTVL", settings.tcp_keepalive_interval_s),
        ("TCP_KEEPCNT", settings.tcp_keepalive_count),
    ]
    if settings.tcp_user_timeout_s:
        options.append(("TCP_USER_TIMEOUT", settings.tcp_user_timeout_s * 1000))  # milliseconds
    for name, value in options:
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def listens_refusal(limit: int) -> JSONResponse:
    """The answer to a listen whose API key holds `limit` listens already (fanout.TooManyListens):
    429 with the rate denial envelope, Retry-After and X-RateLimit-* (ratelimit.RateLimited)."""
    reason = (
        f"at most {limit} listens at once per API key on this gateway;"
        f" close one, or retry in {LISTENS_RETRY_AFTER_S} s"
    )
    return RateLimited(LISTENS_LIMIT, limit, LISTENS_RETRY_AFTER_S, reason).response()


async def _busy(scope: Scope, receive: Receive, send: Send) -> None:
    """The answer to a request past `max_connections`: the gateway's 503 (README "Errors")."""
    response = unavailable_response()
    response.headers["Connection"] = "close"
    await response(scope, receive, send)


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol (httptools) with the bounds of `limits` (module docstring)."""

    limits: ClassVar[HttpLimits] = HttpLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # bytes the head may still take; None: in a body
        self._head_left: int | None = self.limits.max_header_bytes
        # loop time the head being received began; None: between requests
        self._head_since: float | None = None
        self._body_got = 0  # bytes received since the head ended
        self._body_mark = 0  # ... when the body's current window began
        self._body_since = 0.0  # loop time that window began
        # head and body deadlines (`_check`), then the linger
        self._deadline: asyncio.TimerHandle | None = None
        self._stall: asyncio.TimerHandle | None = None  # `_check_stall` while writing is paused
        self._drained = False  # writing resumed since the stall window began
        self._done = False  # refused: the connection takes nothing more
        # bytes of a chunked body's trailer section so far; None: not in one
        self._trailers: int | None = None
        self._trailer_fields = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._begin_head()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._deadline, self._stall):
            if timer is not None:
                timer.cancel()
        self._deadline = self._stall = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._done:
            return  # refused: dropped until the client closes or LINGER_S ends
        left = self._head_left
        if left is None:
            self._body_got += len(data)
        else:
            if self._head_since is None:
                self._begin_head()
            if len(data) > left:
                self._past_head_limit(data, left)
                return
            self._head_left = left - len(data)
        in_trailers = self._trailers is not None
        super().data_received(data)
        if self._done:
            return
        # the whole read was in a chunked body's trailer section
        if in_trailers and self._trailers is not None:
            self._trailers += len(data)
            if self._trailers > self.limits.max_header_bytes:
                self._close()
                return
        if self._head_left is None:  # a body is coming: its first window
            self._arm(self._body_since + self.limits.body_timeout_s)
        elif (
            self._head_since is not None
            and self.headers is not None
            and len(self.headers) > self.limits.max_headers
        ):
            self._refuse_head(431, TOO_MANY_HEADERS.format(self.limits.max_headers))

    def _past_head_limit(self, data: bytes, left: int) -> None:
        """`data` is longer than the head may still be: parse the `left` bytes it may take; if the
        head has not ended within them, 431, else the rest is read as what follows the head."""
        self._head_left = 0
        if left:
            super().data_received(data[:left])
            if self._done or self.transport.is_closing():
                return
        if self._head_left == 0:  # still in that head (its end resets the count)
            self._refuse_head(431, HEAD_TOO_LARGE.format(self.limits.max_header_bytes))
        else:
            self.data_received(data[left:])

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._head_left is not None:
            super().on_header(name, value)
            return
        self._trailer_fields += 1  # a trailer field: not one of the request's headers, dropped
        if self._trailer_fields > self.limits.max_headers:
            self._close()
            raise _Refused

    def on_chunk_header(self) -> None:
        # the last chunk's header (size 0) is followed by the trailers; any other by data
        self._trailers = 0

    def on_body(self, body: bytes) -> None:
        self._trailers = None
        super().on_body(body)

    def on_headers_complete(self) -> None:
        if len(self.pipeline) >= MAX_PIPELINED:
            self._close()
            raise _Refused  # stops the parser: the rest of the read is not turned into requests
        self._trailers, self._trailer_fields = None, 0
        self._head_left = self._head_since = None
        self._body_got = self._body_mark = 0
        self._body_since = self.loop.time()
        limits = self.limits
        refusal: ASGIApp
        if len(self.headers) > limits.max_headers:
            refusal = detail(
                431, TOO_MANY_HEADERS.format(limits.max_headers), {"Connection": "close"}
            )
        elif (
            len(self.connections) >= limits.max_connections
            or len(self.tasks) >= limits.max_connections
        ):
            refusal = _busy
        else:
            super().on_headers_complete()
            return
        # answered by `refusal` as uvicorn answers its own 503 (a request cycle without the app);
        # nothing the connection sends afterwards is read
        self._done = True
        self.app = refusal
        try:
            super().on_headers_complete()
        finally:
            self.app = self.config.loaded_app

    def on_message_complete(self) -> None:
        self._head_left = self.limits.max_header_bytes
        self._trailers = None
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        # after a parser error of our own making (`_Refused`) the connection is closed already
        if not self._done:
            super().send_400_response(msg)

    def _begin_head(self) -> None:
        self._head_since = now = self.loop.time()
        self._arm(now + self.limits.header_timeout_s)

    def _arm(self, due: float) -> None:
        """Have `_check` run at loop time `due` or earlier (one timer per connection)."""
        deadline = self._deadline
        if deadline is not None:
            if deadline.when() <= due:
                return
            deadline.cancel()
        self._deadline = self.loop.call_at(due, self._check)

    def _check(self) -> None:
        """Timer: the head's deadline, or the body's rate over its last window (module
        docstring)."""
        self._deadline = None
        if self._done or self.transport.is_closing():
            return
        now = self.loop.time()
        limits = self.limits
        if self._head_left is None:  # a body is coming
            cycle = self.cycle
            if self.flow.read_paused or cycle is None or cycle.waiting_for_100_continue:
                # the server is not reading: not the client's delay
                self._body_mark, self._body_since = self._body_got, now
            elif now - self._body_since >= limits.body_timeout_s:
                if self._body_got - self._body_mark < max(
                    1.0, limits.body_min_rate * (now - self._body_since)
                ):
                    if cycle.response_started:
                        # answered already (without reading the body): nothing more to say
                        self._close()
                    else:
                        # the application's receive() reports the client gone
                        cycle.disconnected = True
                        cycle.message_event.set()
                        self._answer(
                            408, BODY_TOO_SLOW.format(limits.body_min_rate, limits.body_timeout_s)
                        )
                    return
                self._body_mark, self._body_since = self._body_got, now
            self._arm(self._body_since + limits.body_timeout_s)
        elif self._head_since is not None:
            due = self._head_since + limits.header_timeout_s
            if now < due:
                self._arm(due)
            elif self._head_left == limits.max_header_bytes:
                self._close()  # not a byte of it came: nothing to answer
            else:
                self._refuse_head(408, HEAD_TOO_SLOW.format(limits.header_timeout_s))

    def _refuse_head(self, status: int, message: str) -> None:
        """Refuse the head being received: answer when no response of this connection is under
        way (a pipelined request's head), else just close."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            self._answer(status, message)
        else:
            self._close()

    def _answer(self, status: int, message: str) -> None:
        """Write `status` with `{"detail": message}` and `Connection: close`, stop reading requests,
        and close once the client has closed its side or after LINGER_S."""
        self._done = True
        body = orjson.dumps({"detail": message})
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: application/json\r\ncontent-length: ",
            b"%d" % len(body),
            b"\r\nconnection: close\r\n\r\n",
            body,
        ]
        transport = self.transport
        transport.write(b"".join(head))
        self.flow.resume_reading()
        if transport.can_write_eof():
            # the client reads the answer and an end; what it still sends is dropped
            transport.write_eof()
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(LINGER_S, transport.close)
        else:
            transport.close()

    def _close(self) -> None:
        self._done = True
        self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is None:
            self._drained = False
            self._stall = self.loop.call_later(self.limits.send_timeout_s, self._check_stall)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._drained = True

    def _check_stall(self) -> None:
        """Timer: abort a connection whose buffer stayed full for `send_timeout_s` (writing
        never resumed)."""
        self._stall = None
        if not self.flow.write_paused:
            return
        if self._drained:  # the client took some: a new window
            self._drained = False
            self._stall = self.loop.call_later(self.limits.send_timeout_s, self._check_stall)
            return
        log.info(
            "closing a connection whose client took nothing for %.0f s", self.limits.send_timeout_s
        )
        self.transport.abort()
