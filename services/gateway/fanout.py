"""Listener fan-out: one upstream `StreamRun` per run per gateway process, shared by every listener.

Each event is rendered to its SSE frame once (`sse.encode`) and the bytes are kept in an
append-only list (`_Hub.frames`). The hub itself pushes new frames to its listeners: a
flush round walks the listeners, `FLUSH_SLICE` per event-loop iteration, and hands each the
bytes from its own `?after=N` index up to the frames at hand (the joined bytes are built
once per distinct index, so normally once); frames that arrive mid-round reach the
listeners not yet served in the same write. A listener costs no task wake-up, no timer and
no encoding per event, and a large fan-out never holds the event loop for more than a
slice (issue 9, stream fan-out: 10,000 listeners on one process, delay p99 <= 50 ms).

Delivery has two modes per listener. Pushed (`_Listener.deliver`): on uvicorn's HTTP/1.1
protocols the response is chunked and the hub writes the prepared chunk straight to the
connection's transport — the write uvicorn's own `send` would do, without its per-message
dict and coroutine (large rounds on every core: `parallel_write`). That fast path is taken
only while the connection keeps up (transport write buffer below `_LAG_BYTES`). Pulled
(`_Listener.pull`): a listener that lags, joins with a backlog larger than `PULL_SLICE_BYTES`,
or is served by a server that is not uvicorn (e.g. an in-process ASGI test transport) gets a
writer task that takes the frames itself from the hub's shared list, from its own index, at
most `PULL_SLICE_BYTES` a send, through the ASGI `send` that honours flow control; once it
has caught up it returns to being pushed. So one slow listener never holds up the others,
and one that stops reading holds an index into the shared frames and one slice, not a copy
of all it has not read (fresh-eyes test: 100 stalled listeners on a 5.6 MB run took the
gateway from 143 to 850 MiB); one whose client takes nothing of a send for `send_timeout_s`
(LOOPLINE_HTTP_SEND_TIMEOUT_S) has its connection closed, so a dead client does not keep an
ended run's frames alive. The response's start and its end (`more_body: False`) always go through ASGI `send`, the end
after the listener's own last frame (`_Hub._end_frame`).

Heartbeats (`data: {"type":"heartbeat"}`, not counted by `?after=N`) come from one timer
per hub, instead of a timer per listener: when the first listener falls silent for
`heartbeat_s`, every listener silent for 90% of it or longer gets one in the same round
(up to 10% early, never late: spec "every 15s of inter-event silence"), and the next
check is at least `heartbeat_s / 10` later.

Lifetime: the upstream call starts with the first listener and is validated by it (the
orchestrator sends initial metadata `x-loopline-stream` once the chat and run check out,
or fails with NOT_FOUND); it ends when the run's stream ends, or is cancelled when the
last listener leaves: between two reads, once the read under way has brought its message (a
replay's next one comes at once), or after ABANDONED_CANCEL_S if none comes (a live run gone
quiet). grpc.aio frees a read's buffers only when its reader takes the result
(grpc/grpc#43360): cancelling the task under a read leaked the message being read (~40 KB of
frames) per listener that left a replay early, and cancelling the call under one still leaks
a little (docs/security.md). A finished hub is forgotten at once, so a later listener starts a
fresh replay from the orchestrator (which has every event of the run). When the upstream
call fails after validation (the orchestrator died or restarted), each listener's stream
ends with the gateway's own `error` frame naming that listener's `?after=` position to
resume from (`broken_frame`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, ClassVar

import grpc
import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from loopline.assistant.v1 import assistant_pb2, assistant_pb2_grpc
from services.common.errors import stream_interrupted
from services.gateway import sse
from services.gateway.parallel_write import ParallelWriter, socket_fd

log = logging.getLogger(__name__)

STREAM_READY = "x-loopline-stream"
SERVER_SEND = (
    "loopline.server_send"  # scope key where `app.GatewayApp` leaves the server's own `send`
)
_LAG_BYTES = (
    64 * 1024
)  # a connection with more unsent bytes than this is pulled, through ASGI send (flow control)
_UVICORN_CYCLES = frozenset(
    {
        "uvicorn.protocols.http.httptools_impl.RequestResponseCycle",
        "uvicorn.protocols.http.h11_impl.RequestResponseCycle",
    }
)


STALLED_SEND_S = 60.0  # longest a listener's client may take to accept one send before its connection is closed (nginx's send_timeout)
STALLED_CLOSE_S = 1.0  # at shutdown, how long a listener's writer may take to send its last frame before its connection is closed
READY_TIMEOUT_S = (
    30.0  # longest wait for the orchestrator to accept a stream (the unary calls' deadline)
)


class StreamTimeout(Exception):
    """The orchestrator did not accept the stream within READY_TIMEOUT_S (it is stalled: alive
    for gRPC, answering nothing); the listen is 504 like a unary call past its deadline."""


class StreamUnavailable(Exception):
    """The orchestrator closed the stream before validating it without a status to pass on."""


class TooManyListens(Exception):
    """The caller's API key already holds `limit` listens on this gateway (`RunFanout.listens_per_key`)."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.limit = limit


