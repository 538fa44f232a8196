"""The gateway's listener fan-out (services/gateway/fanout.py, listener.py) against a fake
orchestrator stream.

Rules: every listener gets the run's frames from its `?after=N` index without gaps or
repeats; heartbeats only after the heartbeat interval of silence and not counted by
`after`; a listener whose client stops reading does not hold up the others (it is served
through ASGI send with flow control instead of direct writes); the response ends after the
last frame; the last listener to leave cancels the upstream call.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import grpc
import pytest

from loopline.assistant.v1 import assistant_pb2, events_pb2
from services.gateway import fanout as fanout_module
from services.gateway import listener as listener_module
from services.gateway import sse
from services.gateway.fanout import RunFanout
from services.gateway.listener import EventStreamResponse, Listener


def chunk_event(seq: int, text: str) -> events_pb2.Event:
    return events_pb2.Event(
        seq=seq, run_id="run", response_chunk=events_pb2.ResponseChunkEvent(chunk=text)
    )


def done_event(seq: int) -> events_pb2.Event:
    return events_pb2.Event(seq=seq, run_id="run", done=events_pb2.DoneEvent(response="ok"))


class FakeCall:
    """A StreamRun call whose messages the test feeds through a queue (None ends the stream, an
    exception is raised by it, e.g. a grpc.aio.AioRpcError: the stream broke)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[events_pb2.Event | BaseException | None] = asyncio.Queue()
        self.cancelled = False

    async def initial_metadata(self) -> list[tuple[str, str]]:
        return [(fanout_module.STREAM_READY, "1")]

    def cancel(self) -> None:
        self.cancelled = True
        self.queue.put_nowait(
            asyncio.CancelledError()
        )  # as grpc.aio: a read of a locally cancelled call raises it

    def __aiter__(self) -> FakeCall:
        return self

    async def aclose(self) -> None:
        """As the async generator grpc.aio's call iterates with."""

    async def __anext__(self) -> Any:
        event = await self.queue.get()
        if event is None:
            raise StopAsyncIteration
        if isinstance(event, BaseException):
            raise event
        return assistant_pb2.StreamRunResponse(event=event)


class FakeStub:
    def __init__(self) -> None:
        self.calls: list[FakeCall] = []

    def StreamRun(self, request: assistant_pb2.StreamRunRequest) -> FakeCall:  # noqa: N802 - gRPC stub method name
        self.calls.append(FakeCall())
        return self.calls[-1]


class AsgiClient:
    """The ASGI side of one response: collects body bytes; `disconnect()` simulates the client
    leaving."""

    def __init__(self, block_sends: bool = False) -> None:
        self.body = bytearray()
        self.complete = asyncio.Event()
        self.gone = asyncio.Event()
        self.block_sends = block_sends
        self.sent_request = False

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            if self.block_sends:
                await asyncio.Event().wait()  # a client that never reads: the send never completes
            self.body += message.get("body", b"")
            if not message.get("more_body", False):
                self.complete.set()

    async def receive(self) -> dict[str, Any]:
        if not self.sent_request:
            self.sent_request = True
            return {"type": "http.request", "body": b"", "more_body": False}
        complete = asyncio.ensure_future(self.complete.wait())
        gone = asyncio.ensure_future(self.gone.wait())
        await asyncio.wait({complete, gone}, return_when=asyncio.FIRST_COMPLETED)
        complete.cancel()
        gone.cancel()
        return {"type": "http.disconnect"}

    def frames(self) -> list[bytes]:
        return [frame + b"\n\n" for frame in bytes(self.body).split(b"\n\n") if frame]


async def listen(
    fan: RunFanout, after: int = 0, client: AsgiClient | None = None
) -> tuple[AsgiClient, asyncio.Task]:
    client = client or AsgiClient()
    hub = await fan.open(assistant_pb2.Caller(organization_id="org", user_id="user"), "chat", "run")
    response = EventStreamResponse(fan, hub, after)
    scope = {"type": "http", "method": "GET"}
    return client, asyncio.create_task(response(scope, client.receive, client.send))


async def until(predicate, timeout: float = 5.0) -> None:  # noqa: ANN001
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


