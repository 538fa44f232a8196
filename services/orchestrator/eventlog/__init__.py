"""The run event log: every event of a run, replayable from any index, followed live.

`EventLog` is the interface both logs implement (the loop publishes through it, `StreamRun`
follows through it); `RunBackend` bundles the log with what the orchestrator replicas share
besides it: chat claims and cancel requests. `make_backend(settings)` picks one of two:

- memory (`memory.py`, LOOPLINE_REDIS_URL empty, the embedded default): one process. Events
  in `MemoryEventLog`, chat claims in a dict, a cancel request calls the local runner.
- Redis (`redis.py`, `redis_writer.py`, `reader.py`, LOOPLINE_REDIS_URL set): any number of
  replicas. Events in one Redis stream per run, claims and cancel flags in Redis keys.

When a run ends its events are also written to the `run_events` table (archive.py), so a
listener that comes after a restart, or after the log let the run go, still gets every event.
The class keeps the name `RunBackend`: the server, servicer and runner hold it as `.backend`,
and one concept keeps one name until those change with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from typing import Any, Protocol

from loopline.assistant.v1 import events_pb2
from services.common.errors import stream_interrupted

TERMINAL_TYPES = frozenset({"done", "cancelled", "interrupted"})

UNREACHABLE = "the event store is unreachable"

# Loads the archived events of a run (empty when none); used when a run is not in the log.
ArchiveLoader = Callable[[str], Awaitable[list[events_pb2.Event]]]

# Called by a backend when a cancel for `run_id` is received: (run_id, reason).
CancelHandler = Callable[[str, str], Coroutine[Any, Any, None]]


def event_type(event: events_pb2.Event) -> str:
    """The event's type name: the member of its payload oneof, e.g. "response_chunk"."""
    return event.WhichOneof("payload") or ""


def is_terminal(event: events_pb2.Event) -> bool:
    """True for the events after which a run's stream ends (done, cancelled, interrupted)."""
    return event_type(event) in TERMINAL_TYPES


async def flatten(
    batches: AsyncGenerator[list[events_pb2.Event], None],
) -> AsyncGenerator[events_pb2.Event, None]:
    """The events of `follow_batches` one at a time (`follow`); closes `batches` when it ends
    or its consumer stops."""
    async with contextlib.aclosing(batches):
        async for batch in batches:
            for event in batch:
                yield event


class StreamInterrupted(Exception):
    """A follower cannot go on for now (the log's store unreachable for its retry budget, or the
    run's events not to be found): `index` is the seq it would have sent next, from which a new
    follow goes on."""

    def __init__(self, index: int, why: str) -> None:
        super().__init__(why)
        self.index = index
        self.message = stream_interrupted(index, why)