def broken_frame(position: int) -> bytes:
    """The gateway's own `error` frame ending a listener's stream when the upstream stream broke
    (the orchestrator died or restarted): it names `position`, the listener's `?after=` value to
    resume right after the last of the run's frames it got (the frames it was handed plus the
    `after` it joined with; heartbeats and this frame are not counted)."""
    message = stream_interrupted(position)
    return b"data: " + orjson.dumps({"type": "error", "data": {"message": message}}) + b"\n\n"


def _chunk(body: bytes) -> bytes:
    """`body` as one HTTP/1.1 chunk (RFC 9112 section 7.1)."""
    return b"%x\r\n%b\r\n" % (len(body), body)


class _Listener:
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
        self, hub: _Hub, index: int, send: Send, transport: asyncio.Transport | None
    ) -> None:
        self.hub = hub
        self.index = index
        self.send = send
        self.transport = transport  # None: always through ASGI send
        self.fd = (
            -1 if transport is None else socket_fd(transport)
        )  # >= 0: may be written by ParallelWriter
        self.last = 0.0  # loop time of the last bytes handed over
        self.pending: list[bytes] = []  # frames of its own for the writer task
        self.writer: asyncio.Task | None = None
        self.finishing = False
        self.ended = False  # its end frame (if any) has been decided
        self.gone = False
        self.fed = False  # handed at least one of the run's frames (heartbeats aside)

    def pushable(self) -> bool:
        """Whether the hub may write to it now: pushed mode, a uvicorn transport that is open and keeps up."""
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
        (`chunk` is `_chunk(body)` when already built)."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(chunk if chunk is not None else _chunk(body))

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
        """Serve it by its own writer task from now on, until it has caught up (no-op when one runs)."""
        if self.writer is None and not self.gone:
            self.writer = asyncio.create_task(self._write(), name="sse-writer")

    def finish(self) -> None:
        """The run's stream ended: its writer sends what is left, its end frame, then ends the response."""
        self.finishing = True
        self.pull()

    async def _send(self, message: dict[str, Any]) -> None:
        """ASGI `send` of `message`, bounded: a client that takes none of it for `hub.send_timeout_s`
        (it stopped reading, or its host is gone without a FIN) has its connection closed and
        TimeoutError is raised. Without this bound such a listener held its run's frames (and the
        hub) in the gateway for as long as its TCP connection stayed open, a run long ended too."""
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
                    frame = hub._end_frame(
                        self
                    )  # every frame is handed over: its position is final
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