async def test_listeners_get_every_frame_from_their_after_index_and_the_stream_ends_after_done():
    stub = FakeStub()
    fan = RunFanout(stub, heartbeat_s=60)  # type: ignore[arg-type]
    first, first_task = await listen(fan)
    call = stub.calls[0]
    events = [chunk_event(i, f"c{i}") for i in range(3)]
    for event in events:
        call.queue.put_nowait(event)
    await until(lambda: len(first.frames()) == 3)
    late, late_task = await listen(fan, after=2)
    assert len(stub.calls) == 1, "listeners of a run share one upstream stream"
    call.queue.put_nowait(done_event(3))
    call.queue.put_nowait(None)
    await asyncio.wait_for(asyncio.gather(first_task, late_task), 5)
    expected = [sse.encode(e) for e in [*events, done_event(3)]]
    assert first.frames() == expected
    assert late.frames() == expected[2:]
    assert fan.active_runs() == 0


async def test_heartbeat_only_after_the_interval_of_silence_and_not_counted_by_after():
    stub = FakeStub()
    fan = RunFanout(stub, heartbeat_s=0.2)  # type: ignore[arg-type]
    client, task = await listen(fan)
    call = stub.calls[0]
    call.queue.put_nowait(chunk_event(0, "a"))
    await until(lambda: len(client.frames()) == 1)
    await asyncio.sleep(0.1)
    assert client.frames() == [sse.encode(chunk_event(0, "a"))], "no heartbeat before the interval"
    await until(lambda: sse.HEARTBEAT_FRAME in client.frames(), timeout=2)
    call.queue.put_nowait(chunk_event(1, "b"))
    await until(lambda: sse.encode(chunk_event(1, "b")) in client.frames())
    again, again_task = await listen(fan, after=1)  # after counts events only: b is index 1
    call.queue.put_nowait(done_event(2))
    call.queue.put_nowait(None)
    await asyncio.wait_for(asyncio.gather(task, again_task), 5)
    assert [f for f in again.frames() if f != sse.HEARTBEAT_FRAME] == [
        sse.encode(chunk_event(1, "b")),
        sse.encode(done_event(2)),
    ]


class FakeTransport:
    """A connection for the direct-write path: `backlog` plays the bytes the client has not read."""

    def __init__(self, backlog: int = 0) -> None:
        self.written = bytearray()
        self.backlog = backlog

    def write(self, data: bytes) -> None:
        self.written += data

    def get_write_buffer_size(self) -> int:
        return self.backlog

    def is_closing(self) -> bool:
        return False


class AbortableTransport(FakeTransport):
    aborted = False

    def abort(self) -> None:
        self.aborted = True


async def test_a_listener_that_stops_reading_does_not_hold_up_the_others():
    stub = FakeStub()
    fan = RunFanout(stub, heartbeat_s=60)  # type: ignore[arg-type]
    hub = await fan.open(assistant_pb2.Caller(organization_id="org", user_id="user"), "chat", "run")
    await fan.open(assistant_pb2.Caller(organization_id="org", user_id="user"), "chat", "run")
    stuck_client, reader_client = AsgiClient(block_sends=True), AsgiClient()
    stuck = Listener(hub, 0, stuck_client.send, FakeTransport(backlog=10 * 1024 * 1024))  # type: ignore[arg-type]
    reader = Listener(hub, 0, reader_client.send, FakeTransport())  # type: ignore[arg-type]
    hub.attach(stuck)
    hub.attach(reader)
    for i in range(50):
        stub.calls[0].queue.put_nowait(chunk_event(i, "x" * 1000))
    await until(lambda: reader.index == 50)
    written = bytes(reader.transport.written)  # type: ignore[union-attr]
    assert written.count(b"data: ") == 50 and written.endswith(
        b"\r\n"
    )  # HTTP/1.1 chunks of whole frames
    assert stuck.writer is not None and not stuck.transport.written, (
        "the stuck client goes through ASGI send"
    )  # type: ignore[union-attr]
    stuck.writer.cancel()
    hub.detach(stuck)
    hub.detach(reader)
    fan.leave(hub)
    fan.leave(hub)
    await until(lambda: stub.calls[0].cancelled)
    assert fan.active_runs() == 0


