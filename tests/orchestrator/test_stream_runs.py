"""StreamRuns: many runs' streams over one call, each the same as its own StreamRun."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2

from loopline.assistant.v1 import assistant_pb2, assistant_pb2_grpc
from services.common.errors import RpcError
from services.orchestrator.eventlog.memory import MemoryEventLog
from services.orchestrator.servicer.run_streams import RunStreams
from tests.orchestrator.helpers import run_turn, start
from tests.orchestrator.test_stream_batches import _chunk, _done


def _follow(stream_id: int, caller: Any, body: dict[str, Any], after: int = 0) -> Any:
    run = assistant_pb2.StreamRunRequest(
        caller=caller, chat_id=body["chat_id"], run_id=body["run_id"], after=after
    )
    return assistant_pb2.StreamRunsRequest(stream_id=stream_id, follow=run)


class Requests:
    """A StreamRuns request stream the test feeds (`send`) and closes (`close`)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    def send(self, request: Any) -> None:
        self.queue.put_nowait(request)

    def close(self) -> None:
        self.queue.put_nowait(None)

    async def __aiter__(self) -> AsyncIterator[Any]:
        while (request := await self.queue.get()) is not None:
            yield request


def _reason(entry: Any) -> tuple[int, str]:
    status = status_pb2.Status.FromString(entry.end_status)
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    return status.code, info.reason


async def _collect(call: Any) -> tuple[list[Any], dict[int, list[Any]]]:
    """(the call's messages, each stream's entries in order)."""
    messages: list[Any] = []
    entries: dict[int, list[Any]] = {}
    async for response in call:
        messages.append(response)
        for entry in response.runs:
            entries.setdefault(entry.stream_id, []).append(entry)
    return messages, entries


def _payloads(entries: list[Any]) -> list[str]:
    return [e.WhichOneof("payload") for entry in entries for e in entry.events]


async def test_each_followed_run_gets_its_own_stream_ended_like_stream_run(services):
    async with services.client() as client:
        first, frames = await run_turn(client, {"say": "one two three", "chunks": 3})
        second, _ = await run_turn(client, {"say": "four five", "chunks": 2})
    caller = assistant_pb2.Caller(organization_id=services.org_id, user_id=services.user_id)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{services.orchestrator.port}") as channel:
        stub = assistant_pb2_grpc.AssistantServiceStub(channel)
        requests = Requests()
        for request in (
            _follow(1, caller, first),
            _follow(2, caller, second, after=2),
            _follow(3, caller, {**first, "run_id": "00000000-0000-0000-0000-000000000000"}),
            _follow(4, caller, first, after=-1),
        ):
            requests.send(request)
        requests.close()  # the call ends once the four streams have
        _, entries = await _collect(stub.StreamRuns(aiter(requests)))
        alone = [r async for r in stub.StreamRun(_follow(0, caller, second, 2).follow)]
    expected = [f["type"] for f in frames if f["type"] != "heartbeat"]
    assert _payloads(entries[1]) == expected
    assert _payloads(entries[2]) == [r.event.WhichOneof("payload") for r in alone]
    for stream_id in (1, 2):
        assert entries[stream_id][0].accepted and entries[stream_id][-1].ended
        assert entries[stream_id][-1].end_status == b""  # OK
    assert not entries[3][0].accepted and entries[3][-1].ended
    assert _reason(entries[3][-1]) == (grpc.StatusCode.NOT_FOUND.value[0], "RUN_NOT_FOUND")
    assert _reason(entries[4][-1]) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], "INVALID_AFTER")


async def test_a_live_run_streams_as_it_goes_and_a_stopped_stream_sends_nothing_more(services):
    async with services.client() as client:
        live = await start(client, {"say": "a b c d e f", "chunks": 6, "chunk_ms": 150})
        ended, _ = await run_turn(client, {"say": "done already"})
        caller = assistant_pb2.Caller(organization_id=services.org_id, user_id=services.user_id)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{services.orchestrator.port}") as channel:
            stub = assistant_pb2_grpc.AssistantServiceStub(channel)
            requests = Requests()
            requests.send(_follow(7, caller, live))
            requests.send(_follow(8, caller, live))
            call = stub.StreamRuns(aiter(requests))
            seen: dict[int, list[Any]] = {7: [], 8: []}
            async for response in call:
                for entry in response.runs:
                    seen[entry.stream_id].append(entry)
                if any(e.WhichOneof("payload") == "response_chunk" for e in _events(seen[8])):
                    break
            requests.send(assistant_pb2.StreamRunsRequest(stream_id=8, stop=True))
            requests.send(_follow(9, caller, ended))  # a later follow on the same call
            requests.close()
            async for response in call:
                for entry in response.runs:
                    seen.setdefault(entry.stream_id, []).append(entry)
    assert _events(seen[7])[-1].WhichOneof("payload") == "done" and seen[7][-1].ended
    assert not any(entry.ended for entry in seen[8])  # stopped: neither its rest nor its end
    assert len(_events(seen[8])) < len(_events(seen[7]))
    assert _events(seen[9])[-1].WhichOneof("payload") == "done"