class _Hub:
    __slots__ = (
        "abandoned",
        "beat_due",
        "beat_next",
        "broken",
        "call",
        "finished",
        "flush_handle",
        "frames",
        "heartbeat_handle",
        "heartbeat_s",
        "key",
        "listeners",
        "loop",
        "ready",
        "round",
        "round_at",
        "round_beats",
        "round_from",
        "send_timeout_s",
        "streams",
        "task",
        "writer",
    )

    def __init__(
        self,
        key: tuple[str, str, str],
        heartbeat_s: float,
        writer: ParallelWriter | None = None,
        send_timeout_s: float = STALLED_SEND_S,
    ) -> None:
        self.key = key
        self.send_timeout_s = send_timeout_s  # a listener's send bound (`_Listener._send`)
        self.abandoned: asyncio.TimerHandle | None = (
            None  # `_cancel_abandoned` of a hub its last listener left
        )
        self.writer = writer  # large rounds' socket writes on every core (parallel_write)
        self.frames: list[bytes] = []
        self.finished = False
        self.broken = False  # the upstream stream failed after validation: each listener's end is `broken_frame`
        self.loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[None] = self.loop.create_future()
        self.ready.add_done_callback(
            lambda f: None if f.cancelled() else f.exception()
        )  # mark retrieved
        self.listeners = 0  # joined (open() returned or is waiting), attached or not
        self.streams: dict[_Listener, None] = {}  # attached listeners, in arrival order
        self.task: asyncio.Task | None = None
        self.call: Any = None
        self.flush_handle: asyncio.Handle | None = None
        self.heartbeat_s = heartbeat_s
        self.heartbeat_handle: asyncio.TimerHandle | None = None  # the next heartbeat check
        self.beat_due = False  # a heartbeat check is owed by the next round
        self.round: list[_Listener] | None = None  # the listeners of the flush round in progress
        self.round_at = 0  # how many of them have been served
        self.round_from = 0  # len(frames) when the round began
        self.round_beats = False  # this round also sends heartbeats to silent listeners
        self.beat_next = 0.0  # loop time when the next listener of this round falls silent

    def publish(self, frame: bytes) -> None:
        """Append a frame; listeners get it at the next flush (scheduled on the event loop)."""
        self.frames.append(frame)
        self._schedule()

    def _schedule(self) -> None:
        if self.flush_handle is None:
            self.flush_handle = self.loop.call_soon(self.flush)

    def flush(self) -> None:
        """Serve the next `FLUSH_SLICE` listeners of the round in progress (starting a round if
        none is), then yield to the event loop until the next slice.

        Each listener gets every frame it has not had, up to the frames at hand when its turn
        comes, so frames that arrive during a round reach the listeners not yet served in the
        same write; in a heartbeat round (`_heartbeat`) a listener with nothing new that has
        been silent for `heartbeat_s` gets a heartbeat. When the round ends and frames came in
        during it (or a heartbeat check is owed), another round follows. Slicing bounds how
        long one run's fan-out holds the gateway's event loop (~10 µs per listener on loopback
        TCP: one pass over 10,000 listeners would hold every other request for ~100 ms).
        """
        self.flush_handle = None
        if self.round is None:
            self.round = list(self.streams)
            self.round_at = 0
            self.round_from = len(self.frames)
            self.round_beats, self.beat_due = self.beat_due, False
            self.beat_next = self.loop.time() + self.heartbeat_s
        stop = min(self.round_at + FLUSH_SLICE, len(self.round))
        self._serve(self.round[self.round_at : stop], self.round_beats)
        self.round_at = stop
        if stop < len(self.round):
            self._schedule()
            return
        self.round = None
        if self.round_beats and not self.finished and self.streams:
            if self.heartbeat_handle is not None:
                self.heartbeat_handle.cancel()
            self.heartbeat_handle = self.loop.call_at(
                max(self.beat_next, self.loop.time() + self.heartbeat_s / 10), self._heartbeat
            )
        if len(self.frames) > self.round_from or self.beat_due:
            self._schedule()

    def _serve(self, listeners: list[_Listener], beats: bool = False) -> None:
        """Hand each of `listeners` the frames from its index to the current end; with `beats`,
        a heartbeat to each that has nothing new and has been silent for 90% of `heartbeat_s` or more."""
        frames, end = self.frames, len(self.frames)
        now = self.loop.time()
        interval = self.heartbeat_s
        built: dict[int, tuple[bytes, bytes]] = {}
        writer = self.writer
        # Large rounds: the chunks of listeners whose sockets take them directly are written
        # by the ParallelWriter on every core after the walk, the rest as before.
        direct: list[tuple[int, bytes]] | None = (
            [] if writer is not None and writer.enabled_for(len(listeners)) else None
        )
        owners: list[_Listener] = []
        for listener in listeners:
            if listener.gone or listener.writer is not None:
                continue  # pulled: its writer takes the frames itself
            start = listener.index
            if start < end:
                if (
                    not listener.pushable()
                ):  # it lags (or has no uvicorn transport): pulled from here on
                    listener.pull()
                    continue
                prepared = built.get(start)
                if prepared is None:
                    body = frames[start] if end - start == 1 else b"".join(frames[start:end])
                    prepared = built[start] = (body, _chunk(body))
                listener.index = end
                listener.last = now
                listener.fed = True
            elif beats:
                if (
                    now - listener.last >= interval - interval / 10
                ):  # due, or within 10%: now, with the others
                    listener.last = now
                    if not listener.pushable():
                        listener.pending.append(sse.HEARTBEAT_FRAME)
                        listener.pull()
                        continue
                    prepared = (sse.HEARTBEAT_FRAME, HEARTBEAT_CHUNK)
                else:
                    if listener.last + interval < self.beat_next:
                        self.beat_next = listener.last + interval
                    continue
            else:
                continue
            if direct is not None and listener.direct():
                direct.append((listener.fd, prepared[1]))
                owners.append(listener)
            else:
                listener.deliver(*prepared)
        if direct:
            self._write_direct(direct, owners)

    def _write_direct(self, direct: list[tuple[int, bytes]], owners: list[_Listener]) -> None:
        """Write each `(fd, chunk)` of `direct` straight to its socket (`ParallelWriter`); what a
        socket did not take, or refused with an error, goes to its transport's own `write`
        (buffered with flow control, or the error seen and the connection closed as usual)."""
        assert self.writer is not None
        for index, written in self.writer.write(direct):
            chunk = direct[index][1]
            transport = owners[index].transport
            if transport is not None and not transport.is_closing():
                transport.write(chunk[written:] if written > 0 else chunk)

    def attach(self, listener: _Listener) -> None:
        """Start serving `listener`: the frames from its index on, then live ones, heartbeats."""
        self.streams[listener] = None
        listener.last = self.loop.time()
        if listener.index < len(self.frames):
            if listener.pushable() and _backlog_fits(self.frames, listener.index):
                body = b"".join(self.frames[listener.index :])
                listener.index = len(self.frames)
                listener.fed = True
                listener.deliver(body)
            else:  # a large backlog: pulled a slice at a time, never copied whole
                listener.pull()
        if self.finished:
            listener.finish()
        elif (
            self.heartbeat_handle is None
            and not self.beat_due
            and not (self.round is not None and self.round_beats)
        ):
            self.heartbeat_handle = self.loop.call_at(
                listener.last + self.heartbeat_s, self._heartbeat
            )

    def detach(self, listener: _Listener) -> None:
        """Stop serving `listener` (its client is gone or its response ended)."""
        listener.gone = True
        self.streams.pop(listener, None)
        if not self.streams and self.heartbeat_handle is not None:
            self.heartbeat_handle.cancel()
            self.heartbeat_handle = None

    def _heartbeat(self) -> None:
        """Timer: owe a heartbeat check to the next flush round (`flush`), which schedules the
        next check for when its earliest listener falls silent (at least `heartbeat_s / 10`
        later: every listener within 10% of its heartbeat got it in this round, so none is late)."""
        self.heartbeat_handle = None
        if self.finished or not self.streams:
            return
        self.beat_due = True
        if self.round is None:
            self._schedule()

    def end(self) -> None:
        """The upstream stream is over: flush, end every response, stop the heartbeat timer."""
        self.finished = True
        if self.flush_handle is not None:
            self.flush_handle.cancel()
            self.flush_handle = None
        self.round = None
        self.beat_due = False
        self._serve(list(self.streams))  # the pushed get the rest now; the pulled take theirs
        if self.heartbeat_handle is not None:
            self.heartbeat_handle.cancel()
            self.heartbeat_handle = None
        for listener in list(self.streams):
            listener.finish()

    def _end_frame(self, listener: _Listener) -> bytes | None:
        """The last frame of a listener of an ended stream, if it needs one of its own (asked by
        its writer once every frame of the run is handed to it).

        When the upstream stream broke (`broken`), every listener gets `broken_frame` with its
        position (`listener.index`: every frame is handed over by now, so the number of the
        run's frames it has, counting those before its `?after=`).

        Otherwise a listener that joined an ended stream past its end and was handed nothing
        gets the last frame, the run's end, instead of a stream that closes without one.

        Past the end: `?after=N` with N greater than the number of frames (it counted frames
        this stream no longer has), or equal to it when the stream does not begin with the
        run's `metadata` frame (every run's stream does, unless its beginning was lost). Both
        are a crash on the memory backend: the reaper's `error` and `done` are the run's frames
        0 and 1 because the dead process's events are gone (README "Decisions", stream end).
        N equal to the number of frames of a whole stream is the normal "I have it all": nothing."""
        if self.broken:
            return None if listener.gone else broken_frame(listener.index)
        if listener.fed or listener.gone or not self.frames:
            return None
        end = len(self.frames)
        if listener.index > end or (
            listener.index == end and not self.frames[0].startswith(METADATA_FRAME_START)
        ):
            listener.fed = True
            return self.frames[-1]
        return None


