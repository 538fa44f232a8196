"""One multiplexed `XREAD BLOCK` reader per replica, shared by every follower of a run stream.

A follower that reads its stream with its own `XREAD BLOCK` holds a pooled Redis connection
for the whole wait, so ~100 followed runs exhaust redis-py's pool. `StreamReader.read` has
the same meaning as one such XREAD, but the waiting is done by `shards` background tasks,
each with one dedicated connection (not from the client's pool): a shard sends ONE XREAD for
all the keys its waiters follow (each from the smallest id asked for it) plus its wake stream
`<wake_key>:<shard>`, and hands each waiter the entries after its own id. A waiter whose key is
not in the XREAD in flight (or that asks for older entries, or must be answered sooner)
XADDs to the wake stream through the client's pool, so that XREAD returns at once and the
next one includes it. A shard with no waiters sends nothing.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from redis.typing import KeyT, StreamIdT

log = logging.getLogger(__name__)

MAX_BLOCK_MS = 1000  # longest BLOCK of a shared XREAD (bounded further by the socket timeout)
LINGER_S = 0.002  # after delivering entries, let their readers ask again before the next XREAD
WAKE_MAXLEN = 16
WAKE_TTL_MS = 60_000
_POOL_INTERNAL = (
    "maint_notifications_pool_handler",
    "orig_host_address",
    "orig_socket_timeout",
    "orig_socket_connect_timeout",
)

StreamId = tuple[int, int]
Entry = tuple[Any, dict]


def parse_id(value: str | bytes) -> StreamId:
    """A stream entry id (`ms-seq`, or `ms` meaning `ms-0`) as a comparable tuple."""
    text = value.decode() if isinstance(value, bytes) else value
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _entries_of(value: Any) -> list[Entry]:
    """The entry list of one stream in an XREAD reply (RESP3 parsers may wrap it in a list)."""
    if value and isinstance(value[0], list):
        return value[0]
    return value or []


@dataclass(eq=False)
class _Waiter:
    """One pending `read`: entries of `key` after `after`, until `deadline` (monotonic)."""

    key: str
    after: StreamId
    deadline: float
    future: asyncio.Future
    since: int  # the shard's round counter when registered: rounds after it include this waiter


class _Shard:
    """The waiters of the keys hashed to one shard, and the task that serves them."""

    def __init__(self, reader: StreamReader, index: int) -> None:
        import redis.asyncio as aioredis  # noqa: PLC0415 - only a process configured with Redis imports redis-py

        self.reader = reader
        self.wake_key = f"{reader.wake_key}:{index}"
        self.wake_id = "0-0"  # the last wake entry seen (explicit, not `$`, so no wake is missed)
        self.waiters: dict[str, set[_Waiter]] = {}
        self.inflight: dict[str, StreamId] | None = None  # the ids of the XREAD in flight
        self.inflight_end = 0.0
        self.woken = False  # a wake was sent for the XREAD in flight
        self.round = 0
        self.failing = False
        self.event = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.wakes: set[asyncio.Task] = set()
        source = reader.redis.connection_pool
        kwargs = {k: v for k, v in source.connection_kwargs.items() if k not in _POOL_INTERNAL}
        pool = aioredis.ConnectionPool(
            connection_class=source.connection_class, max_connections=1, **kwargs
        )
        self.conn = aioredis.Redis.from_pool(pool)
        timeout = kwargs.get("socket_timeout")
        self.max_block_ms = (
            MAX_BLOCK_MS if not timeout else max(1, min(MAX_BLOCK_MS, int(timeout * 500)))
        )

    def add(self, waiter: _Waiter) -> None:
        """Register `waiter`; start the task if needed, and wake the XREAD in flight if it does not
        serve it."""
        self.waiters.setdefault(waiter.key, set()).add(waiter)
        if self.task is None:
            self.task = asyncio.create_task(self._run(), name=f"stream-reader:{self.wake_key}")
        self.event.set()
        if self.inflight is None or self.woken:
            return
        sent = self.inflight.get(waiter.key)
        if sent is None or waiter.after < sent or waiter.deadline < self.inflight_end - 0.01:
            self.woken = True
            task = asyncio.create_task(self._wake())
            self.wakes.add(task)
            task.add_done_callback(self.wakes.discard)

    def discard(self, waiter: _Waiter) -> None:
        """Forget `waiter` (answered, cancelled or failed)."""
        waiters = self.waiters.get(waiter.key)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del self.waiters[waiter.key]

    def _resolve(
        self,
        waiter: _Waiter,
        entries: list[Entry] | None = None,
        error: BaseException | None = None,
    ) -> None:
        """Forget `waiter`, answer it: `entries` ([] by default), or raise `error` in its reader."""
        self.discard(waiter)
        if not waiter.future.done():
            if error is not None:
                waiter.future.set_exception(error)
            else:
                waiter.future.set_result(entries or [])

    async def _wake(self) -> None:
        """XADD a tiny entry to the wake stream (capped, expiring): the XREAD in flight returns."""
        try:
            async with self.reader.redis.pipeline(transaction=False) as pipe:
                pipe.xadd(self.wake_key, {"w": "1"}, maxlen=WAKE_MAXLEN, approximate=True)
                pipe.pexpire(self.wake_key, WAKE_TTL_MS)
                await pipe.execute()
        except Exception as error:  # the XREAD then ends at its block time, or fails the same way
            log.debug("stream reader wake failed: %s", type(error).__name__)

    async def _run(self) -> None:
        """Serve the waiters round after round; sleep while there are none; never end on errors."""
        while True:
            if not self.waiters:
                self.event.clear()
                await self.event.wait()
                continue
            try:
                delivered = await self._round()
            except Exception as error:  # noqa: BLE001 - every waiter of the round gets it, the task goes on
                self._fail(error)
                continue
            if delivered:
                await asyncio.sleep(LINGER_S)

    async def _round(self) -> bool:
        """One shared XREAD for every waiter's key, each from the smallest id asked, blocking
        until the soonest deadline (at most `max_block_ms`); then the answers and the expired
        waiters' []. True when it delivered entries to some waiter; raises what the XREAD raised."""
        self.round += 1
        now = time.monotonic()
        sent = {key: min(w.after for w in waiters) for key, waiters in self.waiters.items()}
        deadline = min(w.deadline for waiters in self.waiters.values() for w in waiters)
        block = max(1, min(self.max_block_ms, math.ceil((deadline - now) * 1000)))
        streams: dict[KeyT, StreamIdT] = {key: f"{ms}-{seq}" for key, (ms, seq) in sent.items()}
        streams[self.wake_key] = self.wake_id
        self.inflight, self.inflight_end, self.woken = sent, now + block / 1000, False
        try:
            response = await self.conn.xread(streams, count=self.reader.count, block=block)
        finally:
            self.inflight = None
        if self.failing:
            self.failing = False
            log.info(
                "stream reads from Redis work again", extra={"fields": {"wake_key": self.wake_key}}
            )
        delivered = self._deliver(response, sent)
        now = time.monotonic()
        for waiters in list(self.waiters.values()):
            for waiter in [w for w in waiters if w.deadline <= now]:
                self._resolve(waiter, [])
        return delivered

    def _deliver(self, response: Any, sent: dict[str, StreamId]) -> bool:
        """Give each waiter of the round the entries after its own id; True if any got some."""
        delivered = False
        items = response.items() if isinstance(response, dict) else response or ()
        for name, value in items:
            key = name.decode() if isinstance(name, bytes) else name
            entries = _entries_of(value)
            if not entries:
                continue
            if key == self.wake_key:
                last = entries[-1][0]
                self.wake_id = last.decode() if isinstance(last, bytes) else last
                continue
            floor = sent.get(key)
            if floor is None or key not in self.waiters:
                continue
            ids = [parse_id(entry[0]) for entry in entries]
            for waiter in list(self.waiters[key]):
                if (
                    waiter.after < floor
                ):  # registered during the round, from before what was read: next round
                    continue
                start = bisect.bisect_right(ids, waiter.after)
                if start < len(ids):
                    self._resolve(waiter, entries[start:])
                    delivered = True
        return delivered

    def _fail(self, error: Exception) -> None:
        """Give `error` to every waiter registered before this round; log once per outage. The wake
        id is read again from the start (Redis may have restarted empty, its new ids lower)."""
        self.wake_id = "0-0"
        if not self.failing:
            self.failing = True
            import redis.exceptions  # noqa: PLC0415

            expected = isinstance(error, (redis.exceptions.RedisError, OSError))
            log.warning(
                "stream reads from Redis failing: %s",
                type(error).__name__,
                exc_info=not expected,
                extra={"fields": {"wake_key": self.wake_key, "error": type(error).__name__}},
            )
        for waiters in list(self.waiters.values()):
            for waiter in [w for w in waiters if w.since < self.round]:
                self._resolve(waiter, error=error)

    async def aclose(self, error: BaseException) -> None:
        """Stop the task and pending wakes, fail the waiters with `error`, close the connection."""
        tasks = [t for t in (self.task, *self.wakes) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for waiters in list(self.waiters.values()):
            for waiter in list(waiters):
                self._resolve(waiter, error=error)
        await self.conn.aclose()


class StreamReader:
    """Blocking stream reads of many followers over `shards` dedicated Redis connections.

    `redis` is the replica's `redis.asyncio.Redis` client: its connection settings (socket
    timeouts, retry, db) are copied for the dedicated connections, and its pool carries the
    short wake XADDs. `wake_key` names the wake streams (`<wake_key>:<n>`): make it unique per
    replica. `count` is the XREAD COUNT of every shared read.
    """

    def __init__(self, redis: Any, wake_key: str, *, shards: int = 1, count: int = 512) -> None:
        self.redis = redis
        self.wake_key = wake_key
        self.count = count
        self._closed = False
        self._shards = [_Shard(self, index) for index in range(max(1, shards))]

    async def read(self, key: str, after_id: str, block_ms: int) -> list[tuple[bytes, dict]]:
        """Like `await redis.xread({key: after_id}, count=count, block=block_ms)` for one stream:
        the entries of `key` after `after_id` (bytes entry id, fields dict), waiting up to
        `block_ms` for some; [] when none came in time. Raises the same redis-py errors as a direct
        XREAD would (ConnectionError, TimeoutError) when the shared read fails."""
        import redis.exceptions  # noqa: PLC0415

        if self._closed:
            raise redis.exceptions.ConnectionError("the stream reader is closed")
        shard = self._shards[zlib.crc32(key.encode()) % len(self._shards)]
        loop = asyncio.get_running_loop()
        waiter = _Waiter(
            key,
            parse_id(after_id),
            time.monotonic() + max(block_ms, 0) / 1000,
            loop.create_future(),
            shard.round,
        )
        shard.add(waiter)
        try:
            return await waiter.future
        finally:
            shard.discard(waiter)

    async def aclose(self) -> None:
        """Stop the shards (pending reads raise ConnectionError) and close their connections."""
        import redis.exceptions  # noqa: PLC0415

        self._closed = True
        error = redis.exceptions.ConnectionError("the stream reader is closed")
        await asyncio.gather(*(shard.aclose(error) for shard in self._shards))