async def test_the_last_listener_to_leave_cancels_the_upstream_stream_and_others_are_undisturbed():
    stub = FakeStub()
    fan = RunFanout(stub, heartbeat_s=60)  # type: ignore[arg-type]
    leaving, leaving_task = await listen(fan)
    staying, staying_task = await listen(fan)
    call = stub.calls[0]
    call.queue.put_nowait(chunk_event(0, "a"))
    await until(lambda: len(staying.frames()) == 1)
    leaving.gone.set()
    await asyncio.wait_for(leaving_task, 5)
    call.queue.put_nowait(chunk_event(1, "b"))
    await until(lambda: len(staying.frames()) == 2)
    assert not call.cancelled and fan.active_runs() == 1
    staying.gone.set()
    await asyncio.wait_for(staying_task, 5)
    await until(lambda: call.cancelled)
    assert fan.active_runs() == 0


class RecordingTransport:
    """A uvicorn-like transport that keeps up: records each write."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return False


def _dechunk(writes: list[bytes]) -> bytes:
    body = b""
    for chunk in writes:
        size, rest = chunk.split(b"\r\n", 1)
        assert rest[int(size, 16) :] == b"\r\n"
        body += rest[: int(size, 16)]
    return body


async def test_a_large_fanout_is_served_in_slices_and_frames_arriving_mid_round_share_a_write():
    """Bug: one flush wrote to every listener in one callback (10,000 listeners held the gateway's
    event loop ~100 ms per event, and an event published meanwhile waited for the whole pass).
    Now a round serves FLUSH_SLICE listeners per loop iteration; those not yet served when the
    next frame arrives get both frames in one write; the earlier ones get it in the next round."""
    hub = fanout_module.RunHub(("org", "chat", "run"), heartbeat_s=60.0)
    count = 3 * fanout_module.FLUSH_SLICE + 10
    transports = [RecordingTransport() for _ in range(count)]

    async def send(message: dict[str, Any]) -> None:
        return None

    for transport in transports:
        hub.attach(Listener(hub, 0, send, transport))
    first, second = b'data: {"n":1}\n\n', b'data: {"n":2}\n\n'
    hub.publish(first)
    await asyncio.sleep(0)  # one loop iteration: one slice
    served = sum(1 for t in transports if t.writes)
    assert 0 < served <= fanout_module.FLUSH_SLICE
    hub.publish(second)  # mid-round
    await until(lambda: all(_dechunk(t.writes) == first + second for t in transports))
    assert all(len(t.writes) == 2 for t in transports[:served])  # served before `second` came
    assert all(t.writes == [listener_module.http_chunk(first + second)] for t in transports[-10:])
    if hub.heartbeat_handle is not None:
        hub.heartbeat_handle.cancel()


async def test_the_end_of_a_run_delivers_every_frame_at_once_even_mid_round():
    hub = fanout_module.RunHub(("org", "chat", "run"), heartbeat_s=60.0)
    transports = [RecordingTransport() for _ in range(2 * fanout_module.FLUSH_SLICE + 1)]
    ended: list[int] = []

    async def send(message: dict[str, Any]) -> None:
        if not message.get("more_body", True):
            ended.append(1)

    for transport in transports:
        hub.attach(Listener(hub, 0, send, transport))
    hub.publish(b'data: {"n":1}\n\n')
    await asyncio.sleep(0)  # the round is under way
    hub.publish(b'data: {"n":2}\n\n')
    hub.end()
    assert all(_dechunk(t.writes) == b'data: {"n":1}\n\ndata: {"n":2}\n\n' for t in transports)
    await until(lambda: len(ended) == len(transports))
    await asyncio.sleep(0.01)
    assert all(
        _dechunk(t.writes) == b'data: {"n":1}\n\ndata: {"n":2}\n\n' for t in transports
    )  # nothing more


async def test_heartbeats_to_many_listeners_go_out_in_slices_and_reach_every_silent_listener():
    # 0.5 s, not 0.05: a round spans four loop iterations, and a CI runner that stalled this
    # process for 50 ms between two of them let the next check beat the first slice again
    # before the last had its first (CI: "one each" failed)
    hub = fanout_module.RunHub(("org", "chat", "run"), heartbeat_s=0.5)
    transports = [RecordingTransport() for _ in range(3 * fanout_module.FLUSH_SLICE + 7)]

    async def send(message: dict[str, Any]) -> None:
        return None

    for transport in transports:
        hub.attach(Listener(hub, 0, send, transport))
    steps: list[int] = []
    deadline = asyncio.get_running_loop().time() + 5
    while sum(1 for t in transports if t.writes) < len(transports):
        assert asyncio.get_running_loop().time() < deadline, (
            "heartbeats did not reach every listener"
        )
        before = sum(1 for t in transports if t.writes)
        await asyncio.sleep(0)
        after = sum(1 for t in transports if t.writes)
        if after > before:
            steps.append(after - before)
    assert max(steps) <= fanout_module.FLUSH_SLICE and len(steps) >= 3
    assert all(
        t.writes == [listener_module.HEARTBEAT_CHUNK] for t in transports
    )  # one each, nothing else
    # the next check: every listener is silent again and gets a second one
    await until(lambda: all(len(t.writes) >= 2 for t in transports))
    assert all(set(t.writes) == {listener_module.HEARTBEAT_CHUNK} for t in transports)
    hub.end()


async def test_a_listener_past_the_end_of_an_ended_stream_gets_its_end_frame():
    """After an orchestrator crash on the memory backend the reaper's `error` and `done` are the
    run's frames 0 and 1, so a client that read 4 frames reconnects with ?after=4 past the end.
    A listener at or past the end of an ended stream that was handed nothing gets the last frame
    (the run's end), and so does one at exactly the end of such a stream (it does not begin with
    `metadata`: its beginning was lost); one that was handed frames gets no repeat, nor one at
    the end of a whole stream (it has them all)."""
    stub = FakeStub()
    fan = RunFanout(stub, heartbeat_s=60)  # type: ignore[arg-type]
    live, live_task = await listen(fan)
    past, past_task = await listen(fan, after=4)
    at_end, at_end_task = await listen(fan, after=2)
    call = stub.calls[0]
    error = events_pb2.Event(
        seq=0, run_id="run", error=events_pb2.ErrorEvent(message="The run was lost")
    )
    done = events_pb2.Event(seq=1, run_id="run", done=events_pb2.DoneEvent(response="", error=True))
    for event in (error, done, None):
        call.queue.put_nowait(event)
    await asyncio.wait_for(asyncio.gather(live_task, past_task, at_end_task), 5)
    assert live.frames() == [sse.encode(error), sse.encode(done)]
    assert past.frames() == [sse.encode(done)] == at_end.frames()
    # a later reconnect past the end of the ended run: a fresh replay, the same end frame
    again, again_task = await listen(fan, after=7)
    replay = stub.calls[1]
    for event in (error, done, None):
        replay.queue.put_nowait(event)
    await asyncio.wait_for(again_task, 5)
    assert again.frames() == [sse.encode(done)]


async def test_a_listener_at_the_end_of_a_whole_stream_gets_nothing_more():
    stub = FakeStub()
    fan = RunFanout(stub, heartbeat_s=60)  # type: ignore[arg-type]
    at_end, at_end_task = await listen(fan, after=3)
    metadata = events_pb2.Event(
        seq=0, run_id="run", metadata=events_pb2.MetadataEvent(run_id="run", thread_id="chat")
    )
    for event in (metadata, chunk_event(1, "hi"), done_event(2), None):
        stub.calls[0].queue.put_nowait(event)
    await asyncio.wait_for(at_end_task, 5)
    assert at_end.frames() == []


async def test_a_broken_upstream_stream_tells_each_listener_the_after_position_to_resume_from():
    """When the orchestrator dies mid-run, each listener's error frame names its own position
    (not a bare "?after=N"): the run's frames it has, those it was handed plus the `after` it
    joined with (the error frame and heartbeats are not counted); reconnecting with it
    continues right after them."""
    stub = FakeStub()
    fan = RunFanout(stub, heartbeat_s=60)  # type: ignore[arg-type]
    first, first_task = await listen(fan)
    call = stub.calls[0]
    events = [chunk_event(i, f"c{i}") for i in range(4)]
    for event in events[:3]:
        call.queue.put_nowait(event)
    await until(lambda: len(first.frames()) == 3)
    late, late_task = await listen(fan, after=1)
    await until(lambda: len(late.frames()) == 2)
    ahead, ahead_task = await listen(fan, after=6)  # counted frames this replay has not reached
    call.queue.put_nowait(events[3])
    await until(lambda: len(first.frames()) == 4)
    call.queue.put_nowait(
        grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "socket closed"
        )
    )
    await asyncio.wait_for(asyncio.gather(first_task, late_task, ahead_task), 5)

    def error_message(frame: bytes) -> str:
        data = json.loads(frame.removeprefix(b"data: "))
        assert data["type"] == "error"
        return data["data"]["message"]

    assert first.frames()[:-1] == [sse.encode(e) for e in events]
    assert (
        error_message(first.frames()[-1])
        == "The event stream was interrupted; reconnect with ?after=4"
    )
    assert late.frames()[:-1] == [sse.encode(e) for e in events[1:]]
    assert (
        error_message(late.frames()[-1])
        == "The event stream was interrupted; reconnect with ?after=4"
    )
    assert [error_message(f) for f in ahead.frames()] == [
        "The event stream was interrupted; reconnect with ?after=6"
    ]
    # resuming at the named position: a fresh replay from the orchestrator, the frames after it
    resumed, resumed_task = await listen(fan, after=4)
    replay = stub.calls[1]
    for event in (*events, chunk_event(4, "c4"), done_event(5), None):
        replay.queue.put_nowait(event)
    await asyncio.wait_for(resumed_task, 5)
    assert resumed.frames() == [sse.encode(chunk_event(4, "c4")), sse.encode(done_event(5))]


async def test_an_upstream_stream_ending_without_the_runs_end_gives_each_its_reconnect_frame():
    """A stream that ends with neither the run's end nor an error frame (e.g. a follower's, after
    Redis restarted empty) ends each listener's stream with its reconnect frame."""
    stub = FakeStub()
    fan = RunFanout(stub, heartbeat_s=60)  # type: ignore[arg-type]
    first, first_task = await listen(fan)
    call = stub.calls[0]
    events = [chunk_event(i, f"c{i}") for i in range(2)]
    for event in (*events, None):
        call.queue.put_nowait(event)
    await asyncio.wait_for(first_task, 5)
    assert first.frames() == [*(sse.encode(e) for e in events), listener_module.broken_frame(2)]


