"""The in-memory run event log and run backend: one process, the embedded default.

`MemoryEventLog` keeps one list per run and one asyncio.Future per run that wakes every
follower at each append (so N listeners cost N awaits, not N queues). `MemoryBackend` adds chat
claims in a dict and cancel requests delivered to the local runner.
"""

from __future__ import annotations

import asyncio
import collections
import secrets
from collections.abc import AsyncGenerator

from loopline.assistant.v1 import events_pb2
from services.orchestrator.eventlog import ArchiveLoader, CancelHandler, RunBackend, flatten


class _RunLog:
    """One run's events, whether it ended, and the future its waiting followers share."""

    __slots__ = ("events", "closed", "changed")

    def __init__(self) -> None:
        self.events: list[events_pb2.Event] = []
        self.closed = False
        self.changed: asyncio.Future[None] | None = None  # made by the first follower that waits

    def wake(self) -> None:
        """Wake every waiting follower (an append or the close); nothing to do when none waits."""
        if self.changed is not None:
            if not self.changed.done():
                self.changed.set_result(None)
            self.changed = None

    def waiter(self) -> asyncio.Future[None]:
        """A future done at the next `wake` (shared by every follower waiting now)."""
        if self.changed is None:
            self.changed = asyncio.get_running_loop().create_future()
        return self.changed


# the memory of one event object beyond its encoded size (measured: ~920 B for a 106-byte chunk)
EVENT_OVERHEAD_BYTES = 800


def event_cost(event: events_pb2.Event) -> int:
    """About how much memory `event` takes in the log: its encoded size plus the object's."""
    return event.ByteSize() + EVENT_OVERHEAD_BYTES


