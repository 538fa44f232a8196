"""The orchestrator's shared-state backend: run events, chat claims and cancel requests.

Two implementations of one seam (`RunBackend`), picked by `make_backend(settings)`:

- `MemoryBackend` (LOOPLINE_REDIS_URL empty, the embedded default): one process. Run
  events in `MemoryEventLog`, chat claims in a set, a cancel request calls the local
  runner directly.
- `RedisBackend` (LOOPLINE_REDIS_URL set): any number of orchestrator replicas.
  * Run events in Redis Streams, one stream per run (`<prefix>run:<run_id>:events`).
    The entry id of event `seq` is `0-<seq+1>`, so stream order is seq order, a follower
    resumes with `XREAD BLOCK` from `0-<index>`, and a retried write cannot duplicate an
    event. Each entry holds the serialized `loopline.assistant.v1.Event` (field `e`).
    Streams are capped with `XADD MAXLEN ~ run_events_max_len` and expire
    `run_events_ttl_s` seconds after the run ends. The owner writes what is queued for a run
    in one atomic `EVALSHA` (`_BATCH`: open, events, close in order), serves followers in its
    own process from its copy as soon as each event is stored (no Redis read), and archives
    from that copy. The orchestrator database keeps the
    durable copy (`run_events`, written by `TurnRunner.archive` at run end), which serves
    listeners once the stream is gone. A hash `<prefix>run:<run_id>:meta` holds `next`
    (the next seq) and `closed` ("1" once the run ended).
  * Chat claims: `SET <prefix>claim:<chat_id> <token> NX PX claim_ttl_ms`, released by a
    compare-and-delete script; the TTL frees the chat if the holder crashed.
  * Cancel requests: `SET <prefix>cancel:<run_id> <reason> EX 300` plus `PUBLISH
    <prefix>cancels "<run_id>\\n<reason>"`. Every replica subscribes and cancels its own
    run at once; the flags of active runs are also polled every `cancel_poll_s` (1 s), so a
    lost message still stops the run within a second.

Redis errors while publishing are retried with backoff (`redis_retry_s` in total); a
follower that cannot reach Redis for that long raises StreamInterrupted (so a listener
never hangs), and otherwise resumes at the index it reached (no gaps, no duplicates).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from loopline.assistant.v1 import events_pb2
from services.common import db
from services.common.errors import stream_interrupted
from services.orchestrator.events import (
    ArchiveLoader,
    EventLog,
    MemoryEventLog,
    flatten,
    is_terminal,
)

log = logging.getLogger(__name__)

# Called by a backend when a cancel for `run_id` is received: (run_id, reason).
CancelHandler = Callable[[str, str], Awaitable[None]]

XREAD_BLOCK_MS = 2000  # RedisEventLog's default wait of one XREAD BLOCK

CANCEL_FLAG_TTL_S = 300

UNREACHABLE = "the event store is unreachable"


class RunBackend:
    """Shared state of the orchestrator replicas (the interface; see the module docstring).

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
        """Release a claim taken with `token` (a claim that expired and was re-taken is left alone)."""
        raise NotImplementedError

    async def request_cancel(self, run_id: str, reason: str) -> None:
        """Ask whichever replica runs `run_id` to cancel it with `reason`."""
        raise NotImplementedError

    async def pending_cancels(self, run_ids: list[str]) -> dict[str, str]:
        """The cancel requests recorded for `run_ids`: {run_id: reason} (polled by the runner)."""
        raise NotImplementedError


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


# ---------------------------------------------------------------------------- Redis

