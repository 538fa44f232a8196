"""Listener fan-out: one upstream `StreamRun` per run per gateway process, shared by every listener.

Each event is rendered to its SSE frame once (`sse.encode`) and the bytes are kept in an
append-only list (`RunHub.frames`). The hub pushes new frames to its listeners: a flush round
walks the listeners, `FLUSH_SLICE` per event-loop iteration, and hands each the bytes from its
own `?after=N` index up to the frames at hand (the joined bytes are built once per distinct
index, so normally once); frames that arrive mid-round reach the listeners not yet served in
the same write. A listener costs no task wake-up, no timer and no encoding per event, and a
large fan-out never holds the event loop for more than a slice (target: 10,000 listeners on one
process, delay p99 <= 50 ms). How the bytes reach each client (pushed to the transport, or
pulled by a writer task when it lags) is in `listener.py`.

Heartbeats (`data: {"type":"heartbeat"}`, not counted by `?after=N`) come from one timer per
hub, not one per listener: when the first listener falls silent for `heartbeat_s`, every
listener silent for 90% of it or longer gets one in the same round (up to 10% early, never
late: spec "every 15s of inter-event silence"), and the next check is at least
`heartbeat_s / 10` later.

Lifetime: the upstream call starts with the first listener and is validated by it (the
orchestrator sends initial metadata `x-loopline-stream` once the chat and run check out, or
fails with NOT_FOUND); it ends when the run's stream ends, or is cancelled when the last
listener leaves: between two reads, once the read under way has brought its message (a
replay's next one comes at once), or after ABANDONED_CANCEL_S if none comes (a live run gone
quiet). grpc.aio frees a read's buffers only when its reader takes the result
(grpc/grpc#43360): cancelling the task under a read leaks the message being read, and
cancelling the call under one still leaks a little (docs/security.md). A finished hub is
forgotten at once, so a later listener starts a fresh replay from the orchestrator (which has
every event of the run). When the upstream call fails after validation (the orchestrator died
or restarted), each listener's stream ends with the gateway's own `error` frame naming that
listener's `?after=` position to resume from (`broken_frame`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from loopline.assistant.v1 import assistant_pb2, assistant_pb2_grpc
from services.common import metrics
from services.gateway import sse
from services.gateway.listener import (
    HEARTBEAT_CHUNK,
    PULL_SLICE_BYTES,
    Listener,
    broken_frame,
    http_chunk,
)
from services.gateway.parallel_write import ParallelWriter

log = logging.getLogger(__name__)

STREAM_READY = "x-loopline-stream"
# longest a listener's client may take to accept one send before its connection is closed
# (nginx's send_timeout)
STALLED_SEND_S = 60.0
# at shutdown, how long a listener's writer may take to send its last frame before its
# connection is closed
STALLED_CLOSE_S = 1.0
# longest wait for the orchestrator to accept a stream (the unary calls' deadline)
READY_TIMEOUT_S = 30.0
STREAM_BATCH = 128  # StreamRunRequest.max_batch: events per upstream message at most
# how long the read of a hub without listeners may wait for a message before its call is
# cancelled
ABANDONED_CANCEL_S = 1.0
# the last event of an upstream stream that ended well: the run's end (a paused run's may be
# followed by `run_resumed`), or the orchestrator's own `error` frame that names where to
# reconnect; any other end is a broken stream (`broken_frame`)
_STREAM_ENDS = frozenset({"done", "cancelled", "interrupted", "run_resumed", "error"})
METADATA_FRAME_START = b'data: {"type":"metadata"'  # how every whole run stream begins (sse.encode)
FLUSH_SLICE = 256  # listeners served per event-loop iteration by one flush (see RunHub.flush)


class StreamTimeout(Exception):
    """The orchestrator did not accept the stream within READY_TIMEOUT_S (it is stalled: alive
    for gRPC, answering nothing); the listen is 504 like a unary call past its deadline."""


class StreamUnavailable(Exception):
    """The orchestrator closed the stream before validating it without a status to pass on."""


class TooManyListens(Exception):
    """The caller's API key already holds `limit` listens on this gateway
    (`RunFanout.listens_per_key`)."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.limit = limit