async def test_a_stopped_gateway_ends_open_streams_at_once_with_their_reconnect_frame(
    tmp_path, caplog
):
    """A gateway stopped with SIGTERM ends each open stream at once with its own error frame
    naming the listener's ?after=, rather than cutting it at the end of its grace without a
    frame (which uvicorn logs at ERROR with a CancelledError traceback)."""
    import asyncio
    import logging
    import time

    from tests.conftest import SCRIPTED, script, start_stack, stop_stack
    from tests.sse_client import read_frames

    stack = await start_stack(tmp_path, gateway={"shutdown_grace_s": 5.0})
    gateway = stack.gateway
    try:
        async with stack.client() as client:
            started = await client.post(
                "/assistant/chat",
                json={"message": script({"say": "hi", "sleep_ms": 60_000}), "llm": SCRIPTED},
            )
            assert started.status_code == 200, started.text
            listener = asyncio.create_task(read_frames(client, started.json()["stream_url"]))
            await until(lambda: gateway.app.state.fanout.active_runs() > 0, timeout=60.0)
            await asyncio.sleep(0.2)  # the metadata frame is handed over
            caplog.set_level(logging.INFO)
            began = time.monotonic()
            await gateway.stop(5.0)
            frames = await asyncio.wait_for(listener, 5)
        took = time.monotonic() - began
    finally:
        stack.gateway = type(
            "Stopped", (), {"stop": staticmethod(lambda _grace: asyncio.sleep(0))}
        )()
        await stop_stack(stack)
    assert took < 3, took  # not the 5 s grace
    assert frames[-1] == {
        "type": "error",
        "data": {
            "message": f"The event stream was interrupted; reconnect with ?after={len(frames) - 1}"
        },
    }
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [
        r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR
    ]