# KEYS: stream, meta. ARGV[1]: maxlen, ARGV[2]: ttl ms after the end, ARGV[3]: how many of the
# writer's events the stream already holds (-1: unknown); when that is more than 0 and the run's
# meta is gone (Redis restarted empty, or the keys were deleted), nothing is written and the call
# returns {"lost"}: the writer then writes its whole copy again first. Then one triple per
# operation, applied in order in one atomic call: (op, seq, payload) with op "e" (append the
# event `payload` as seq, -1 meaning the next one; an entry already stored at that seq is
# left as it is, and nothing is appended to a closed run: a writer whose run another replica
# ended meanwhile, `append_after_end`, is fenced off), "o" (mark the run open) or "c" (mark it
# closed; the stream and meta then expire after the ttl). Returns one number per "e": the seq
# the event is stored at (also when that seq already held this very payload: a retried write
# whose reply was lost), or -1 - seq when it was refused (another writer's entry holds that
# seq, or the run is closed).
_BATCH = """
local maxlen, ttl = ARGV[1], ARGV[2]
local nxt = redis.call('HGET', KEYS[2], 'next')
nxt = nxt and tonumber(nxt) or -1
if nxt < 0 and tonumber(ARGV[3]) > 0 then return {'lost'} end
local closed = redis.call('HGET', KEYS[2], 'closed') == '1'
local results = {}
for i = 4, #ARGV, 3 do
  local op = ARGV[i]
  if op == 'e' then
    local seq = tonumber(ARGV[i + 1])
    if nxt < 0 then nxt = 0 end
    if seq < 0 then seq = nxt end
    if seq < nxt then
      local stored = redis.call('XRANGE', KEYS[1], '0-' .. (seq + 1), '0-' .. (seq + 1))
      if stored[1] == nil or stored[1][2][2] == ARGV[i + 2] then
        results[#results + 1] = seq
      else
        results[#results + 1] = -1 - seq
      end
    elseif closed then
      results[#results + 1] = -1 - seq
    else
      redis.call('XADD', KEYS[1], 'MAXLEN', '~', maxlen, '0-' .. (seq + 1), 'e', ARGV[i + 2])
      nxt = seq + 1
      redis.call('HSET', KEYS[2], 'next', nxt, 'closed', '0')
      redis.call('PERSIST', KEYS[1])
      redis.call('PERSIST', KEYS[2])
      results[#results + 1] = seq
    end
  elseif op == 'o' then
    if nxt < 0 then nxt = 0 end
    closed = false
    redis.call('HSET', KEYS[2], 'next', nxt, 'closed', '0')
    redis.call('PERSIST', KEYS[2])
  else
    if nxt < 0 then nxt = 0 end
    closed = true
    redis.call('HSET', KEYS[2], 'next', nxt, 'closed', '1')
    redis.call('PEXPIRE', KEYS[2], ttl)
    if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('PEXPIRE', KEYS[1], ttl) end
  end
end
return results
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class StreamLost(Exception):
    """Redis no longer holds the stream of a run this process writes (restarted empty)."""


class StreamInterrupted(Exception):
    """A follower cannot go on for now (Redis unreachable for `retry_s`, or the run's events
    not to be found): `index` is the seq it would have sent next, from which a new follow goes on."""

    def __init__(self, index: int, why: str) -> None:
        super().__init__(why)
        self.index = index
        self.message = stream_interrupted(index, why)


def _redis_errors() -> tuple[type[BaseException], ...]:
    import redis.exceptions

    return (
        redis.exceptions.ConnectionError,
        redis.exceptions.TimeoutError,
        ConnectionError,
        OSError,
    )


@dataclass
class _Writer:
    """The ordered, batched writer of one run owned by this process.

    `local` holds every event this process published on the run, in seq order from 0;
    `written` is how many of them are confirmed stored in the stream (a prefix: the queue
    is written in order). Local followers are served `local[:written]`, so they see what a
    follower on another replica would see, never an event that could still be lost.
    `diverged` is set when the stream holds entries this process did not write at seqs it
    used (another replica took the run over); the local copy is then no longer the stream's,
    and followers and `events_of` read the stream. Queued items are never given up: while
    Redis is away they wait in `queue` (and `local`) and are written, in order, when it
    answers again (a fresh-eyes test: items dropped after `retry_s` left the stream without
    its end for good, and its listeners waiting forever). `forget_when_written`: `forget` came
    while items were still queued; the writer forgets itself once they are written.
    """

    next_seq: int = 0
    local: list[events_pb2.Event] = field(default_factory=list)
    queue: list[tuple[str, int, bytes]] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None
    closed: bool = False
    written: int = 0
    diverged: bool = False
    forget_when_written: bool = False
    failing_since: float | None = (
        None  # monotonic time the current Redis outage began for this writer
    )
    changed: asyncio.Future | None = None
    probe: bool = False  # send a batch even with nothing queued: does Redis still hold the stream? (`restore_lost`)
    archived: bool = False  # the database holds `local` whole (`forget(archived=True)`): followers here need no Redis

    def notify(self) -> None:
        """Wake the local followers (one shared future, replaced at each wake)."""
        if self.changed is not None and not self.changed.done():
            self.changed.set_result(None)
        self.changed = None

    def waiter(self) -> asyncio.Future:
        """The future the next `notify` completes."""
        if self.changed is None:
            self.changed = asyncio.get_running_loop().create_future()
        return self.changed

    @property
    def authoritative(self) -> bool:
        """Whether `local` is exactly what the stream holds for this run (as far as it is written)."""
        return not self.diverged


class RedisEventLog:
    """Run events in Redis Streams (see the module docstring for the key layout).

    The owner of a run (the process that publishes it) writes its queued events with one
    `EVALSHA` of `_BATCH` per batch (a round trip per batch, not per event), serves
    followers of the run in this process from its own copy once each event is stored
    (no Redis read), and archives from that copy at the run's end. Other processes follow
    the stream with `XREAD BLOCK`.

    Args:
        redis: a `redis.asyncio.Redis` client (bytes responses).
        prefix: key prefix (`redis_key_prefix`).
        max_len: approximate cap of a run's stream (`XADD MAXLEN ~`).
        ttl_s: seconds a stream is kept after its run ends.
        archive_loader: reads a run's archived events from the orchestrator database.
        retry_s: how long a write or a follower keeps retrying Redis before giving up.
        block_ms: how long one `XREAD BLOCK` waits before checking whether the run ended.
        open_wait_s: how long a follower waits for a run that has no stream nor archive yet.

    `durable`: a stored event outlives this process (the crash reaper reads it back), so a
    run's events are archived after its end is published.
    """

    durable = True

    def __init__(
        self,
        redis: Any,
        prefix: str,
        max_len: int,
        ttl_s: float,
        archive_loader: ArchiveLoader,
        retry_s: float = 30.0,
        block_ms: int = XREAD_BLOCK_MS,
        open_wait_s: float = 10.0,
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.max_len = max_len
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.archive_loader = archive_loader
        self.retry_s = retry_s
        self.block_ms = block_ms
        self.open_wait_s = open_wait_s
        self._writers: dict[str, _Writer] = {}
        self._batch = redis.register_script(_BATCH)
        self.reader: Any = (
            None  # the replica's StreamReader, shared by its followers (RedisBackend)
        )

    def _keys(self, run_id: str) -> tuple[str, str]:
        return f"{self.prefix}run:{run_id}:events", f"{self.prefix}run:{run_id}:meta"

    async def _run_batch(
        self, run_id: str, items: list[tuple[str, int, bytes]], stored: int = -1
    ) -> list[int]:
        """One atomic `_BATCH` call for `items` ((op, seq, payload), in order); its per-event
        results. `stored`: how many events the caller already wrote (-1: not its own run);
        raises StreamLost when the stream should hold some and Redis has lost it."""
        stream, meta = self._keys(run_id)
        args: list[Any] = [self.max_len, self.ttl_ms, stored]
        for kind, seq, payload in items:
            args += ("e" if kind == "event" else "o" if kind == "open" else "c", seq, payload)
        results = await self._batch(keys=[stream, meta], args=args)
        if results and results[0] == b"lost":
            raise StreamLost(run_id)
        return [int(value) for value in results]

    # ------------------------------------------------------------------ the owner's side

    def open(self, run_id: str) -> None:
        """Start the writer of a new run owned by this process (its stream is created at once)."""
        if run_id in self._writers:
            return
        writer = _Writer()
        writer.idle.set()
        self._writers[run_id] = writer
        self._enqueue(run_id, writer, ("open", -1, b""))
        writer.task = asyncio.create_task(self._write(run_id, writer), name=f"events:{run_id}")

    def has(self, run_id: str) -> bool:
        """Whether this process owns (publishes) the run."""
        return run_id in self._writers

    def append(self, event: events_pb2.Event) -> events_pb2.Event:
        """Number `event` and queue it for the stream (in order); returns it with `seq` set."""
        writer = self._writers.get(event.run_id)
        if writer is None:
            self.open(event.run_id)
            writer = self._writers[event.run_id]
        if writer.closed:
            raise RuntimeError(f"run {event.run_id} is closed")
        event.seq = writer.next_seq
        writer.next_seq += 1
        writer.local.append(event)
        self._enqueue(event.run_id, writer, ("event", event.seq, event.SerializeToString()))
        return event

    def close(self, run_id: str) -> None:
        """Queue the end of the run: `closed` is set and the stream expires after `ttl_s`."""
        writer = self._writers.get(run_id)
        if writer is None or writer.closed:
            return
        writer.closed = True
        self._enqueue(run_id, writer, ("close", -1, b""))
        writer.notify()

    def reopen(self, run_id: str) -> None:
        """Allow appends to a closed run of this process again."""
        writer = self._writers.get(run_id)
        if writer is not None and writer.closed:
            writer.closed = False
            self._enqueue(run_id, writer, ("open", -1, b""))

    def snapshot(self, run_id: str) -> list[events_pb2.Event]:
        """The events this process published on the run (a copy; empty for other runs)."""
        writer = self._writers.get(run_id)
        return list(writer.local) if writer else []

    def _enqueue(self, run_id: str, writer: _Writer, item: tuple[str, int, bytes]) -> None:
        writer.queue.append(item)
        writer.idle.clear()
        writer.wake.set()

    async def _write(self, run_id: str, writer: _Writer) -> None:
        """Send the queued items in order, all that are queued in one `_BATCH` call; retry on errors.

        A batch is atomic in Redis; after a failure it is sent again whole, and entries a lost
        reply had already stored are recognized (no duplicate). A refused event (another
        replica ended the run, or wrote at its seq) marks the writer `diverged`: its followers
        here then read the stream, never an event the stream refused. When Redis lost the
        stream (`StreamLost`), the whole copy is queued again first (`_rewrite`).
        """
        errors = _redis_errors()
        reported = False
        while True:
            await writer.wake.wait()
            await asyncio.sleep(
                0
            )  # one loop turn: events published by tasks ready now join this batch
            writer.wake.clear()
            while writer.queue or writer.probe:
                batch = list(writer.queue)
                try:
                    results = await self._run_batch(
                        run_id, batch, -1 if writer.diverged else writer.written
                    )
                except StreamLost:
                    self._rewrite(run_id, writer)
                    continue
                except errors as error:
                    now = time.monotonic()
                    failing_since = writer.failing_since = writer.failing_since or now
                    if now - failing_since > self.retry_s and not reported:
                        reported = True  # once per outage; the items stay queued and are sent when Redis answers
                        log.error(
                            "Redis unreachable: run events held until it answers",
                            extra={
                                "fields": {
                                    "run_id": run_id,
                                    "error": type(error).__name__,
                                    "items": len(batch),
                                }
                            },
                        )
                    await asyncio.sleep(
                        min(1.0, 0.05 * 2 ** min(5, int((now - failing_since) * 4)))
                    )
                    continue
                if reported:
                    log.warning(
                        "Redis answers again: held run events written",
                        extra={"fields": {"run_id": run_id, "items": len(batch)}},
                    )
                    reported = False
                if any(result < 0 for result in results):
                    writer.diverged = True
                    log.warning(
                        "run events already stored by another writer",
                        extra={"fields": {"run_id": run_id}},
                    )
                writer.failing_since = None
                writer.probe = False
                del writer.queue[: len(batch)]
                writer.written += len(results)
                writer.notify()
            writer.idle.set()  # the writer (and its local copy) stays until `forget`
            if writer.forget_when_written and writer.closed:
                self.forget(run_id)
                return

    @staticmethod
    def _rewrite(run_id: str, writer: _Writer) -> None:
        """Queue the writer's whole copy again, before what is queued: Redis lost the stream
        (restarted without persistence). Its followers here wait until it is stored again."""
        items: list[tuple[str, int, bytes]] = [("open", -1, b"")]
        items += [
            ("event", event.seq, event.SerializeToString())
            for event in writer.local[: writer.written]
        ]
        if writer.closed and not writer.queue:  # its close was stored: store it again
            items.append(("close", -1, b""))
        writer.queue[:0] = items
        writer.written = 0
        log.warning(
            "Redis lost a run's stream: written again from this replica's copy",
            extra={"fields": {"run_id": run_id, "events": len(items) - 1}},
        )

    async def restore_lost(self) -> int:
        """Probe the streams of this process's runs that Redis may have lost (one pipelined
        EXISTS of their meta hashes): the writer of each missing one checks atomically and
        writes its whole copy again (`StreamLost`). Returns how many writers were asked."""
        suspects = [
            (run_id, writer)
            for run_id, writer in self._writers.items()
            if writer.written
            and not writer.diverged
            and writer.task is not None
            and not writer.task.done()
        ]
        if not suspects:
            return 0
        async with self.redis.pipeline(transaction=False) as pipe:
            for run_id, _ in suspects:
                pipe.exists(self._keys(run_id)[1])
            found = await pipe.execute()
        asked = 0
        for (_, writer), exists in zip(suspects, found, strict=True):
            if not exists:
                writer.probe = True
                writer.idle.clear()
                writer.wake.set()
                asked += 1
        return asked

    async def flush(self, run_id: str, timeout: float | None = None) -> None:
        """Wait until the queued items of the run are written (at most `timeout`, by default
        `retry_s` + 5 s)."""
        writer = self._writers.get(run_id)
        if writer is None:
            return
        with contextlib.suppress(
            TimeoutError
        ):  # asyncio.timeout: wait_for can drop a cancel (services/common/tasks.py)
            async with asyncio.timeout(self.retry_s + 5 if timeout is None else timeout):
                await writer.idle.wait()

    def unstored_runs(self) -> list[str]:
        """The runs whose writer here still holds items Redis has not stored (Redis away)."""
        return [run_id for run_id, writer in self._writers.items() if writer.queue]

    def forget(self, run_id: str, archived: bool = False) -> None:
        """Drop this process's writer of an ended run (after it was flushed and archived); one
        whose items are still queued (Redis away) forgets itself once they are written, its
        followers here served all of its copy meanwhile when that copy is what was `archived`."""
        writer = self._writers.get(run_id)
        if writer is None or not writer.closed:
            return
        if writer.queue:
            writer.forget_when_written = True
            writer.archived = archived and not writer.diverged
            writer.notify()
            return
        self._writers.pop(run_id, None)
        if writer.task is not None and writer.task is not asyncio.current_task():
            writer.task.cancel()
        writer.notify()

    def owned_events(self, run_id: str) -> list[events_pb2.Event] | None:
        """Every event this process published on a run it owns, stored in Redis yet or not (the
        run's archive needs no Redis: `TurnRunner.archive`); None for a run it does not own or
        that another replica appended to (`_Writer.diverged`: the stream is the truth then)."""
        writer = self._writers.get(run_id)
        if writer is None or writer.diverged:
            return None
        return list(writer.local)

    async def purge(self, run_ids: list[str]) -> None:
        """Delete the streams and meta hashes of ended runs now (a permanently deleted chat's),
        instead of leaving their events in Redis for `ttl_s`, with this process's writers of them
        (`forget`). One UNLINK, retried like every write (`_retry`); raises the last Redis error
        when Redis stays away that long (the streams then expire as usual)."""
        keys: list[str] = []
        for run_id in run_ids:
            self.forget(run_id)
            keys += self._keys(run_id)
        if keys:
            await self._retry(lambda: self.redis.unlink(*keys))

    async def aclose(self) -> None:
        """Flush and stop every writer."""
        for run_id in list(self._writers):
            await self.flush(run_id)
        for writer in self._writers.values():
            if writer.task is not None:
                writer.task.cancel()
            writer.notify()
        self._writers.clear()

    # ------------------------------------------------------------------ anyone's side

    async def _retry(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """`call()` with backoff on connection errors, for up to `retry_s` (then re-raise)."""
        errors = _redis_errors()
        started = time.monotonic()
        delay = 0.05
        while True:
            try:
                return await call()
            except errors:
                if time.monotonic() - started > self.retry_s:
                    raise
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)

    async def _meta(self, run_id: str) -> tuple[bool, bool, int]:
        """(exists, closed, next) of the run's meta hash."""
        _, meta = self._keys(run_id)
        closed, nxt = await self.redis.hmget(meta, "closed", "next")
        if nxt is None:
            return False, False, 0
        return True, closed == b"1", int(nxt)

    def _owned_copy(self, run_id: str) -> list[events_pb2.Event] | None:
        """This process's copy of a run it publishes, when it is whole and all stored; else None."""
        writer = self._writers.get(run_id)
        if (
            writer is None
            or not writer.authoritative
            or writer.queue
            or writer.written != len(writer.local)
        ):
            return None
        return list(writer.local)

    async def events_of(self, run_id: str) -> list[events_pb2.Event]:
        """Every event of the run: this process's copy of a run it publishes (once all of it is
        stored and the stream's `next` says nothing was appended by another replica: one HMGET
        instead of reading the stream back), else the stream while it exists (and is whole),
        else the archive."""
        owned = self._owned_copy(run_id)
        stream, _ = self._keys(run_id)
        exists, _, nxt = await self._retry(lambda: self._meta(run_id))
        if owned is not None and (not exists or nxt == len(owned)):
            return owned
        if exists:
            entries = await self._retry(lambda: self.redis.xrange(stream, "-", "+"))
            events = [_decode(entry_id, fields) for entry_id, fields in entries]
            if len(events) == nxt and all(event.seq == index for index, event in enumerate(events)):
                return events
            archived = await self.archive_loader(run_id)
            if len(archived) >= len(events):
                return archived
            return events
        return await self.archive_loader(run_id)

    async def append_after_end(
        self, run_id: str, *events: events_pb2.Event
    ) -> list[events_pb2.Event]:
        """Append `events` to an ended or orphaned run from any replica, then close the log again.

        When the stream expired it is first restored from the archive, so seq numbers go on.
        The restore, the events and the close are one atomic `_BATCH` call (retried on errors).
        """
        writer = self._writers.get(run_id)
        if writer is not None:
            await self.flush(run_id)  # this process's own queued items first, in order
        exists, _, _ = await self._retry(lambda: self._meta(run_id))
        items: list[tuple[str, int, bytes]] = [
            ("open", -1, b"")
        ]  # a closed run takes events from here only
        if not exists:
            items += [
                ("event", archived.seq, archived.SerializeToString())
                for archived in await self.archive_loader(run_id)
            ]
        restored = len(items) - 1  # the events restored from the archive (results are per event)
        items += [("event", -1, event.SerializeToString()) for event in events]
        items.append(("close", -1, b""))
        results = await self._retry(lambda: self._run_batch(run_id, items))
        for event, result in zip(events, results[restored:], strict=True):
            event.seq = result if result >= 0 else -1 - result
        if writer is not None:  # keep this process's copy whole
            whole = (
                writer.authoritative and writer.written == len(writer.local) and not writer.queue
            )
            writer.local.extend(events)
            writer.next_seq = max([writer.next_seq, *(event.seq + 1 for event in events)])
            if whole and [event.seq for event in writer.local] == list(range(len(writer.local))):
                writer.written = len(writer.local)
            else:
                writer.diverged = True
            writer.notify()
        return list(events)

    def follow(self, run_id: str, after: int = 0) -> AsyncIterator[events_pb2.Event]:
        """Yield the run's events from index `after`, then live ones, until it ends (see `follow_batches`)."""
        return flatten(self.follow_batches(run_id, after))

    async def follow_batches(
        self, run_id: str, after: int = 0
    ) -> AsyncIterator[list[events_pb2.Event]]:
        """Yield the run's events from index `after`, then live ones, until it ends, as lists:
        what this process's copy holds and is stored when it is taken, or one `XREAD`'s entries.

        A run this process publishes is served from its own copy, each event once it is
        stored in the stream (what any replica's follower sees, without reading Redis back),
        all of it once the run is archived; should that copy stop being the stream's
        (`_Writer.authoritative`), the follower goes on from the stream at the index it
        reached. Otherwise: the stream; without a stream the archive is served (a run that has
        neither yet is waited for, `_follow_stream`). On Redis errors the follower serves the
        archive if the run has one, else retries with backoff from the index it reached; after
        `retry_s` without Redis it raises StreamInterrupted (StreamRun's UNAVAILABLE, from which
        the gateway gives each listener its reconnect frame). A stream trimmed past the
        follower's index ends with an `error` event.
        """
        index = max(after, 0)
        writer = self._writers.get(run_id)
        if writer is not None:
            ended = False  # this follower delivered the run's terminal event
            stalled_since: float | None = (
                None  # when this follower began waiting on a writer that cannot reach Redis
            )
            while writer.authoritative:
                stored = len(writer.local) if writer.archived else writer.written
                if index < stored:
                    batch = writer.local[index:stored]
                    index += len(batch)
                    ended = is_terminal(batch[-1])
                    yield batch
                    continue
                if writer.closed and index >= stored == len(writer.local):
                    if ended:
                        return
                    break  # ended without a terminal event here, or a late listener: what another replica appended is in the stream
                if (
                    writer.task is None or writer.task.done()
                ):  # forgotten or stopped: the stream has the rest
                    break
                if writer.failing_since is None:
                    stalled_since = None
                else:  # Redis away for this follower longer than retry_s: end as a follower through Redis does (the writer keeps the events)
                    stalled_since = stalled_since or time.monotonic()
                    if time.monotonic() - stalled_since > self.retry_s:
                        raise StreamInterrupted(index, UNREACHABLE)
                with contextlib.suppress(
                    TimeoutError
                ):  # looks at the outage's length at least once a second
                    async with asyncio.timeout(1.0):
                        await asyncio.shield(writer.waiter())
        async for batch in self._follow_stream(run_id, index):
            yield batch

    async def _follow_stream(
        self, run_id: str, index: int
    ) -> AsyncIterator[list[events_pb2.Event]]:
        """`follow_batches` through Redis (a list per `XREAD`): `XREAD BLOCK` from `index`; the meta hash is read at the start,
        when a read returns nothing and after a terminal event (is the run closed?).

        A run with neither a stream nor an archive is waited for: `open_wait_s` before its
        stream was seen (it may not have started), `retry_s` once it was (Redis lost it: its
        owner writes it again from its copy within a second, `restore_lost`, or the archive
        comes with the run's end). Then, as after `retry_s` without Redis, the follower ends
        with StreamInterrupted naming `index`: never without the run's end."""
        stream, _ = self._keys(run_id)
        errors = _redis_errors()
        failing_since: float | None = None
        delay = 0.05
        missing_since = time.monotonic()
        missing_bound = self.open_wait_s
        last_terminal = False
        check_meta = True
        while True:
            try:
                if check_meta:
                    exists, closed, nxt = await self._meta(run_id)
                    if not exists:
                        archived = await self.archive_loader(run_id)
                        if archived:
                            if archived[index:]:
                                yield archived[index:]
                            return
                        if time.monotonic() - missing_since > missing_bound:
                            raise StreamInterrupted(index, "the run's events are not available")
                        await asyncio.sleep(0.05 if missing_bound == self.open_wait_s else 0.25)
                        continue
                    missing_since, missing_bound = time.monotonic(), self.retry_s
                    if closed and index >= nxt:
                        return
                block = 50 if last_terminal else self.block_ms
                response = await self._xread(stream, index, block)
                failing_since, delay = None, 0.05
            except errors as error:
                try:  # an ended run needs no Redis: the database has it whole
                    archived = await self.archive_loader(run_id)
                except Exception:  # the database is away too: retry both
                    archived = []
                if archived:
                    if archived[index:]:
                        yield archived[index:]
                    return
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since > self.retry_s:
                    log.warning(
                        "follower gave up: Redis unreachable",
                        extra={"fields": {"run_id": run_id, "error": type(error).__name__}},
                    )
                    raise StreamInterrupted(index, UNREACHABLE) from None
                check_meta = True
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)
                continue
            check_meta = not response
            batch: list[events_pb2.Event] = []
            for entry_id, fields in response:
                event = _decode(entry_id, fields)
                if event.seq < index:
                    continue
                if event.seq > index:
                    archived = await self.archive_loader(run_id)
                    if len(archived) > index:
                        batch.extend(archived[index : event.seq])
                    else:  # its archive comes with the run's end
                        if batch:
                            yield batch
                        raise StreamInterrupted(index, "the stream no longer holds these events")
                index = event.seq + 1
                last_terminal = is_terminal(event)
                batch.append(event)
            if batch:
                yield batch
            if last_terminal:
                check_meta = True

    async def _xread(self, stream: str, index: int, block_ms: int) -> list[tuple[Any, Any]]:
        """The entries of `stream` from seq `index` on, waiting up to `block_ms` for some:
        through the shared `StreamReader` when there is one, else one `XREAD` of its own."""
        if self.reader is not None:
            return await self.reader.read(stream, f"0-{index}", block_ms)
        response = await self.redis.xread({stream: f"0-{index}"}, count=512, block=block_ms)
        return [entry for _, entries in response or () for entry in entries]


def _decode(entry_id: bytes | str, fields: dict[Any, Any]) -> events_pb2.Event:
    """The Event of a stream entry; its seq comes from the entry id `0-<seq+1>`."""
    raw_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    payload = fields.get(b"e", fields.get("e"))
    event = events_pb2.Event.FromString(payload)
    event.seq = int(raw_id.split("-", 1)[1]) - 1
    return event


class RedisBackend(RunBackend):
    """Replicas sharing one Redis (see the module docstring).

    Args:
        url: Redis URL (`redis://host:port/db`).
        prefix: key prefix, e.g. "loopline:" (LOOPLINE_REDIS_KEY_PREFIX).
        archive_loader: the orchestrator database's archived events of a run.
        max_len / ttl_s: stream cap and lifetime after the run ends.
        claim_ttl_s: lifetime of a chat claim that is never released.
        retry_s: Redis retry budget of writers and followers.
        cancel_poll_s: how often the runner polls cancel flags (used by `TurnRunner`).
    """

    distributed = True

    def __init__(
        self,
        url: str,
        prefix: str,
        archive_loader: ArchiveLoader,
        *,
        max_len: int = 10_000,
        ttl_s: float = 86_400,
        claim_ttl_s: float = 60.0,
        retry_s: float = 30.0,
        max_connections: int = 32,
        readers: int = 2,
    ) -> None:
        from services.orchestrator.stream_reader import StreamReader  # noqa: PLC0415 - Redis deployments only

        self.redis = redis_client(url, max_connections=max_connections)
        self.prefix = prefix
        self.claim_ttl_ms = max(1, int(claim_ttl_s * 1000))
        self.events = RedisEventLog(
            self.redis, prefix, max_len, ttl_s, archive_loader, retry_s=retry_s
        )
        self.events.reader = StreamReader(
            self.redis, f"{prefix}reader:{secrets.token_hex(6)}", shards=readers
        )
        self._release = self.redis.register_script(_RELEASE)
        self._releasing: set[asyncio.Task] = (
            set()
        )  # claims of unknown outcome being released (`try_claim`)
        self._channel = f"{prefix}cancels"
        self._listener: asyncio.Task | None = None
        self._on_cancel: CancelHandler | None = None

    async def start(self, on_cancel: CancelHandler) -> None:
        """Check Redis is reachable (else CannotStart naming LOOPLINE_REDIS_URL's host and port,
        never its password: a 58-line traceback before), then subscribe to the cancel channel in
        a background task."""
        try:
            await self.redis.ping()
        except _redis_errors() as error:
            from services.common.runner import CannotStart  # noqa: PLC0415 - only on this failure

            where = self.redis.connection_pool.connection_kwargs
            raise CannotStart(
                f"Redis at {where.get('host', '?')}:{where.get('port', '?')} (LOOPLINE_REDIS_URL) does not answer "
                f"({type(error).__name__})"
            ) from None
        self._on_cancel = on_cancel
        subscribed = asyncio.Event()
        self._listener = asyncio.create_task(self._listen(subscribed), name="cancel-listener")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await subscribed.wait()

    async def _listen(self, subscribed: asyncio.Event) -> None:
        """Deliver cancel messages to the handler; resubscribe after connection errors."""
        errors = _redis_errors()
        delay = 0.1
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self._channel)
                subscribed.set()
                delay = 0.1
                while True:
                    message = await pubsub.get_message(timeout=5.0)
                    if message is None or message.get("type") != "message":
                        continue
                    run_id, _, reason = message["data"].decode().partition("\n")
                    if self._on_cancel is not None:
                        asyncio.create_task(self._on_cancel(run_id, reason or "cancelled"))
            except asyncio.CancelledError:
                raise
            except errors:
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)
            except Exception:
                log.exception("cancel listener failed")
                await asyncio.sleep(delay)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def close(self) -> None:
        """Flush event writers, stop the listener and close the client."""
        for task in list(self._releasing):  # those claims expire by themselves
            task.cancel()
        await self.events.aclose()
        await self.events.reader.aclose()
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._listener
        await self.redis.aclose()

    async def try_claim(self, chat_id: str) -> str | None:
        """`SET claim NX PX claim_ttl`; None when another request (any replica) holds it.

        A SET whose answer never came (the call cancelled by its caller's deadline, or a
        connection error while Redis stalled) may still be applied when Redis answers again:
        a claim no one holds, which blocked every retry of that start (its request_id) or turn
        on that chat until it expired (fresh-eyes chaos test: 60 s after Redis came back). Its
        token is then released in the background (`_release_unknown`)."""
        token = secrets.token_hex(8)
        key = f"{self.prefix}claim:{chat_id}"
        try:
            taken = await self.redis.set(key, token, nx=True, px=self.claim_ttl_ms)
        except BaseException:
            task = asyncio.get_running_loop().create_task(
                self._release_unknown(key, token), name="release-unknown-claim"
            )
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)
            raise
        return token if taken else None

    async def _release_unknown(self, key: str, token: str) -> None:
        """Delete `key` if `token` holds it, looking once a second until it is gone, held by another
        or `claim_ttl` has passed (a SET of unknown outcome may arrive late)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.claim_ttl_ms / 1000
        while loop.time() < deadline:
            try:
                held = await self.redis.get(key)
                if held is not None and held != token.encode():
                    return  # another request's: ours never arrived (or expired)
                if held is not None:
                    await self._release(keys=[key], args=[token])
                    log.info("a claim taken by a call that never got its answer was released")
                    return
            except _redis_errors():
                pass  # Redis still away: look again
            await asyncio.sleep(1.0)

    async def release_claim(self, chat_id: str, token: str) -> None:
        """Delete the claim only if `token` still holds it."""
        try:
            await self._release(keys=[f"{self.prefix}claim:{chat_id}"], args=[token])
        except _redis_errors():
            log.warning(
                "releasing a chat claim failed; it expires by itself",
                extra={"fields": {"chat_id": chat_id}},
            )

    async def request_cancel(self, run_id: str, reason: str) -> None:
        """Set the run's cancel flag (TTL 300 s) and publish it to every replica."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(f"{self.prefix}cancel:{run_id}", reason, ex=CANCEL_FLAG_TTL_S)
            pipe.publish(self._channel, f"{run_id}\n{reason}")
            await pipe.execute()

    async def pending_cancels(self, run_ids: list[str]) -> dict[str, str]:
        """The cancel flags set for `run_ids` (one MGET)."""
        if not run_ids:
            return {}
        values = await self.redis.mget([f"{self.prefix}cancel:{run_id}" for run_id in run_ids])
        return {
            run_id: value.decode()
            for run_id, value in zip(run_ids, values, strict=True)
            if value is not None
        }