class RunHub:
    """The shared upstream stream of one run: its frames, its attached listeners, the flush
    rounds that push frames to them and the heartbeat timer (module docstring)."""

    __slots__ = (
        "abandoned",
        "beat_due",
        "beat_next",
        "broken",
        "call",
        "created",
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
        "round_created",
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
        self.send_timeout_s = send_timeout_s  # a listener's send bound (`Listener._send`)
        # `_cancel_abandoned` of a hub its last listener left
        self.abandoned: asyncio.TimerHandle | None = None
        self.writer = writer  # large rounds' socket writes on every core (parallel_write)
        self.frames: list[bytes] = []
        self.finished = False
        # the upstream stream failed after validation: each listener's end is `broken_frame`
        self.broken = False
        self.loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[None] = self.loop.create_future()
        # mark the exception retrieved
        self.ready.add_done_callback(lambda f: None if f.cancelled() else f.exception())
        self.listeners = 0  # joined (open() returned or is waiting), attached or not
        self.streams: dict[Listener, None] = {}  # attached listeners, in arrival order
        self.task: asyncio.Task[None] | None = None
        self.call: Any = None
        self.flush_handle: asyncio.Handle | None = None
        self.heartbeat_s = heartbeat_s
        self.heartbeat_handle: asyncio.TimerHandle | None = None  # the next heartbeat check
        self.beat_due = False  # a heartbeat check is owed by the next round
        self.round: list[Listener] | None = None  # the listeners of the flush round in progress
        self.round_at = 0  # how many of them have been served
        self.round_from = 0  # len(frames) when the round began
        self.round_beats = False  # this round also sends heartbeats to silent listeners
        self.beat_next = 0.0  # loop time when the next listener of this round falls silent
        # creation time (wall clock) of the oldest live event not yet handed to a round, 0.0 none;
        # and that of the round in progress: observed as the delivery delay when it ends
        self.created = 0.0
        self.round_created = 0.0

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
            self.round_created, self.created = self.created, 0.0
        stop = min(self.round_at + FLUSH_SLICE, len(self.round))
        self._serve(self.round[self.round_at : stop], self.round_beats)
        self.round_at = stop
        if stop < len(self.round):
            self._schedule()
            return
        if self.round_created:
            if self.round:
                metrics.event_delivered(self.round_created)
            self.round_created = 0.0
        self.round = None
        if self.round_beats and not self.finished and self.streams:
            if self.heartbeat_handle is not None:
                self.heartbeat_handle.cancel()
            self.heartbeat_handle = self.loop.call_at(
                max(self.beat_next, self.loop.time() + self.heartbeat_s / 10), self._heartbeat
            )
        if len(self.frames) > self.round_from or self.beat_due:
            self._schedule()

    def _serve(self, listeners: list[Listener], beats: bool = False) -> None:
        """Hand each of `listeners` the frames from its index to the current end; with `beats`,
        a heartbeat to each that has nothing new and has been silent for 90% of `heartbeat_s`
        or more."""
        frames, end = self.frames, len(self.frames)
        now = self.loop.time()
        interval = self.heartbeat_s
        built: dict[int, tuple[bytes, bytes]] = {}
        writer = self.writer
        # Large rounds: the chunks of listeners whose sockets take them directly are written
        # by the ParallelWriter on every core after the walk, the rest one by one in the walk.
        direct: list[tuple[int, bytes]] | None = (
            [] if writer is not None and writer.enabled_for(len(listeners)) else None
        )
        owners: list[Listener] = []
        for listener in listeners:
            if listener.gone or listener.writer is not None:
                continue  # pulled: its writer takes the frames itself
            start = listener.index
            if start < end:
                if not listener.pushable():
                    listener.pull()  # it lags (or has no uvicorn transport): pulled from here on
                    continue
                prepared = built.get(start)
                if prepared is None:
                    body = frames[start] if end - start == 1 else b"".join(frames[start:end])
                    prepared = built[start] = (body, http_chunk(body))
                listener.index = end
                listener.last = now
                listener.fed = True
            elif beats:
                # due, or within 10%: now, with the others
                if now - listener.last >= interval - interval / 10:
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

    def _write_direct(self, direct: list[tuple[int, bytes]], owners: list[Listener]) -> None:
        """Write each `(fd, chunk)` of `direct` straight to its socket (`ParallelWriter`); what a
        socket did not take, or refused with an error, goes to its transport's own `write`
        (buffered with flow control, or the error seen and the connection closed as usual)."""
        assert self.writer is not None
        for index, written in self.writer.write(direct):
            chunk = direct[index][1]
            transport = owners[index].transport
            if transport is not None and not transport.is_closing():
                transport.write(chunk[written:] if written > 0 else chunk)

    def attach(self, listener: Listener) -> None:
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

    def detach(self, listener: Listener) -> None:
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
        oldest = min(filter(None, (self.round_created, self.created)), default=0.0)
        if oldest and self.streams:
            metrics.event_delivered(oldest)
        if self.heartbeat_handle is not None:
            self.heartbeat_handle.cancel()
            self.heartbeat_handle = None
        for listener in list(self.streams):
            listener.finish()

    def end_frame(self, listener: Listener) -> bytes | None:
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


class RunFanout:
    """Shares upstream StreamRun calls between the listeners of a run (see the module docstring).

    `heartbeat_s` is the silence (seconds) after which a listener gets a heartbeat frame
    (LOOPLINE_HEARTBEAT_INTERVAL_S; spec: 15 s of inter-event silence); `send_timeout_s` bounds
    each send to a listener (LOOPLINE_HTTP_SEND_TIMEOUT_S; None: STALLED_SEND_S);
    `listens_per_key` is how many listens one API key may hold at once
    (LOOPLINE_HTTP_LISTENS_PER_KEY; 0: not limited), counted by the `key` given to `open` and
    `leave`.
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
        self._hubs: dict[tuple[str, str, str], RunHub] = {}
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
        afterwards are StreamUnavailable (503, Retry-After).

        A listener that does not read (its connection's buffers full) cannot take its frame: after
        STALLED_CLOSE_S its connection is closed (aborted) rather than holding the shutdown for
        the server's whole grace; the bytes it received are whole frames up to some point, from
        which it reconnects with `?after=`."""
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
    ) -> RunHub:
        """Join (or start) the hub of a run; raises grpc.aio.AioRpcError (e.g. NOT_FOUND) or
        StreamUnavailable when the orchestrator refuses the stream, StreamTimeout when it has not
        accepted it within READY_TIMEOUT_S (a stalled orchestrator must not leave the listen
        without a status line), TooManyListens when `key` (the caller's API key, see
        `listens_per_key`) holds as many listens as it may. The caller must `leave` it with the same
        `key` (`EventStreamResponse` does)."""
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

    async def _open(self, caller: assistant_pb2.Caller, chat_id: str, run_id: str) -> RunHub:
        key = (caller.organization_id, chat_id, run_id)
        hub = self._hubs.get(key)
        if hub is None or hub.finished:
            hub = RunHub(key, self._heartbeat_s, self._writer, self._send_timeout_s)
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
        else:
            error = hub.ready.exception()
            if error is not None:
                self.leave(hub)
                raise error
        return hub

    def leave(self, hub: RunHub, key: str | None = None) -> None:
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

    def _forget(self, hub: RunHub) -> None:
        if self._hubs.get(hub.key) is hub:
            del self._hubs[hub.key]

    async def _pump(self, hub: RunHub, caller: assistant_pb2.Caller) -> None:
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
            # the stream's first message, and one after a full batch, replay the run's past
            # events: only later ones are live, their delivery delay measured (`RunHub.created`)
            replay = True
            messages = aiter(call)
            async for item in messages:
                if hub.finished:  # its last listener left (`leave`): no read is under way
                    call.cancel()
                    # now, not when the garbage collector breaks the call's cycle with it
                    await messages.aclose()
                    return
                _set_ready(hub)
                events = item.events or (item.event,)
                if not replay and not hub.created:
                    hub.created = metrics.event_created(events[0])
                replay = len(events) >= STREAM_BATCH
                for event in events:
                    hub.publish(sse.encode(event, outputs))
                    last = event.WhichOneof("payload") or ""
            _set_ready(hub)
            # ended without the run's end nor the orchestrator's reconnect frame
            if last not in _STREAM_ENDS:
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
                log.warning(
                    "run stream broke",
                    extra={"fields": {"run_id": run_id, "code": error.code().name}},
                )
                # not one of the run's frames: each listener's own, naming its position
                hub.broken = True
        finally:
            if not hub.ready.done():
                hub.ready.set_exception(StreamUnavailable())
            if hub.abandoned is not None:
                hub.abandoned.cancel()  # and with it the timer's hold on the hub and its frames
            hub.end()
            self._forget(hub)


def _cancel_abandoned(hub: RunHub) -> None:
    """Timer of `leave`: cancel the upstream call of an abandoned hub whose pump still waits for a
    message (at the cost of the grpc.aio leak described in the module docstring)."""
    hub.call.cancel()


def _set_ready(hub: RunHub) -> None:
    if not hub.ready.done():
        hub.ready.set_result(None)