class _Clock:
    """The parts of an event loop a RunHub uses, on a clock the test moves (`advance`)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[tuple[float, Any]] = []

    def time(self) -> float:
        return self.now

    def call_soon(self, callback: Any) -> asyncio.Handle:
        return self.call_at(self.now, callback)

    def call_at(self, when: float, callback: Any) -> asyncio.TimerHandle:
        handle = asyncio.TimerHandle(when, callback, (), asyncio.get_running_loop())
        self.timers.append((when, handle))
        return handle

    def advance(self, to: float) -> None:
        """Run every timer due by `to`, in time order (also those they set), at its own time."""
        while True:
            due = sorted(
                (when, i, h)
                for i, (when, h) in enumerate(self.timers)
                if when <= to and not h.cancelled()
            )
            if not due:
                break
            when, _, handle = due[0]
            self.timers = [(w, h) for w, h in self.timers if h is not handle]
            self.now = max(self.now, when)
            handle._run()
        self.now = to


async def test_a_heartbeat_is_never_later_than_the_interval_of_silence():
    """A frame shortly after a listener joined must not make its heartbeat late (the next check
    is at least heartbeat_s / 10 after the previous one, which alone would allow 16.5 s of
    silence for 15 s): everyone within 10% of its heartbeat gets it in the same round."""
    hub = fanout_module.RunHub(("org", "chat", "run"), heartbeat_s=15.0)
    hub.loop = clock = _Clock()  # type: ignore[assignment]
    transport = RecordingTransport()

    async def send(message: dict[str, Any]) -> None:
        return None

    hub.attach(Listener(hub, 0, send, transport))  # at 0: the first check is at 15
    clock.advance(0.3)
    hub.publish(b'data: {"n":1}\n\n')  # a frame at 0.3: the silence starts again
    clock.advance(0.3)
    assert _dechunk(transport.writes) == b'data: {"n":1}\n\n'
    beats: list[float] = []
    for step in range(1, 8000):  # up to 80 s
        clock.advance(0.3 + step * 0.01)
        if len(transport.writes) > len(beats) + 1:
            beats.append(clock.now)
        if len(beats) == 3:
            break
    assert all(transport.writes[i] == listener_module.HEARTBEAT_CHUNK for i in range(1, 4))
    silences = [beats[0] - 0.3, beats[1] - beats[0], beats[2] - beats[1]]
    assert all(13.5 - 1e-6 <= silence <= 15.0 + 1e-6 for silence in silences), silences
    hub.end()


class StalledCall(FakeCall):
    """An orchestrator that is alive for gRPC and answers nothing (SIGSTOP): no initial metadata."""

    async def initial_metadata(self) -> list[tuple[str, str]]:
        await asyncio.Event().wait()
        return []


class StalledStub(FakeStub):
    def StreamRun(self, request: assistant_pb2.StreamRunRequest) -> FakeCall:  # noqa: N802 - gRPC stub method name
        self.calls.append(StalledCall())
        return self.calls[-1]


async def test_a_stream_the_orchestrator_never_accepts_times_out_and_cancels_its_upstream_call(
    monkeypatch,
):
    """A listen through a gateway whose orchestrator is stalled (SIGSTOP) is StreamTimeout (504)
    after READY_TIMEOUT_S, not minutes without a status line, and the stalled upstream call is
    cancelled with its last listener."""
    monkeypatch.setattr(fanout_module, "READY_TIMEOUT_S", 0.2)
    stub = StalledStub()
    fan = RunFanout(stub, heartbeat_s=60)  # type: ignore[arg-type]
    with pytest.raises(fanout_module.StreamTimeout):
        await asyncio.wait_for(
            fan.open(assistant_pb2.Caller(organization_id="org", user_id="user"), "chat", "run"), 5
        )
    await until(lambda: fan.active_runs() == 0)
    await until(lambda: stub.calls[0].cancelled)


async def test_a_listen_through_a_stalled_orchestrator_answers_504(services, monkeypatch):
    monkeypatch.setattr(fanout_module, "READY_TIMEOUT_S", 0.2)
    monkeypatch.setattr(services.gateway.app.state.fanout, "_stub", StalledStub())
    async with services.client() as client:
        for query in ("", "?x=1"):  # the lean route, and FastAPI's for any other query
            response = await client.get(
                f"/assistant/chat/{uuid.uuid4()}/listen/{uuid.uuid4()}{query}"
            )
            assert response.status_code == 504, response.text
            assert response.json() == {"detail": "The request timed out"}


def test_both_interrupted_stream_frames_name_the_position_to_reconnect_from_in_one_wording():
    """The gateway's frame (its upstream stream broke) and the orchestrator's (Redis unreachable)
    name the position in one wording, so a client reading N needs to know only one."""
    import re

    from services.orchestrator.eventlog import UNREACHABLE, StreamInterrupted

    pattern = re.compile(
        r"^The event stream was interrupted( \([^)]*\))?; reconnect with \?after=(\d+)$"
    )
    gateway = json.loads(listener_module.broken_frame(7)[len(b"data: ") :])["data"]["message"]
    orchestrator = StreamInterrupted(7, UNREACHABLE).message
    assert pattern.match(gateway).group(2) == pattern.match(orchestrator).group(2) == "7"


class SlowClient(AsgiClient):
    """An ASGI client whose sends wait until `release` is set (a client that stopped reading);
    `sent` keeps the size of each body handed to it."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.sent: list[int] = []

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            self.sent.append(len(message.get("body", b"")))
            await self.release.wait()
        await super().send(message)


