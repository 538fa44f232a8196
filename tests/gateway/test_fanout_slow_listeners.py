"""Listeners that stop reading or leave, and a gateway that stops with listeners open.

Rules: a listener whose client stops reading does not hold up the others (it is served through
ASGI send with flow control instead of direct writes) and holds one slice, not a copy of the
run; one that takes nothing for STALLED_SEND_S has its connection closed; a client that leaves
mid-send ends its response without an error; a stopped gateway ends each open stream at once
with its reconnect frame and closes the listeners that cannot take it.
"""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any

from loopline.assistant.v1 import assistant_pb2
from services.gateway import fanout as fanout_module
from services.gateway import listener as listener_module
from services.gateway import sse
from services.gateway.fanout import RunFanout
from services.gateway.listener import Listener
from tests.gateway.fanout_fakes import (
    AsgiClient,
    FakeStub,
    chunk_event,
    done_event,
    listen,
    until,
)


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


class SlowClient(AsgiClient):
    """An ASGI client whose sends wait until `release` is set (a client that stopped reading);
    `sent` keeps the size of each body handed to it."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.sent: list[int] = []

    async def send(self, message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.body":
            self.sent.append(len(message.get("body", b"")))
            await self.release.wait()
        await super().send(message)


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
    assert stuck.writer is not None and not stuck.transport.written, (  # type: ignore[union-attr]
        "the stuck client goes through ASGI send"
    )
    stuck.writer.cancel()
    hub.detach(stuck)
    hub.detach(reader)
    fan.leave(hub)
    fan.leave(hub)
    await until(lambda: stub.calls[0].cancelled)
    assert fan.active_runs() == 0


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