def _backlog_fits(frames: list[bytes], index: int) -> bool:
    """Whether `frames[index:]` is at most PULL_SLICE_BYTES (counted no further than that)."""
    size = 0
    for position in range(index, len(frames)):
        size += len(frames[position])
        if size > PULL_SLICE_BYTES:
            return False
    return True


HEARTBEAT_CHUNK = _chunk(sse.HEARTBEAT_FRAME)
PULL_SLICE_BYTES = (
    64 * 1024
)  # a pulled listener's writer sends at most this much a send (one frame at least)
METADATA_FRAME_START = b'data: {"type":"metadata"'  # how every whole run stream begins (sse.encode)
FLUSH_SLICE = 256  # listeners served per event-loop iteration by one flush (see _Hub.flush)


class RunFanout:
    """Shares upstream StreamRun calls between the listeners of a run (see the module docstring).

    `heartbeat_s` is the silence (seconds) after which a listener gets a heartbeat frame
    (LOOPLINE_HEARTBEAT_INTERVAL_S; spec: 15 s of inter-event silence); `send_timeout_s` bounds
    each send to a listener (LOOPLINE_HTTP_SEND_TIMEOUT_S; None: STALLED_SEND_S);
    `listens_per_key` is how many listens one API key may hold at once (LOOPLINE_HTTP_LISTENS_PER_KEY;
    0: not limited), counted by the `key` given to `open` and `leave`.
    """

    def __init__(
        self,
        stub: assistant_pb2_grpc.AssistantServiceStub,
        heartbeat_s: float = 15.0,
        write_threads: int = 0,
        send_timeout_s: float | None = None,
        listens_per_key: int = 0,
    ) -> None:
        self._stub = stub
        self._heartbeat_s = heartbeat_s
        self._writer = ParallelWriter(write_threads) if write_threads > 0 else None
        self._send_timeout_s = STALLED_SEND_S if send_timeout_s is None else send_timeout_s
        self._hubs: dict[tuple[str, str, str], _Hub] = {}
        self._closed = False
        self.listens_per_key = listens_per_key
        self._listens: dict[str, int] = {}  # open listens per key (entries at 0 are removed)

    def active_runs(self) -> int:
        """Runs with an open upstream stream (for tests and metrics)."""
        return len(self._hubs)

    async def close(self) -> None:
        """Shutdown: end every open stream now, each listener with its own reconnect frame
        (`broken_frame`, `?after=` its position), so that clients go on through another gateway
        at once and the HTTP server's connections finish within its grace; streams asked for
        afterwards are StreamUnavailable (503, Retry-After). A stopped gateway cut them at the
        end of its grace without a frame, and uvicorn logged that at ERROR (fresh-eyes test).

        A listener that does not read (its connection's buffers full) cannot take its frame: after
        STALLED_CLOSE_S its connection is closed (aborted) instead of holding the shutdown for the
        server's whole grace and ending in uvicorn's ERROR logs (fresh-eyes test); the bytes it
        received are whole frames up to some point, from which it reconnects with `?after=`."""
        self._closed = True
        hubs = list(self._hubs.values())
        for hub in hubs:
            hub.broken = True
            if hub.task is not None:
                hub.task.cancel()
        await asyncio.gather(
            *(hub.task for hub in hubs if hub.task is not None), return_exceptions=True
        )
        writing = {
            listener: listener.writer
            for hub in hubs
            for listener in hub.streams
            if listener.writer is not None
        }
        if writing:
            await asyncio.wait(set(writing.values()), timeout=STALLED_CLOSE_S)
        for listener, writer in writing.items():
            if not writer.done():
                if listener.transport is not None:
                    listener.transport.abort()
                writer.cancel()
        if self._writer is not None:
            self._writer.close()

    async def open(
        self, caller: assistant_pb2.Caller, chat_id: str, run_id: str, key: str | None = None
    ) -> _Hub:
        """Join (or start) the hub of a run; raises grpc.aio.AioRpcError (e.g. NOT_FOUND) or
        StreamUnavailable when the orchestrator refuses the stream, StreamTimeout when it has not
        accepted it within READY_TIMEOUT_S (fresh-eyes chaos test: a listen through a gateway
        whose orchestrator was stalled got no status line at all for minutes), TooManyListens
        when `key` (the caller's API key, see `listens_per_key`) holds as many listens as it may.
        The caller must `leave` it with the same `key` (`EventStreamResponse` does)."""
        if self._closed:
            raise StreamUnavailable  # shutting down: the client goes to another gateway
        if key is None or not self.listens_per_key:
            return await self._open(caller, chat_id, run_id)
        held = self._listens.get(key, 0)
        if held >= self.listens_per_key:
            raise TooManyListens(self.listens_per_key)
        self._listens[key] = held + 1
        try:
            return await self._open(caller, chat_id, run_id)
        except BaseException:
            self._release(key)
            raise

    def _release(self, key: str) -> None:
        held = self._listens.get(key, 0) - 1
        if held > 0:
            self._listens[key] = held
        else:
            self._listens.pop(key, None)

    async def _open(self, caller: assistant_pb2.Caller, chat_id: str, run_id: str) -> _Hub:
        key = (caller.organization_id, chat_id, run_id)
        hub = self._hubs.get(key)
        if hub is None or hub.finished:
            hub = _Hub(key, self._heartbeat_s, self._writer, self._send_timeout_s)
            self._hubs[key] = hub
            hub.task = asyncio.create_task(self._pump(hub, caller), name="sse-pump")
        hub.listeners += 1
        if not hub.ready.done():
            try:
                async with asyncio.timeout(READY_TIMEOUT_S):
                    await asyncio.shield(hub.ready)
            except TimeoutError:
                self.leave(hub)  # the last listener to leave cancels the stalled upstream call
                raise StreamTimeout from None
            except BaseException:
                self.leave(hub)
                raise
        elif hub.ready.exception() is not None:
            self.leave(hub)
            raise hub.ready.exception()  # type: ignore[misc]
        return hub

    def leave(self, hub: _Hub, key: str | None = None) -> None:
        """A listener (of API key `key`, as given to `open`) is gone; the last one to leave a live
        hub has its upstream call cancelled between two reads (module docstring, "Lifetime")."""
        if key is not None and self.listens_per_key:
            self._release(key)
        hub.listeners -= 1
        if hub.listeners <= 0 and not hub.finished:
            hub.finished = True  # the pump cancels the call after the read under way (`_pump`)
            if hub.call is not None:
                hub.abandoned = hub.loop.call_later(ABANDONED_CANCEL_S, _cancel_abandoned, hub)
            elif hub.task is not None:
                hub.task.cancel()  # not reading yet
            self._forget(hub)

    def _forget(self, hub: _Hub) -> None:
        if self._hubs.get(hub.key) is hub:
            del self._hubs[hub.key]

    async def _pump(self, hub: _Hub, caller: assistant_pb2.Caller) -> None:
        org_id, chat_id, run_id = hub.key
        # max_batch: the orchestrator sends every ready event in one message (a streamed message
        # costs ~0.15-0.2 ms of CPU on each side; docs/performance.md)
        call = self._stub.StreamRun(
            assistant_pb2.StreamRunRequest(
                caller=caller, chat_id=chat_id, run_id=run_id, after=0, max_batch=STREAM_BATCH
            )
        )
        hub.call = call
        outputs: dict[bytes, Any] = {}  # tool outputs converted once per run (sse.render)
        try:
            # Ready once the orchestrator has validated the request: its initial metadata carries
            # the marker, or (when a replay sends no message at all, gRPC may fold the metadata
            # into the trailers) the first message or a clean end of the stream shows it.
            metadata = await call.initial_metadata()
            if any(key == STREAM_READY for key, _ in metadata or ()):
                _set_ready(hub)
            last = ""
            messages = aiter(call)
            async for item in messages:
                if (
                    hub.finished
                ):  # its last listener left (`leave`): cancelled with no read under way
                    call.cancel()
                    await (
                        messages.aclose()
                    )  # now, not when the garbage collector breaks the call's cycle with it
                    return
                _set_ready(hub)
                for event in item.events or (item.event,):
                    hub.publish(sse.encode(event, outputs))
                    last = event.WhichOneof("payload") or ""
            _set_ready(hub)
            if (
                last not in _STREAM_ENDS
            ):  # ended without the run's end nor the orchestrator's reconnect frame
                log.warning(
                    "run stream ended without its end", extra={"fields": {"run_id": run_id}}
                )
                hub.broken = True
        except asyncio.CancelledError:
            call.cancel()
            raise
        except grpc.aio.AioRpcError as error:
            if not hub.ready.done():
                hub.ready.set_exception(error)
            elif error.code() != grpc.StatusCode.CANCELLED:
                log.warning("run stream broke", extra={"fields": {"run_id": run_id}})
                hub.broken = (
                    True  # not one of the run's frames: each listener's own, naming its position
                )
        finally:
            if not hub.ready.done():
                hub.ready.set_exception(StreamUnavailable())
            if hub.abandoned is not None:
                hub.abandoned.cancel()  # and with it the timer's hold on the hub and its frames
            hub.end()
            self._forget(hub)