async def test_a_listener_that_stops_reading_holds_one_slice_not_a_copy_of_the_run():
    """A stalled listener is pulled from the shared frames with one PULL_SLICE_BYTES slice in
    flight, not handed its own joined copy of every frame it has not read (100 of those on a
    5.6 MB run would take the gateway from 143 to 850 MiB), and still gets every frame in order
    once it reads."""
    stub = FakeStub()
    fan = RunFanout(stub, heartbeat_s=60)  # type: ignore[arg-type]
    hub = await fan.open(assistant_pb2.Caller(organization_id="org", user_id="user"), "chat", "run")
    client = SlowClient()
    listener = Listener(hub, 0, client.send, FakeTransport(backlog=10 * 1024 * 1024))  # type: ignore[arg-type]
    hub.attach(listener)
    events = [chunk_event(i, "x" * 5000) for i in range(400)]  # ~2 MB of frames
    for event in events:
        stub.calls[0].queue.put_nowait(event)
    await until(lambda: len(hub.frames) == 400)
    await asyncio.sleep(0.05)
    assert listener.writer is not None and not listener.pending
    assert len(client.sent) == 1 and client.sent[0] <= listener_module.PULL_SLICE_BYTES
    assert (
        listener.index * 5000 <= listener_module.PULL_SLICE_BYTES
    )  # the rest is only in the hub's shared list
    client.release.set()
    stub.calls[0].queue.put_nowait(done_event(400))
    stub.calls[0].queue.put_nowait(None)
    await asyncio.wait_for(client.complete.wait(), 5)
    assert client.frames() == [sse.encode(e) for e in [*events, done_event(400)]]
    assert max(client.sent) <= listener_module.PULL_SLICE_BYTES
    hub.detach(listener)
    fan.leave(hub)


