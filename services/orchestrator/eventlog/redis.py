"""The Redis run backend: run events in Redis Streams, chat claims and cancel requests in Redis
keys, shared by any number of orchestrator replicas (LOOPLINE_REDIS_URL set).

- Run events: `RedisEventLog`. The owner writes (redis_writer.py), serves followers in its own
  process from its copy as soon as each event is stored (no Redis read), and archives from that
  copy. Other processes follow the stream with `XREAD BLOCK` through the replica's shared
  `StreamReader` (reader.py). The orchestrator database keeps the durable copy (`run_events`,
  archive.py), which serves listeners once the stream is gone.
- Chat claims: `SET <prefix>claim:<chat_id> <token> NX PX claim_ttl_ms`, released by a
  compare-and-delete script; the TTL frees the chat if the holder crashed.
- Cancel requests: `SET <prefix>cancel:<run_id> <reason> EX 300` plus `PUBLISH
  <prefix>cancels "<run_id>\\n<reason>"`. Every replica subscribes and cancels its own run at
  once; the flags of active runs are also polled every `cancel_poll_s` (1 s), so a lost
  message still stops the run within a second.

A follower that cannot reach Redis for `redis_retry_s` raises StreamInterrupted (so a listener
never hangs), and otherwise resumes at the index it reached (no gaps, no duplicates).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncGenerator
from typing import Any

from loopline.assistant.v1 import events_pb2
from services.common import db, metrics
from services.orchestrator.eventlog import (
    UNREACHABLE,
    ArchiveLoader,
    CancelHandler,
    RunBackend,
    StreamInterrupted,
    flatten,
    is_terminal,
)
from services.orchestrator.eventlog.reader import StreamReader
from services.orchestrator.eventlog.redis_writer import RedisStreamWriter, redis_errors

log = logging.getLogger(__name__)

XREAD_BLOCK_MS = 2000  # RedisEventLog's default wait of one XREAD BLOCK

CANCEL_FLAG_TTL_S = 300

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisEventLog(RedisStreamWriter):
    """Run events in Redis Streams: the owner's side (`RedisStreamWriter`) plus anyone's side,
    which reads, follows and appends after the end.

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
        super().__init__(redis, prefix, max_len, ttl_s, retry_s)
        self.archive_loader = archive_loader
        self.block_ms = block_ms
        self.open_wait_s = open_wait_s
        # the replica's StreamReader, shared by its followers (RedisBackend)
        self.reader: StreamReader | None = None

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

    def follow(self, run_id: str, after: int = 0) -> AsyncGenerator[events_pb2.Event, None]:
        """Yield the run's events from index `after`, then live ones, until it ends (see
        `follow_batches`)."""
        return flatten(self.follow_batches(run_id, after))

    async def follow_batches(
        self, run_id: str, after: int = 0
    ) -> AsyncGenerator[list[events_pb2.Event], None]:
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
            # when this follower began waiting on a writer that cannot reach Redis
            stalled_since: float | None = None
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
                    # ended without a terminal event here, or a late listener: what another
                    # replica appended is in the stream
                    break
                if writer.task is None or writer.task.done():  # forgotten or stopped: the stream
                    break  # has the rest
                if writer.failing_since is None:
                    stalled_since = None
                else:  # Redis away longer than retry_s: end as a follower through Redis does
                    stalled_since = stalled_since or time.monotonic()
                    if time.monotonic() - stalled_since > self.retry_s:
                        raise StreamInterrupted(index, UNREACHABLE)
                # looks at the outage's length at least once a second
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await asyncio.shield(writer.waiter())
        async for batch in self._follow_stream(run_id, index):
            yield batch

    async def _follow_stream(
        self, run_id: str, index: int
    ) -> AsyncGenerator[list[events_pb2.Event], None]:
        """`follow_batches` through Redis (a list per `XREAD`): `XREAD BLOCK` from `index`; the
        meta hash is read at the start, when a read returns nothing and after a terminal event
        (is the run closed?).

        A run with neither a stream nor an archive is waited for: `open_wait_s` before its
        stream was seen (it may not have started), `retry_s` once it was (Redis lost it: its
        owner writes it again from its copy within a second, `restore_lost`, or the archive
        comes with the run's end). Then, as after `retry_s` without Redis, the follower ends
        with StreamInterrupted naming `index`: never without the run's end."""
        stream, _ = self._keys(run_id)
        errors = redis_errors()
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
                metrics.count_storage_error("orchestrator", "redis", "unavailable")
                archived = await self._archive_or_nothing(run_id)
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

    async def _archive_or_nothing(self, run_id: str) -> list[events_pb2.Event]:
        """The run's archive while Redis is away (an ended run needs no Redis: the database has it
        whole); [] when the database is away too (the follower retries both)."""
        try:
            return await self.archive_loader(run_id)
        except Exception:
            return []

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
    payload = fields[b"e"] if b"e" in fields else fields["e"]
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
        self.redis = redis_client(url, max_connections=max_connections)
        self.prefix = prefix
        self.claim_ttl_ms = max(1, int(claim_ttl_s * 1000))
        self.events: RedisEventLog = RedisEventLog(
            self.redis, prefix, max_len, ttl_s, archive_loader, retry_s=retry_s
        )
        self.events.reader = StreamReader(
            self.redis, f"{prefix}reader:{secrets.token_hex(6)}", shards=readers
        )
        self._release = self.redis.register_script(_RELEASE)
        self._releasing: set[asyncio.Task[None]] = set()  # claims of unknown outcome (`try_claim`)
        self._channel = f"{prefix}cancels"
        self._listener: asyncio.Task[None] | None = None
        self._on_cancel: CancelHandler | None = None

    async def start(self, on_cancel: CancelHandler) -> None:
        """Check Redis is reachable (else CannotStart naming LOOPLINE_REDIS_URL's host and port,
        never its password), then subscribe to the cancel channel in
        a background task."""
        try:
            await self.redis.ping()
        except redis_errors() as error:
            from services.common.runner import CannotStart

            where = self.redis.connection_pool.connection_kwargs
            raise CannotStart(
                f"Redis at {where.get('host', '?')}:{where.get('port', '?')} (LOOPLINE_REDIS_URL) "
                f"does not answer ({type(error).__name__})"
            ) from None
        self._on_cancel = on_cancel
        subscribed = asyncio.Event()
        self._listener = asyncio.create_task(self._listen(subscribed), name="cancel-listener")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await subscribed.wait()

    async def _listen(self, subscribed: asyncio.Event) -> None:
        """Deliver cancel messages to the handler; resubscribe after connection errors."""
        errors = redis_errors()
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
        if self.events.reader is not None:
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
        a claim no one holds, blocking every retry of that start (its request_id) or turn on
        that chat until it expires. Its token is then released in the background
        (`_release_unknown`)."""
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
            except redis_errors():
                pass  # Redis still away: look again
            await asyncio.sleep(1.0)

    async def release_claim(self, chat_id: str, token: str) -> None:
        """Delete the claim only if `token` still holds it."""
        try:
            await self._release(keys=[f"{self.prefix}claim:{chat_id}"], args=[token])
        except redis_errors():
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
