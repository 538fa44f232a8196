"""StreamRun batching (StreamRunRequest.max_batch): the same events, fewer messages."""

from __future__ import annotations

import asyncio

import grpc

from loopline.assistant.v1 import assistant_pb2, assistant_pb2_grpc
from services.orchestrator.service import ready_batches
from tests.orchestrator.helpers import run_turn


async def _source(gate: asyncio.Event, log: list[str]):
    try:
        for item in (1, 2, 3):
            yield item
        await gate.wait()
        for item in (4, 5):
            yield item
    finally:
        log.append("closed")


async def test_ready_batches_groups_what_is_ready_and_respects_the_limit():
    gate, log = asyncio.Event(), []
    batches = ready_batches(_source(gate, log), limit=2)
    assert await batches.__anext__() == [1, 2]
    assert await batches.__anext__() == [3]  # 4 is not ready: the batch ends
    gate.set()
    assert [b async for b in batches] == [[4, 5]]
    assert log == ["closed"]


async def test_ready_batches_closes_the_source_when_the_consumer_stops():
    gate, log = asyncio.Event(), []
    batches = ready_batches(_source(gate, log), limit=10)
    assert await batches.__anext__() == [1, 2, 3]
    waiting = asyncio.ensure_future(batches.__anext__())  # blocks on the gate
    await asyncio.sleep(0.01)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert log == ["closed"]


async def _stream(stub, request) -> list[list[str]]:
    messages = []
    async for response in stub.StreamRun(request):
        events = list(response.events) if response.events else [response.event]
        messages.append([e.WhichOneof("payload") for e in events])
    return messages


async def test_stream_run_with_max_batch_sends_the_same_events_in_fewer_messages(stack):
    async with stack.client() as client:
        body, frames = await run_turn(client, {"say": "checking", "tool": "get_available_integrations", "input": {}},
                                      {"say": "one two three four five six", "chunks": 6})
    caller = assistant_pb2.Caller(organization_id=stack.org_id, user_id=stack.user_id)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.orchestrator.port}") as channel:
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