STREAM_BATCH = 128  # StreamRunRequest.max_batch: events per upstream message at most
ABANDONED_CANCEL_S = 1.0  # how long the read of a hub without listeners may wait for a message before its call is cancelled
# the last event of an upstream stream that ended well: the run's end (a paused run's may be followed
# by `run_resumed`), or the orchestrator's own `error` frame that names where to reconnect; any
# other end is a broken stream (`broken_frame`)
_STREAM_ENDS = frozenset({"done", "cancelled", "interrupted", "run_resumed", "error"})


def _cancel_abandoned(hub: _Hub) -> None:
    """Timer of `leave`: cancel the upstream call of an abandoned hub whose pump still waits for a
    message (at the cost of the grpc.aio leak described in the module docstring)."""
    hub.call.cancel()


def _set_ready(hub: _Hub) -> None:
    if not hub.ready.done():
        hub.ready.set_result(None)


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

    _raw_headers: ClassVar[
        dict[tuple[tuple[str, str], ...], list[tuple[bytes, bytes]]]
    ] = {}  # rendered once per header set

    def __init__(
        self,
        fanout: RunFanout,
        hub: _Hub,
        after: int,
        headers: dict[str, str] | None = None,
        key: str | None = None,
    ) -> None:
        self.fanout, self.hub, self.after, self.key = fanout, hub, after, key
        self.status_code = 200
        self.background = None
        key = tuple(headers.items()) if headers else ()
        raw = self._raw_headers.get(key)
        if raw is None:
            self.init_headers(headers)
            if len(self._raw_headers) < 64:
                self._raw_headers[key] = self.raw_headers
        else:
            self.raw_headers = list(raw)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve the stream until it ends or the client disconnects (ASGI `http.disconnect`)."""
        hub = self.hub
        listener: _Listener | None = None
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            listener = _Listener(hub, self.after, send, _transport_of(scope))
            hub.attach(listener)
            while True:  # returns once the response is complete (uvicorn) or the client has gone
                message = await receive()
                if message["type"] == "http.disconnect":
                    break
        finally:
            if listener is not None:
                hub.detach(listener)
                if listener.writer is not None and not listener.finishing:
                    listener.writer.cancel()
            self.fanout.leave(hub, self.key)
        if listener is not None and listener.writer is not None:
            # an in-process transport reports the end before the last send: let the writer finish.
            # asyncio.wait, not an await of the task: a writer cancelled above (the client left) must
            # not raise CancelledError out of the response, which uvicorn logged as an ERROR with a
            # traceback for every client that left mid-stream (fresh-eyes test)
            await asyncio.wait({listener.writer})