class MemoryEventLog:
    """In-process event log of runs.

    `append` numbers events from 0 (`Event.seq`). `follow(run_id, after)` yields the
    events with seq >= after, then new ones as they come, and returns after a terminal
    event or when the run is closed. Ended runs are kept up to `max_runs` and up to about
    `max_bytes` of memory together (`event_cost`; the oldest are evicted first, and a run larger
    than `max_bytes` alone as soon as it ends): an evicted run is replayed from the archive.
    Counting runs only, 1,000 long answers held ~3 GB (~0.8-1 KB per event). Not `durable`:
    the events die with the process (the runner archives a run's stream with its end, in one
    transaction, before it publishes the end).
    """

    durable = False

    def __init__(
        self,
        archive_loader: ArchiveLoader | None = None,
        max_runs: int = 10_000,
        max_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self._runs: dict[str, _RunLog] = {}
        self._ended: collections.OrderedDict[str, int] = collections.OrderedDict()  # -> cost
        self._ended_bytes = 0
        self._archive_loader = archive_loader
        self._max_runs = max_runs
        self._max_bytes = max_bytes

    def open(self, run_id: str) -> None:
        """Create the (empty) log of a new run; a second call is a no-op."""
        if run_id not in self._runs:
            self._runs[run_id] = _RunLog()

    def has(self, run_id: str) -> bool:
        """Whether the run's log is in memory."""
        return run_id in self._runs

    def append(self, event: events_pb2.Event) -> events_pb2.Event:
        """Append `event` to its run's log, setting `seq`; wakes every follower; returns it."""
        log = self._runs.get(event.run_id)
        if log is None:
            self.open(event.run_id)
            log = self._runs[event.run_id]
        if log.closed:
            raise RuntimeError(f"run {event.run_id} is closed")
        event.seq = len(log.events)
        log.events.append(event)
        log.wake()
        return event

    def close(self, run_id: str) -> None:
        """Mark the run's log complete: followers return after the last event."""
        log = self._runs.get(run_id)
        if log is None or log.closed:
            return
        log.closed = True
        log.wake()
        cost = sum(event_cost(event) for event in log.events)
        self._ended[run_id] = cost
        self._ended_bytes += cost
        while self._ended and (
            len(self._ended) > self._max_runs or self._ended_bytes > self._max_bytes
        ):
            old, old_cost = self._ended.popitem(last=False)
            self._ended_bytes -= old_cost
            self._runs.pop(old, None)

    def _forget_ended(self, run_id: str) -> None:
        self._ended_bytes -= self._ended.pop(run_id, 0)

    def owned_events(self, run_id: str) -> list[events_pb2.Event] | None:
        """The run's events in memory (a copy), or None when it is not in memory."""
        log = self._runs.get(run_id)
        return list(log.events) if log is not None else None

    async def purge(self, run_ids: list[str]) -> None:
        """Drop the logs of ended runs (a permanently deleted chat's); a run still open is kept."""
        for run_id in run_ids:
            log = self._runs.get(run_id)
            if log is not None and log.closed:
                del self._runs[run_id]
                self._forget_ended(run_id)

    def reopen(self, run_id: str) -> None:
        """Allow appends to a closed run again (used to publish run_resumed on a paused run)."""
        log = self._runs.get(run_id)
        if log is not None and log.closed:
            log.closed = False
            self._forget_ended(run_id)

    def snapshot(self, run_id: str) -> list[events_pb2.Event]:
        """The run's events in memory so far (a copy)."""
        log = self._runs.get(run_id)
        return list(log.events) if log else []

    async def flush(self, run_id: str, wait_s: float | None = None) -> None:
        """Nothing to wait for: appends are stored at once."""

    def unstored_runs(self) -> list[str]:
        """None: appends are stored at once."""
        return []

    async def restore_lost(self) -> int:
        """Nothing is lost: the log lives and dies with this process."""
        return 0

    async def events_of(self, run_id: str) -> list[events_pb2.Event]:
        """The run's events in memory, or its archived events when it is not in memory."""
        if run_id in self._runs:
            return self.snapshot(run_id)
        return await self._archive_loader(run_id) if self._archive_loader else []

    async def append_after_end(
        self, run_id: str, *events: events_pb2.Event
    ) -> list[events_pb2.Event]:
        """Reload the run from the archive when it fell out of memory, append `events`, close it
        again."""
        if run_id not in self._runs:
            archived = await self._archive_loader(run_id) if self._archive_loader else []
            if run_id not in self._runs:  # no other append restored it meanwhile
                self.open(run_id)
                for stored in archived:
                    self.append(stored)
        self.reopen(run_id)
        appended = [self.append(event) for event in events]
        self.close(run_id)
        return appended

    def follow(self, run_id: str, after: int = 0) -> AsyncGenerator[events_pb2.Event, None]:
        """Yield the run's events from index `after`, then live ones, until it ends (see
        `follow_batches`)."""
        return flatten(self.follow_batches(run_id, after))

    async def follow_batches(
        self, run_id: str, after: int = 0
    ) -> AsyncGenerator[list[events_pb2.Event], None]:
        """Yield the run's events from index `after` as lists of every event published and not yet
        yielded (a slice of the log: no task or loop turn per event), until the run is closed and
        all is yielded. A run not in memory is served from the archive (one list, then return).
        """
        log = self._runs.get(run_id)
        if log is None:
            archived = await self._archive_loader(run_id) if self._archive_loader else []
            batch = archived[after:]
            if batch:
                yield batch
            return
        index = max(after, 0)
        while True:
            if index < len(log.events):
                batch = log.events[index:]
                index += len(batch)
                yield batch
                continue
            if log.closed:
                return
            await asyncio.shield(log.waiter())


class MemoryBackend(RunBackend):
    """One process: `MemoryEventLog`, a set of claimed chats, cancels delivered in-process."""

    def __init__(
        self,
        archive_loader: ArchiveLoader | None = None,
        max_runs: int = 10_000,
        max_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self.events = MemoryEventLog(
            archive_loader=archive_loader, max_runs=max_runs, max_bytes=max_bytes
        )
        self._claims: dict[str, str] = {}
        self._on_cancel: CancelHandler | None = None

    async def start(self, on_cancel: CancelHandler) -> None:
        """Remember the handler; `request_cancel` calls it directly."""
        self._on_cancel = on_cancel

    async def close(self) -> None:
        """Nothing to close."""

    async def try_claim(self, chat_id: str) -> str | None:
        """Claim `chat_id` in this process (no TTL needed: the claim dies with the process)."""
        if chat_id in self._claims:
            return None
        token = secrets.token_hex(8)
        self._claims[chat_id] = token
        return token

    async def release_claim(self, chat_id: str, token: str) -> None:
        """Drop the claim when `token` still holds it."""
        if self._claims.get(chat_id) == token:
            del self._claims[chat_id]

    async def request_cancel(self, run_id: str, reason: str) -> None:
        """Cancel the run of this process (the only process)."""
        if self._on_cancel is not None:
            await self._on_cancel(run_id, reason)

    async def pending_cancels(self, run_ids: list[str]) -> dict[str, str]:
        """Always empty: in-process cancels are delivered at once."""
        return {}
