"""StreamRuns: the event streams of many runs over one call.

A follower task per followed run checks the request as StreamRun does, reads the run's events
(`EventLog.follow_batches`) and hands each batch to the call's outbox; the call writes what the
outbox holds as one message. So the events of many runs ready at once share a message (and a
wake-up of both processes), and an event that comes alone goes out alone, at once. A follower
hands over its next batch only once the outbox has given up the last: a client that reads
slowly holds its runs back, as flow control holds a StreamRun, and nothing piles up here. One
message carries at most MAX_MESSAGE_BYTES of events when several runs have some, and a run's
entry at most MAX_RUN_BATCH events and MAX_MESSAGE_BYTES (`pieces`; a larger event goes alone).

The call ends once the client has closed its side and every followed run has ended; when the
client goes away, every follower is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator

import grpc

from loopline.assistant.v1 import assistant_pb2, events_pb2
from services.common.errors import ASSISTANT_DOMAIN, RpcError, error_answer
from services.orchestrator.eventlog import EventLog, StreamInterrupted

MAX_RUN_BATCH = 256  # events of one run per message at most, here and in StreamRun
MAX_MESSAGE_BYTES = 1 << 20  # a message stops taking runs past this (it always takes one)

Refusal = Callable[[assistant_pb2.StreamRunRequest], Awaitable[RpcError | None]]


def pieces(
    batch: list[events_pb2.Event], limit: int = MAX_RUN_BATCH
) -> Iterator[list[events_pb2.Event]]:
    """`batch` cut in order into lists of at most `limit` events and MAX_MESSAGE_BYTES (an event
    larger than that alone): a run's events in one message stay within a client's receive limit
    whenever each event does (gRPC's default is 4 MiB)."""
    piece: list[events_pb2.Event] = []
    size = 0
    for event in batch:
        event_size = event.ByteSize()
        if piece and (len(piece) >= limit or size + event_size > MAX_MESSAGE_BYTES):
            yield piece
            piece, size = [], 0
        piece.append(event)
        size += event_size
    if piece:
        yield piece


class RunStreams:
    """One StreamRuns call: its followers, its outbox and the loop that writes it (`serve`)."""

    def __init__(self, refusal: Refusal, events: EventLog) -> None:
        self._refusal = refusal  # StreamRun's check of a request (Streams._refusal)
        self._events = events
        self._followers: dict[int, asyncio.Task[None]] = {}
        self._outbox: dict[int, assistant_pb2.RunStreamEvents] = {}
        self._taken: dict[int, asyncio.Event] = {}  # per follower: its last batch left the outbox
        self._wake = asyncio.Event()

    async def serve(
        self, requests: AsyncIterator[assistant_pb2.StreamRunsRequest]
    ) -> AsyncGenerator[assistant_pb2.StreamRunsResponse, None]:
        """The call's messages, until the client's side is closed and every run has ended."""
        reader = asyncio.create_task(self._read(requests), name="stream-runs-reader")
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if reader.done() and not reader.cancelled() and reader.exception() is not None:
                    raise reader.exception()  # type: ignore[misc]
                while self._outbox:
                    yield self._take()
                if reader.done() and not self._followers and not self._outbox:
                    return
        finally:
            tasks = [reader, *self._followers.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _read(self, requests: AsyncIterator[assistant_pb2.StreamRunsRequest]) -> None:
        try:
            async for request in requests:
                stream_id = request.stream_id
                if request.stop:
                    follower = self._followers.pop(stream_id, None)
                    if follower is not None:
                        follower.cancel()
                    self._outbox.pop(stream_id, None)
                elif not request.HasField("follow"):
                    raise RpcError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        "INVALID_REQUEST",
                        "a request must follow a run or stop following one",
                    )
                elif stream_id in self._followers or stream_id in self._outbox:
                    # followed, or its end not sent yet
                    raise RpcError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        "STREAM_ID_IN_USE",
                        f"stream {stream_id} is already followed in this call",
                    )
                else:
                    self._followers[stream_id] = asyncio.create_task(
                        self._follow(stream_id, request.follow), name="stream-runs-follower"
                    )
        finally:
            self._wake.set()

    async def _follow(self, stream_id: int, request: assistant_pb2.StreamRunRequest) -> None:
        """Check `request`, then hand the run's events to the outbox, then its end."""
        taken = self._taken[stream_id] = asyncio.Event()
        try:
            refusal = await self._refusal(request)
            if refusal is not None:
                self._end(stream_id, refusal)
                return
            self._put(stream_id, accepted=True)
            batches = self._events.follow_batches(request.run_id, int(request.after))
            async with contextlib.aclosing(batches):
                async for batch in batches:
                    for piece in pieces(batch):
                        taken.clear()
                        self._put(stream_id, events=piece)
                        await taken.wait()
            self._end(stream_id, None)
        except StreamInterrupted as interrupted:
            status = grpc.StatusCode.UNAVAILABLE
            self._end(stream_id, RpcError(status, "STREAM_INTERRUPTED", interrupted.message))
        except Exception as error:  # the answer StreamRun's wrapper would give (never its text)
            self._end(stream_id, error_answer(error, "StreamRuns", None, ASSISTANT_DOMAIN))
        finally:
            if self._followers.get(stream_id) is asyncio.current_task():
                del self._followers[stream_id]
            self._taken.pop(stream_id, None)
            self._wake.set()

    def _entry(self, stream_id: int) -> assistant_pb2.RunStreamEvents:
        """The outbox entry of `stream_id` (made when it has none); the writer is woken."""
        self._wake.set()
        entry = self._outbox.get(stream_id)
        if entry is None:
            entry = self._outbox[stream_id] = assistant_pb2.RunStreamEvents(stream_id=stream_id)
        return entry

    def _put(
        self, stream_id: int, events: list[events_pb2.Event] | None = None, accepted: bool = False
    ) -> None:
        """Add events, or the acceptance, to the outbox entry of `stream_id`."""
        entry = self._entry(stream_id)
        if events:
            entry.events.extend(events)
        if accepted:
            entry.accepted = True

    def _end(self, stream_id: int, error: RpcError | None) -> None:
        """Mark the stream's end in its outbox entry: `error`'s status, or OK when None."""
        entry = self._entry(stream_id)
        entry.ended = True
        if error is not None:
            entry.end_status = error.to_proto().SerializeToString()

    def _take(self) -> assistant_pb2.StreamRunsResponse:
        """A message of the outbox's entries, oldest first, up to MAX_MESSAGE_BYTES."""
        response = assistant_pb2.StreamRunsResponse()
        size = 0
        for stream_id in list(self._outbox):
            entry = self._outbox[stream_id]
            size += entry.ByteSize()
            if size > MAX_MESSAGE_BYTES and response.runs:
                break
            del self._outbox[stream_id]
            response.runs.append(entry)
            taken = self._taken.get(stream_id)
            if taken is not None:
                taken.set()
        return response
