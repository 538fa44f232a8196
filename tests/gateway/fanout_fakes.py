"""Fakes for the gateway's listener fan-out tests (services/gateway/fanout.py, listener.py): an
orchestrator StreamRun call fed by the test, the ASGI side of one response, and `listen`, which
opens a listener on a RunFanout the way the listen route does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, MutableMapping
from typing import Any

from loopline.assistant.v1 import assistant_pb2, events_pb2
from services.gateway import fanout as fanout_module
from services.gateway.fanout import RunFanout
from services.gateway.listener import EventStreamResponse


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

    async def send(self, message: MutableMapping[str, Any]) -> None:
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


async def until(predicate: Callable[[], object], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)
