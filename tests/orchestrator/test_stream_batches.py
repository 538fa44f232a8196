"""StreamRun batching (StreamRunRequest.max_batch): the same events, fewer messages."""

from __future__ import annotations

import asyncio

import grpc

from loopline.assistant.v1 import assistant_pb2, assistant_pb2_grpc, events_pb2
from services.orchestrator.eventlog.memory import MemoryEventLog
from tests.orchestrator.helpers import run_turn


def _chunk(run_id: str, text: str) -> events_pb2.Event:
    return events_pb2.Event(run_id=run_id, response_chunk=events_pb2.ResponseChunkEvent(chunk=text))


def _done(run_id: str) -> events_pb2.Event:
    return events_pb2.Event(run_id=run_id, done=events_pb2.DoneEvent(response="ok"))


async def test_follow_batches_yields_everything_published_at_once_then_follows_live():
    log = MemoryEventLog()
    log.open("r")
    for text in ("a", "b", "c"):
        log.append(_chunk("r", text))
    batches = log.follow_batches("r", after=1)
    assert [e.response_chunk.chunk for e in await batches.__anext__()] == ["b", "c"]
    waiting = asyncio.ensure_future(batches.__anext__())
    await asyncio.sleep(0.01)
    assert not waiting.done()  # nothing new: it waits, with no task or loop turn per event
    log.append(_chunk("r", "d"))
    log.append(_chunk("r", "e"))
    log.append(_done("r"))
    log.close("r")
    assert [e.seq for e in await waiting] == [3, 4, 5]  # published together: one list
    assert [b async for b in batches] == []  # closed and all yielded: it ends


async def test_follow_is_follow_batches_one_event_at_a_time_and_ends_after_a_closed_run():
    log = MemoryEventLog()
    log.open("r")
    log.append(_chunk("r", "a"))
    follower = log.follow("r", after=0)
    assert (await follower.__anext__()).seq == 0
    log.append(_done("r"))
    log.close("r")
    assert [e.seq async for e in follower] == [1]


async def test_a_follower_that_stops_early_leaves_nothing_waiting():
    log = MemoryEventLog()
    log.open("r")
    follower = log.follow("r", after=0)
    waiting = asyncio.ensure_future(follower.__anext__())
    await asyncio.sleep(0.01)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    await follower.aclose()
    log.append(_chunk("r", "a"))  # no follower left to wake: publishing is unaffected
    assert [e.seq for e in log.snapshot("r")] == [0]


async def _stream(stub, request) -> list[list[str]]:
    messages = []
    async for response in stub.StreamRun(request):
        events = list(response.events) if response.events else [response.event]
        messages.append([e.WhichOneof("payload") for e in events])
    return messages


async def test_stream_run_with_max_batch_sends_the_same_events_in_fewer_messages(services):
    async with services.client() as client:
        body, frames = await run_turn(
            client,
            {"say": "checking", "tool": "get_available_integrations", "input": {}},
            {"say": "one two three four five six", "chunks": 6},
        )
    caller = assistant_pb2.Caller(organization_id=services.org_id, user_id=services.user_id)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{services.orchestrator.port}") as channel:
        stub = assistant_pb2_grpc.AssistantServiceStub(channel)
        base = dict(caller=caller, chat_id=body["chat_id"], run_id=body["run_id"])
        single = await _stream(stub, assistant_pb2.StreamRunRequest(**base))
        batched = await _stream(stub, assistant_pb2.StreamRunRequest(**base, max_batch=64))
        small = await _stream(stub, assistant_pb2.StreamRunRequest(**base, max_batch=3, after=2))
    assert all(len(m) == 1 for m in single)
    flat = [t for m in single for t in m]
    assert flat == [f["type"] for f in frames if f["type"] != "heartbeat"]
    assert batched == [flat]  # an ended run: everything in one message
    assert [t for m in small for t in m] == flat[2:] and max(len(m) for m in small) <= 3


async def test_ended_runs_are_kept_in_memory_within_a_byte_budget_then_replayed_from_the_archive():
    """Kept by count only (1,000), at ~0.8-1 KB an event, a dozen long answers would hold over
    1 GB: the memory log also keeps ended runs within a byte budget, oldest out first; an
    evicted run is served from the archive."""
    from services.orchestrator.eventlog.memory import event_cost

    archive: dict[str, list[events_pb2.Event]] = {}

    async def loader(run_id: str) -> list[events_pb2.Event]:
        return archive.get(run_id, [])

    def run(run_id: str, chunks: int) -> int:
        log.open(run_id)
        for i in range(chunks):
            log.append(_chunk(run_id, f"{run_id} {i} " + "x" * 100))
        log.append(_done(run_id))
        archive[run_id] = log.owned_events(run_id) or []
        log.close(run_id)
        return sum(event_cost(e) for e in archive[run_id])

    log = MemoryEventLog(archive_loader=loader, max_runs=1000, max_bytes=700_000)
    first = run("first", 300)
    assert 200_000 < first < 350_000 and log.has("first")
    run("second", 300)
    assert log.has("first") and log.has("second")
    run("third", 300)  # past 700,000 together: the oldest goes
    assert not log.has("first") and log.has("second") and log.has("third")
    run(
        "huge", 2000
    )  # larger than the budget alone: out as soon as it ends, and the older ones with it
    assert not log.has("huge") and not log.has("second") and not log.has("third")
    replayed = [e async for e in log.follow("first", after=299)]
    assert [e.WhichOneof("payload") for e in replayed] == ["response_chunk", "done"]
    assert len([e async for e in log.follow("huge")]) == 2001


async def test_stream_run_answers_an_unexpected_error_without_its_text(services, monkeypatch):
    """StreamRun goes through the streaming RPC wrapper: an error it does not expect is a
    generic INTERNAL-style answer with the service's ErrorInfo, never the exception's text."""
    async with services.client() as client:
        body, _ = await run_turn(client, {"say": "hello"})
    events = services.orchestrator.runner.events

    def broken(*_args, **_kwargs):
        raise RuntimeError("secret /var/lib/loopline/db.sqlite")

    monkeypatch.setattr(events, "follow", broken)
    monkeypatch.setattr(events, "follow_batches", broken)
    caller = assistant_pb2.Caller(organization_id=services.org_id, user_id=services.user_id)
    request = assistant_pb2.StreamRunRequest(
        caller=caller, chat_id=body["chat_id"], run_id=body["run_id"]
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{services.orchestrator.port}") as channel:
        stub = assistant_pb2_grpc.AssistantServiceStub(channel)
        try:
            await _stream(stub, request)
        except grpc.aio.AioRpcError as error:
            failure = error
        else:
            raise AssertionError("StreamRun did not fail")
    assert "secret" not in (failure.details() or "")
    assert "RuntimeError" not in (failure.details() or "")
    assert failure.code() == grpc.StatusCode.UNKNOWN
