"""The owner's side of the Redis event log: numbering, queueing and batched writes of the runs
this process publishes.

One stream per run (`<prefix>run:<run_id>:events`): the entry id of event `seq` is `0-<seq+1>`,
so stream order is seq order, a follower resumes with `XREAD BLOCK` from `0-<index>`, and a
retried write cannot duplicate an event. Each entry holds the serialized
`loopline.assistant.v1.Event` (field `e`). A hash `<prefix>run:<run_id>:meta` holds `next` (the
next seq) and `closed` ("1" once the run ended). Streams are capped with `XADD MAXLEN ~
run_events_max_len` and expire `run_events_ttl_s` seconds after the run ends. The owner writes
what is queued for a run in one atomic `EVALSHA` (`_BATCH`: open, events, close in order).
Redis errors are retried with backoff; what is queued is never given up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from loopline.assistant.v1 import events_pb2
from services.common import metrics

log = logging.getLogger(__name__)


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


class StreamLost(Exception):
    """Redis no longer holds the stream of a run this process writes (restarted empty)."""


def redis_errors() -> tuple[type[BaseException], ...]:
    """The errors of an unreachable Redis (redis-py is imported only where Redis is used)."""
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
    answers again (dropped items would leave the stream without its end for good, and its
    listeners waiting forever). `forget_when_written`: `forget` came
    while items were still queued; the writer forgets itself once they are written.
    """

    next_seq: int = 0
    local: list[events_pb2.Event] = field(default_factory=list)
    queue: list[tuple[str, int, bytes]] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    closed: bool = False
    written: int = 0
    diverged: bool = False
    forget_when_written: bool = False
    failing_since: float | None = None  # monotonic time the current Redis outage began
    changed: asyncio.Future[None] | None = None
    # send a batch even with nothing queued: does Redis still hold the stream? (`restore_lost`)
    probe: bool = False
    # the database holds `local` whole (`forget(archived=True)`): followers here need no Redis
    archived: bool = False

    def notify(self) -> None:
        """Wake the local followers (one shared future, replaced at each wake)."""
        if self.changed is not None and not self.changed.done():
            self.changed.set_result(None)
        self.changed = None

    def waiter(self) -> asyncio.Future[None]:
        """The future the next `notify` completes."""
        if self.changed is None:
            self.changed = asyncio.get_running_loop().create_future()
        return self.changed

    @property
    def authoritative(self) -> bool:
        """Whether `local` is exactly what the stream holds for the run (as far as written)."""
        return not self.diverged


class RedisStreamWriter:
    """The owner's side of `RedisEventLog`: the runs this process publishes, each with its
    `_Writer` (see the module docstring for the key layout).

    Events are written with one `EVALSHA` of `_BATCH` per batch (a round trip per batch, not
    per event); this process's copy of each run serves its local followers and its archive.

    Args:
        redis: a `redis.asyncio.Redis` client (bytes responses).
        prefix: key prefix (`redis_key_prefix`).
        max_len: approximate cap of a run's stream (`XADD MAXLEN ~`).
        ttl_s: seconds a stream is kept after its run ends.
        retry_s: how long a write keeps retrying Redis before it reports the outage.
    """

    def __init__(self, redis: Any, prefix: str, max_len: int, ttl_s: float, retry_s: float) -> None:
        self.redis = redis
        self.prefix = prefix
        self.max_len = max_len
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.retry_s = retry_s
        self._writers: dict[str, _Writer] = {}
        self._batch = redis.register_script(_BATCH)

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
        """Send the queued items in order, all that are queued in one `_BATCH` call; retry on
        errors.

        A batch is atomic in Redis; after a failure it is sent again whole, and entries a lost
        reply had already stored are recognized (no duplicate). A refused event (another
        replica ended the run, or wrote at its seq) marks the writer `diverged`: its followers
        here then read the stream, never an event the stream refused. When Redis lost the
        stream (`StreamLost`), the whole copy is queued again first (`_rewrite`).
        """
        errors = redis_errors()
        reported = False
        while True:
            await writer.wake.wait()
            # one loop turn: events published by tasks ready now join this batch
            await asyncio.sleep(0)
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
                    metrics.count_storage_error("orchestrator", "redis", "unavailable")
                    now = time.monotonic()
                    failing_since = writer.failing_since = writer.failing_since or now
                    if now - failing_since > self.retry_s and not reported:
                        # once per outage; the items stay queued and are sent when Redis answers
                        reported = True
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

    async def flush(self, run_id: str, wait_s: float | None = None) -> None:
        """Wait until the queued items of the run are written (at most `wait_s`, by default
        `retry_s` + 5 s)."""
        writer = self._writers.get(run_id)
        if writer is None:
            return
        # asyncio.timeout: wait_for can drop a cancel (services/common/tasks.py)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.retry_s + 5 if wait_s is None else wait_s):
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

    async def _retry(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """`call()` with backoff on connection errors, for up to `retry_s` (then re-raise)."""
        errors = redis_errors()
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