def _events(entries: list[Any]) -> list[Any]:
    return [e for entry in entries for e in entry.events]


async def test_a_request_that_follows_nothing_or_reuses_an_id_ends_the_call(services):
    async with services.client() as client:
        live = await start(client, {"say": "slow", "sleep_ms": 2000})
    caller = assistant_pb2.Caller(organization_id=services.org_id, user_id=services.user_id)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{services.orchestrator.port}") as channel:
        stub = assistant_pb2_grpc.AssistantServiceStub(channel)
        for bad, reason in (
            ([assistant_pb2.StreamRunsRequest(stream_id=1)], "INVALID_REQUEST"),
            ([_follow(1, caller, live), _follow(1, caller, live)], "STREAM_ID_IN_USE"),
        ):
            requests = Requests()
            for request in bad:
                requests.send(request)
            call = stub.StreamRuns(aiter(requests))
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as error:
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert reason in str(error.trailing_metadata())
            else:
                raise AssertionError("the call should have failed")


async def test_what_several_runs_have_at_once_goes_in_one_message_and_one_alone_at_once():
    log = MemoryEventLog()
    for run_id in ("r1", "r2"):
        log.open(run_id)
        log.append(_chunk(run_id, "a"))

    async def accept(_: Any) -> None:
        return None

    requests = Requests()
    for stream_id, run_id in ((1, "r1"), (2, "r2")):
        run = assistant_pb2.StreamRunRequest(run_id=run_id)
        requests.send(assistant_pb2.StreamRunsRequest(stream_id=stream_id, follow=run))
    out = RunStreams(accept, log).serve(aiter(requests))
    first = await anext(out)
    assert [(e.stream_id, e.accepted, len(e.events)) for e in first.runs] == [
        (1, True, 1),
        (2, True, 1),
    ]
    log.append(_chunk("r2", "b"))  # one run's event alone: a message of its own, at once
    alone = await asyncio.wait_for(anext(out), 1)
    assert [(e.stream_id, [x.response_chunk.chunk for x in e.events]) for e in alone.runs] == [
        (2, ["b"])
    ]
    for run_id in ("r1", "r2"):
        log.append(_done(run_id))
        log.close(run_id)
    requests.close()
    rest = [response async for response in out]  # both ended and the client closed: it ends
    ends = [(e.stream_id, e.ended) for r in rest for e in r.runs if e.ended]
    assert sorted(ends) == [(1, True), (2, True)]


async def test_a_run_with_large_events_is_cut_into_messages_a_default_client_can_receive():
    # a replay of 6 MB (each event 1 MB) in one message would exceed gRPC's default 4 MiB receive
    # limit: the client's call would fail (RESOURCE_EXHAUSTED) for every run it follows
    log = MemoryEventLog()
    log.open("big")
    for text in "abcdef":
        log.append(_chunk("big", text * 1_000_000))
    log.append(_done("big"))
    log.close("big")
    log.open("small")
    log.append(_chunk("small", "x"))
    log.append(_done("small"))
    log.close("small")

    async def accept(_: Any) -> None:
        return None

    requests = Requests()
    for stream_id, run_id in ((1, "big"), (2, "small")):
        run = assistant_pb2.StreamRunRequest(run_id=run_id)
        requests.send(assistant_pb2.StreamRunsRequest(stream_id=stream_id, follow=run))
    requests.close()
    messages = [response async for response in RunStreams(accept, log).serve(aiter(requests))]
    assert max(message.ByteSize() for message in messages) < 4 * 1024 * 1024
    entries: dict[int, list[Any]] = {}
    for message in messages:
        for entry in message.runs:
            entries.setdefault(entry.stream_id, []).append(entry)
    for stream_id, run_id in ((1, "big"), (2, "small")):
        assert _events(entries[stream_id]) == log.snapshot(run_id)
        assert entries[stream_id][-1].ended


async def test_an_id_whose_end_is_not_sent_yet_cannot_be_followed_again():
    log = MemoryEventLog()
    log.open("r")
    log.append(_done("r"))
    log.close("r")

    async def accept(_: Any) -> None:
        return None

    requests = Requests()
    follow = assistant_pb2.StreamRunsRequest(
        stream_id=5, follow=assistant_pb2.StreamRunRequest(run_id="r")
    )
    requests.send(follow)
    streams = RunStreams(accept, log)
    out = streams.serve(aiter(requests))
    first = await anext(out)  # its events; its end waits in the outbox until this is sent
    assert first.runs[0].stream_id == 5
    requests.send(follow)  # the same id again, without a stop
    try:
        async for response in out:
            assert all(not e.accepted for e in response.runs)  # never a second stream 5
    except RpcError as error:
        assert error.reason == "STREAM_ID_IN_USE"
    else:
        raise AssertionError("the call should have failed")