async def test_a_late_listener_on_a_large_backlog_is_pulled_in_slices_then_pushed_again():
    hub = fanout_module.RunHub(("org", "chat", "run"), heartbeat_s=60.0)
    frames = [b'data: {"n":%d,"pad":"%s"}\n\n' % (i, b"y" * 2000) for i in range(200)]  # ~400 KB
    for frame in frames:
        hub.frames.append(frame)
    sent: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message.get("body", b""))

    transport = RecordingTransport()
    listener = Listener(hub, 0, send, transport)  # type: ignore[arg-type]
    hub.attach(listener)
    assert listener.writer is not None and not transport.writes  # not joined and written whole
    await until(lambda: listener.writer is None)
    assert (
        b"".join(sent) == b"".join(frames)
        and max(len(b) for b in sent) <= listener_module.PULL_SLICE_BYTES
    )
    hub.publish(b'data: {"n":"live"}\n\n')  # caught up: pushed by the hub's round again
    await until(lambda: bool(transport.writes))
    assert _dechunk(transport.writes) == b'data: {"n":"live"}\n\n' and listener.index == 201
    hub.detach(listener)


async def test_a_client_that_leaves_while_its_writer_sends_ends_its_response_without_an_error():
    """A client that leaves mid-stream while its writer is sending must not make the response
    raise CancelledError (logged by uvicorn as "Exception in ASGI application")."""
    stub = FakeStub()
    fan = RunFanout(stub, heartbeat_s=60)  # type: ignore[arg-type]
    client = AsgiClient(block_sends=True)
    _, task = await listen(fan, client=client)
    stub.calls[0].queue.put_nowait(chunk_event(0, "a"))
    await asyncio.sleep(0.05)
    client.gone.set()
    await asyncio.wait_for(task, 5)
    assert task.exception() is None


