"""Listener fan-out: one upstream `StreamRun` per run per gateway process, shared by every listener.

Each event is rendered to its SSE frame once (`sse.encode`) and the bytes are kept in an
append-only list; every listener walks that list from its own `?after=N` index and waits
on one shared future for more. N listeners of a run therefore cost one gRPC stream and
one encoding per event instead of N of each (issue 9, stream fan-out).

Lifetime: the upstream call starts with the first listener and is validated by it (the
orchestrator sends initial metadata `x-loopline-stream` once the chat and run check out,
or fails with NOT_FOUND); it ends when the run's stream ends, or is cancelled when the
last listener leaves. A finished hub is forgotten at once, so a later listener starts a
fresh replay from the orchestrator (which has every event of the run).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import orjson

from loopline.assistant.v1 import assistant_pb2, assistant_pb2_grpc
from services.gateway import sse

log = logging.getLogger(__name__)

STREAM_READY = "x-loopline-stream"
BROKEN_FRAME = b"data: " + orjson.dumps({"type": "error", "data": {"message": "The event stream was interrupted; reconnect with ?after=N"}}) + b"\n\n"


class StreamUnavailable(Exception):
    """The orchestrator closed the stream before validating it without a status to pass on."""


class _Hub:
    __slots__ = ("key", "frames", "finished", "changed", "listeners", "task", "ready", "call")

    def __init__(self, key: tuple[str, str, str]) -> None:
        self.key = key
        self.frames: list[bytes] = []
        self.finished = False
        loop = asyncio.get_running_loop()
        self.changed: asyncio.Future[None] = loop.create_future()
        self.ready: asyncio.Future[None] = loop.create_future()
        self.ready.add_done_callback(lambda f: None if f.cancelled() else f.exception())  # mark retrieved
        self.listeners = 0
        self.task: asyncio.Task | None = None
        self.call: Any = None

    def wake(self) -> None:
        if not self.changed.done():
            self.changed.set_result(None)
        self.changed = asyncio.get_running_loop().create_future()


class RunFanout:
    """Shares upstream StreamRun calls between the listeners of a run (see the module docstring)."""

    def __init__(self, stub: assistant_pb2_grpc.AssistantServiceStub) -> None:
        self._stub = stub
        self._hubs: dict[tuple[str, str, str], _Hub] = {}

    def active_runs(self) -> int:
        """Runs with an open upstream stream (for tests and metrics)."""
        return len(self._hubs)

    async def open(self, caller: assistant_pb2.Caller, chat_id: str, run_id: str) -> _Hub:
        """Join (or start) the hub of a run; raises grpc.aio.AioRpcError (e.g. NOT_FOUND) or
        StreamUnavailable when the orchestrator refuses the stream. The caller must `leave` it."""
        key = (caller.organization_id, chat_id, run_id)
        hub = self._hubs.get(key)
        if hub is None or hub.finished:
            hub = _Hub(key)
            self._hubs[key] = hub
            hub.task = asyncio.create_task(self._pump(hub, caller), name="sse-pump")
        hub.listeners += 1
        try:
            await asyncio.shield(hub.ready)
        except BaseException:
            self.leave(hub)
            raise
        return hub

    def leave(self, hub: _Hub) -> None:
        """A listener is gone; the last one to leave a live hub cancels its upstream call."""
        hub.listeners -= 1
        if hub.listeners <= 0 and not hub.finished:
            hub.finished = True
            if hub.task is not None:
                hub.task.cancel()
            self._forget(hub)

    def _forget(self, hub: _Hub) -> None:
        if self._hubs.get(hub.key) is hub:
            del self._hubs[hub.key]

    async def _pump(self, hub: _Hub, caller: assistant_pb2.Caller) -> None:
        org_id, chat_id, run_id = hub.key
        call = self._stub.StreamRun(assistant_pb2.StreamRunRequest(caller=caller, chat_id=chat_id, run_id=run_id, after=0))
        hub.call = call
        try:
            # Ready once the orchestrator has validated the request: its initial metadata carries
            # the marker, or (when a replay sends no message at all, gRPC may fold the metadata
            # into the trailers) the first message or a clean end of the stream shows it.
            metadata = await call.initial_metadata()
            if any(key == STREAM_READY for key, _ in metadata or ()):
                _set_ready(hub)
            async for item in call:
                _set_ready(hub)
                hub.frames.append(sse.encode(item.event))
                hub.wake()
            _set_ready(hub)
        except asyncio.CancelledError:
            call.cancel()
            raise
        except grpc.aio.AioRpcError as error:
            if not hub.ready.done():
                hub.ready.set_exception(error)
            elif error.code() != grpc.StatusCode.CANCELLED:
                log.warning("run stream broke", extra={"fields": {"run_id": run_id}})
                hub.frames.append(BROKEN_FRAME)
        finally:
            if not hub.ready.done():
                hub.ready.set_exception(StreamUnavailable())
            hub.finished = True
            hub.wake()
            self._forget(hub)


def _set_ready(hub: _Hub) -> None:
    if not hub.ready.done():
        hub.ready.set_result(None)


async def frames(fanout: RunFanout, hub: _Hub, after: int, heartbeat_s: float) -> AsyncIterator[bytes]:
    """SSE frame bytes of a hub from index `after`, with a heartbeat after each `heartbeat_s` of silence.

    Ends after the hub's last frame once the run's stream has ended. Leaves the hub when the
    client goes away (the generator is closed or cancelled).
    """
    index = after
    try:
        while True:
            while index < len(hub.frames):
                yield hub.frames[index]
                index += 1
            if hub.finished:
                return
            try:
                await asyncio.wait_for(asyncio.shield(hub.changed), heartbeat_s)
            except TimeoutError:
                yield sse.HEARTBEAT_FRAME
    finally:
        fanout.leave(hub)
