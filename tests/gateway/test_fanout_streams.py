"""What each listener of a run gets from the gateway's fan-out of one upstream stream.

Rules: every listener gets the run's frames from its `?after=N` index without gaps or repeats;
the response ends after the last frame; a listener past the end of an ended stream gets the end
frame; a broken or cut-short upstream stream ends each listener with a reconnect frame naming its
own position; an upstream call the orchestrator never accepts times out (504); the last
listener to leave cancels the upstream call.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import grpc
import pytest

from loopline.assistant.v1 import assistant_pb2, events_pb2
from services.gateway import fanout as fanout_module
from services.gateway import listener as listener_module
from services.gateway import sse
from services.gateway.fanout import RunFanout
from tests.gateway.fanout_fakes import (
    FakeCall,
    FakeStub,
    chunk_event,
    done_event,
    listen,
    until,
)


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


async def test_a_broken_upstream_stream_tells_each_listener_the_after_position_to_resume_from(
    caplog,
):
    """When the orchestrator dies mid-run, each listener's error frame names its own position
    (not a bare "?after=N"): the run's frames it has, those it was handed plus the `after` it
    joined with (the error frame and heartbeats are not counted); reconnecting with it
    continues right after them. The log line names the stream's status code."""
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
    broke = [r for r in caplog.records if r.getMessage() == "run stream broke"]
    assert [r.fields["code"] for r in broke] == ["UNAVAILABLE"]

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
    # None ends the fake stream
    for event in (*events, chunk_event(4, "c4"), done_event(5), None):  # type: ignore[assignment]
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
    # a non-match fails the test as well
    assert pattern.match(gateway).group(2) == pattern.match(orchestrator).group(2) == "7"  # type: ignore[union-attr]


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