def redis_client(
    url: str,
    block_ms: int = XREAD_BLOCK_MS,
    timeout_s: float = db.REDIS_TIMEOUT_S,
    max_connections: int | None = None,
) -> Any:
    """A `redis.asyncio.Redis` for the backend (`db.redis_client_options`): 5 s to connect,
    `timeout_s` plus `block_ms` (the longest `XREAD BLOCK` it sends) for each reply,
    a PING before a command on a connection idle for 10 s, and at most 3 quick retries of a
    connection error (our own loops bound the total retry time). With `max_connections` its
    pool holds at most that many and a command waits for a free one instead of failing."""
    import redis.asyncio as aioredis

    options = {"health_check_interval": 10, **db.redis_client_options(timeout_s + block_ms / 1000)}
    if max_connections is None:
        return aioredis.Redis.from_url(url, **options)
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=None, **options
    )
    return aioredis.Redis(connection_pool=pool)


def make_backend(settings: Any, archive_loader: ArchiveLoader) -> RunBackend:
    """`RedisBackend` when `settings.redis_url` is set, else `MemoryBackend`."""
    if settings.redis_url:
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
    return MemoryBackend(
        archive_loader=archive_loader,
        max_runs=settings.event_log_max_runs,
        max_bytes=settings.event_log_max_bytes,
    )