class EventLog(Protocol):
    """What the loop and the servicer need from a run event log (memory or Redis Streams).

    The run's owner (the process whose loop runs it) publishes with the synchronous
    `open`/`append`/`close` (so publishing never blocks the loop); `flush` waits until
    everything published so far is stored. Any process can `follow` any run and publish
    after a run ended with `append_after_end` (cancel of a paused run, run_resumed, the
    crash reaper). Events are numbered from 0 in publication order (`Event.seq`).
    `durable` says whether published events outlive this process before they are archived.
    """

    durable: bool

    def open(self, run_id: str) -> None:
        """Start the (empty) log of a new run owned by this process."""

    def has(self, run_id: str) -> bool:
        """Whether this process holds the run's log locally."""

    def append(self, event: events_pb2.Event) -> events_pb2.Event:
        """Publish `event` (sets `seq`) on its run's log; returns it."""

    def close(self, run_id: str) -> None:
        """Mark the run's log complete (followers return after its last event)."""

    def reopen(self, run_id: str) -> None:
        """Allow appends to a closed run of this process again."""

    def snapshot(self, run_id: str) -> list[events_pb2.Event]:
        """The events of the run published or held by this process (a copy)."""

    async def flush(self, run_id: str, wait_s: float | None = None) -> None:
        """Wait until every event this process published on the run is stored (bounded; at most
        `wait_s` seconds when given)."""

    def unstored_runs(self) -> list[str]:
        """The runs of which this process holds published events the log has not stored yet (a
        durable log while its store is away): they are still this process's to write."""

    async def restore_lost(self) -> int:
        """Store again the runs of this process whose stored events the log's store lost (a
        Redis restarted empty); returns how many were found missing."""

    async def events_of(self, run_id: str) -> list[events_pb2.Event]:
        """Every stored event of the run, in order (the durable archive when the log is gone)."""

    async def append_after_end(
        self, run_id: str, *events: events_pb2.Event
    ) -> list[events_pb2.Event]:
        """Append `events` to an ended (or orphaned) run from any process, then close the log
        again."""

    def owned_events(self, run_id: str) -> list[events_pb2.Event] | None:
        """Every event this process published on a run it owns, whether the log has stored them
        yet or not; None when it does not own the run (or another process appended to it)."""

    async def purge(self, run_ids: list[str]) -> None:
        """Delete the stored events of ended runs at once (their chat was deleted permanently)."""

    def follow(self, run_id: str, after: int = 0) -> AsyncGenerator[events_pb2.Event, None]:
        """Yield the run's events from index `after`, then live ones, until the run ends (may
        raise StreamInterrupted)."""

    def follow_batches(
        self, run_id: str, after: int = 0
    ) -> AsyncGenerator[list[events_pb2.Event], None]:
        """`follow` in lists: each holds every event available when it is taken (at least one), so
        a replay or a burst is one list; the same events in the same order as `follow`."""


class RunBackend:
    """Shared state of the orchestrator replicas: the run event log, chat claims and cancel
    requests (the interface; see the module docstring).

    Attributes:
        events: the run event log.
        distributed: True when several replicas share this state (a run not active in this
            process may be running in another one).
    """

    events: EventLog
    distributed = False

    async def start(self, on_cancel: CancelHandler) -> None:
        """Begin delivering cancel requests for runs of this process to `on_cancel`."""
        raise NotImplementedError

    async def close(self) -> None:
        """Stop background tasks and close connections (pending event writes are flushed first)."""
        raise NotImplementedError

    async def try_claim(self, chat_id: str) -> str | None:
        """Take the chat's start/resume/delete claim; returns a token, or None when it is held.

        Atomic across replicas; a claim expires after `claim_ttl_s` seconds if never released.
        """
        raise NotImplementedError

    async def release_claim(self, chat_id: str, token: str) -> None:
        """Release a claim taken with `token` (one that expired and was taken again is left)."""
        raise NotImplementedError

    async def request_cancel(self, run_id: str, reason: str) -> None:
        """Ask whichever replica runs `run_id` to cancel it with `reason`."""
        raise NotImplementedError

    async def pending_cancels(self, run_ids: list[str]) -> dict[str, str]:
        """The cancel requests recorded for `run_ids`: {run_id: reason} (polled by the runner)."""
        raise NotImplementedError


def make_backend(settings: Any, archive_loader: ArchiveLoader) -> RunBackend:
    """`RedisBackend` when `settings.redis_url` is set, else `MemoryBackend` (each imported
    here: the package's interface loads before either)."""
    if settings.redis_url:
        from services.orchestrator.eventlog.redis import RedisBackend

        return RedisBackend(
            settings.redis_url,
            settings.redis_key_prefix,
            archive_loader,
            max_len=settings.run_events_max_len,
            ttl_s=settings.run_events_ttl_s,
            claim_ttl_s=settings.chat_claim_ttl_s,
            retry_s=settings.redis_retry_s,
            max_connections=settings.redis_max_connections,
            readers=settings.redis_readers,
        )
    from services.orchestrator.eventlog.memory import MemoryBackend

    return MemoryBackend(
        archive_loader=archive_loader,
        max_runs=settings.event_log_max_runs,
        max_bytes=settings.event_log_max_bytes,
    )