async def test_a_stopped_gateway_closes_a_listener_that_cannot_take_its_last_frame():
    """A listener that does not read has its connection closed after STALLED_CLOSE_S instead of
    holding the gateway's shutdown for its whole grace; the listeners that read get their
    reconnect frame at once."""
    stub = FakeStub()
    fan = RunFanout(stub, heartbeat_s=60)  # type: ignore[arg-type]
    hub = await fan.open(assistant_pb2.Caller(organization_id="org", user_id="user"), "chat", "run")
    await fan.open(assistant_pb2.Caller(organization_id="org", user_id="user"), "chat", "run")

    stalled_transport = AbortableTransport(backlog=10 * 1024 * 1024)
    stalled = Listener(hub, 0, SlowClient().send, stalled_transport)  # type: ignore[arg-type]
    reader_client = AsgiClient()
    reader = Listener(hub, 0, reader_client.send, FakeTransport())  # type: ignore[arg-type]
    hub.attach(stalled)
    hub.attach(reader)
    stub.calls[0].queue.put_nowait(chunk_event(0, "a"))
    await until(lambda: reader.index == 1)
    started = asyncio.get_running_loop().time()
    await asyncio.wait_for(fan.close(), 5)
    assert asyncio.get_running_loop().time() - started < fanout_module.STALLED_CLOSE_S + 1
    assert stalled_transport.aborted and stalled.writer is None
    await until(lambda: reader_client.complete.is_set())
    assert reader_client.frames()[-1] == listener_module.broken_frame(1)


async def test_a_client_that_takes_nothing_for_stalled_send_s_has_its_connection_closed(
    monkeypatch,
):
    """A listener that stopped reading (or whose host vanished without a FIN) held its run's
    frames and hub in the gateway for as long as its connection stayed open, the run long
    ended too. A send it takes none of within STALLED_SEND_S closes its connection (uvicorn then
    reports the disconnect, and the listener leaves); a listener that reads is not touched."""
    monkeypatch.setattr(fanout_module, "STALLED_SEND_S", 0.5)
    stub = FakeStub()
    fan = RunFanout(stub, heartbeat_s=60)  # type: ignore[arg-type]
    hub = await fan.open(assistant_pb2.Caller(organization_id="org", user_id="user"), "chat", "run")
    stalled_transport = AbortableTransport(backlog=10 * 1024 * 1024)
    stalled = Listener(hub, 0, AsgiClient(block_sends=True).send, stalled_transport)  # type: ignore[arg-type]
    reader_client = SlowClient()  # takes each send after ~0.05 s: slow, within the bound
    reader = Listener(hub, 0, reader_client.send, AbortableTransport(backlog=10 * 1024 * 1024))  # type: ignore[arg-type]
    hub.attach(stalled)
    hub.attach(reader)
    for i in range(3):
        stub.calls[0].queue.put_nowait(chunk_event(i, "a"))
    stub.calls[0].queue.put_nowait(done_event(3))
    stub.calls[0].queue.put_nowait(None)

    async def read_slowly() -> None:
        while not reader_client.complete.is_set():
            await asyncio.sleep(0.05)
            reader_client.release.set()
            reader_client.release.clear()

    reading = asyncio.create_task(read_slowly())
    await until(lambda: stalled_transport.aborted)  # before: never
    await until(lambda: stalled.writer is None)
    assert stalled.gone
    await asyncio.wait_for(reading, 5)
    assert len(reader_client.frames()) == 4 and not reader.transport.aborted  # type: ignore[union-attr]
