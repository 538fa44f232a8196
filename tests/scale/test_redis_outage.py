"""Redis drops connections while listeners follow runs.

The follower's Redis traffic goes through a TCP proxy that the test cuts: it closes
every open connection and refuses new ones until it is restored. The publisher talks to
Redis directly (or through its own proxy). A follower either resumes at the index it
reached - every event exactly once, in order - or, when Redis stays away longer than
`retry_s`, ends with an `error` event; it never hangs. Skipped without Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any
from urllib.parse import urlsplit

import pytest

from loopline.assistant.v1 import events_pb2
from services.orchestrator.eventlog import StreamInterrupted
from services.orchestrator.eventlog.redis import RedisEventLog, redis_client
from tests.conftest import drop_redis_prefix, redis_url
from tests.scale.conftest import _reachable, no_archive
from tests.tcp_proxy import CuttableProxy, fails_in_time


def _redis_address() -> tuple[str, int]:
    """(host, port) of the test Redis (LOOPLINE_TEST_REDIS_URL); skips the test when it is not
    reachable."""
    target = urlsplit(redis_url())
    host, port = target.hostname or "127.0.0.1", target.port or 6379
    if not _reachable(host, port):
        pytest.skip(f"Redis is not reachable at {host}:{port} (LOOPLINE_TEST_REDIS_URL)")
    return host, port


@pytest.fixture
async def redis_setup():
    """(proxy to Redis, key prefix); skips without Redis."""
    proxy = CuttableProxy(*_redis_address())
    await proxy.start()
    prefix = f"lltest:{uuid.uuid4().hex[:12]}:"
    try:
        yield proxy, prefix
    finally:
        await proxy.stop()
        await drop_redis_prefix(redis_url(), prefix)


def _via(proxy: CuttableProxy) -> str:
    target = urlsplit(redis_url())
    return f"redis://127.0.0.1:{proxy.port}{target.path or '/0'}"


def _chunk(run_id: str, text: str) -> events_pb2.Event:
    return events_pb2.Event(run_id=run_id, response_chunk=events_pb2.ResponseChunkEvent(chunk=text))


async def test_follower_resumes_after_connections_drop_without_gaps_or_duplicates(redis_setup):
    proxy, prefix = redis_setup
    publisher_client, follower_client = redis_client(redis_url()), redis_client(_via(proxy))
    publisher = RedisEventLog(publisher_client, prefix, 10_000, 60, no_archive, retry_s=10)
    follower = RedisEventLog(
        follower_client, prefix, 10_000, 60, no_archive, retry_s=10, block_ms=500
    )
    run_id = str(uuid.uuid4())
    try:
        publisher.open(run_id)
        for i in range(5):
            publisher.append(_chunk(run_id, f"before-{i}"))
        await publisher.flush(run_id)
        received: list[events_pb2.Event] = []
        got_five = asyncio.Event()

        async def listen() -> None:
            async for event in follower.follow(run_id, 0):
                received.append(event)
                if len(received) == 5:
                    got_five.set()

        listener = asyncio.create_task(listen())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(got_five.wait(), 10)
        assert len(received) == 5
        proxy.cut()  # the follower's connection is dropped in the middle of XREAD BLOCK
        for i in range(5):
            publisher.append(_chunk(run_id, f"during-{i}"))
        await publisher.flush(run_id)
        await asyncio.sleep(1.5)  # Redis stays unreachable for the follower meanwhile
        proxy.restore()
        publisher.append(events_pb2.Event(run_id=run_id, done=events_pb2.DoneEvent(response="ok")))
        publisher.close(run_id)
        await asyncio.wait_for(listener, 15)
        assert [event.seq for event in received] == list(range(11))
        assert [event.response_chunk.chunk for event in received[:10]] == [
            f"before-{i}" for i in range(5)
        ] + [f"during-{i}" for i in range(5)]
        assert received[-1].WhichOneof("payload") == "done"
    finally:
        await publisher.aclose()
        await publisher_client.aclose()
        await follower_client.aclose()


async def _follower_ends_with_the_reconnect_frame(
    prefix: str,
    follower_url: str,
    outage,
    limit_s: float,  # noqa: ANN001
    **client_options: Any,
) -> None:
    """A follower through `follower_url` gets one event, then `outage()` breaks its Redis: the
    follower ends within `limit_s` seconds with the `error` event naming where to resume."""
    publisher_client, follower_client = (
        redis_client(redis_url()),
        redis_client(follower_url, **client_options),
    )
    publisher = RedisEventLog(publisher_client, prefix, 10_000, 60, no_archive, retry_s=10)
    follower = RedisEventLog(
        follower_client,
        prefix,
        10_000,
        60,
        no_archive,
        retry_s=1.0,
        block_ms=int(client_options.get("block_ms", 500)),
    )
    run_id = str(uuid.uuid4())
    try:
        publisher.open(run_id)
        publisher.append(_chunk(run_id, "only"))
        await publisher.flush(run_id)
        received: list[events_pb2.Event] = []
        got_one = asyncio.Event()

        async def listen() -> None:
            async for event in follower.follow(run_id, 0):
                received.append(event)
                got_one.set()

        listener = asyncio.create_task(listen())
        await got_one.wait()
        outage()
        interrupted = await fails_in_time(lambda: listener, limit_s)  # bounded: never hangs
        assert isinstance(interrupted, StreamInterrupted) and interrupted.index == 1, (
            interrupted
        )  # says where to resume
        assert interrupted.message.endswith("reconnect with ?after=1")
        assert [event.WhichOneof("payload") for event in received] == ["response_chunk"]
    finally:
        await publisher.aclose()
        await publisher_client.aclose()
        await follower_client.aclose()


async def test_follower_ends_with_an_error_event_when_redis_stays_away(redis_setup):
    proxy, prefix = redis_setup
    await _follower_ends_with_the_reconnect_frame(prefix, _via(proxy), proxy.cut, 8)


async def test_publisher_keeps_order_through_an_outage_and_flush_is_bounded(redis_setup):
    proxy, prefix = redis_setup
    publisher_client, reader_client = redis_client(_via(proxy)), redis_client(redis_url())
    publisher = RedisEventLog(publisher_client, prefix, 10_000, 60, no_archive, retry_s=10)
    reader = RedisEventLog(reader_client, prefix, 10_000, 60, no_archive, retry_s=10)
    run_id = str(uuid.uuid4())
    try:
        publisher.open(run_id)
        publisher.append(_chunk(run_id, "a"))
        await publisher.flush(run_id)
        proxy.cut()
        publisher.append(_chunk(run_id, "b"))  # queued while Redis is unreachable
        publisher.append(_chunk(run_id, "c"))
        await asyncio.sleep(1.0)
        proxy.restore()
        publisher.append(events_pb2.Event(run_id=run_id, done=events_pb2.DoneEvent(response="ok")))
        publisher.close(run_id)
        await asyncio.wait_for(publisher.flush(run_id), 15)
        stored = await reader.events_of(run_id)
        assert [event.seq for event in stored] == [0, 1, 2, 3]
        assert [event.response_chunk.chunk for event in stored[:3]] == ["a", "b", "c"]
        assert stored[-1].WhichOneof("payload") == "done"
    finally:
        await publisher.aclose()
        await publisher_client.aclose()
        await reader_client.aclose()


async def test_an_outage_longer_than_retry_s_loses_no_event_and_the_stream_still_ends(redis_setup):
    # past retry_s the publisher keeps what it holds (the run's end among it): dropped, the stream
    # would stay without its end and its TTL for good, listeners would wait forever and the
    # archive would lack the end
    proxy, prefix = redis_setup
    publisher_client, reader_client = redis_client(_via(proxy)), redis_client(redis_url())
    publisher = RedisEventLog(publisher_client, prefix, 10_000, 60, no_archive, retry_s=1.0)
    reader = RedisEventLog(reader_client, prefix, 10_000, 60, no_archive, retry_s=10, block_ms=500)
    run_id = str(uuid.uuid4())
    archive_copy: list[events_pb2.Event] | None = None
    try:
        publisher.open(run_id)
        publisher.append(_chunk(run_id, "a"))
        await publisher.flush(run_id)
        proxy.cut()
        for text in ("b", "c"):
            publisher.append(_chunk(run_id, text))
        publisher.append(events_pb2.Event(run_id=run_id, done=events_pb2.DoneEvent(response="ok")))
        publisher.close(run_id)
        local: list[events_pb2.Event] = []

        async def listen_locally() -> None:
            async for event in publisher.follow(run_id, 0):
                local.append(event)

        with pytest.raises(
            StreamInterrupted
        ) as interrupted:  # a follower of the owner still ends, naming where to resume
            await asyncio.wait_for(listen_locally(), 10)
        assert [e.WhichOneof("payload") for e in local] == [
            "response_chunk"
        ] and interrupted.value.index == 1
        await asyncio.sleep(1.5)  # past retry_s
        archive_copy = publisher.owned_events(
            run_id
        )  # what TurnRunner.archive writes, without Redis
        publisher.forget(
            run_id
        )  # the archive's forget while items are held: kept until they are written
        proxy.restore()

        async def listen_again() -> list[events_pb2.Event]:
            return [event async for event in reader.follow(run_id, 1)]

        resumed = await asyncio.wait_for(
            listen_again(), 10
        )  # from where it ended: the rest, then the end
        assert [e.seq for e in resumed] == [1, 2, 3] and resumed[-1].WhichOneof("payload") == "done"
        assert archive_copy is not None and [e.seq for e in archive_copy] == [0, 1, 2, 3]
        stream, _ = reader._keys(run_id)
        assert 0 < await reader_client.pttl(stream) <= 60_000  # closed: it expires
        for _ in range(100):
            if publisher.owned_events(run_id) is None:
                break
            await asyncio.sleep(0.05)
        assert (
            publisher.owned_events(run_id) is None
        )  # the writer forgot itself once all was written
    finally:
        await publisher.aclose()
        await publisher_client.aclose()
        await reader_client.aclose()


async def test_billing_rate_counters_answer_at_once_after_redis_comes_back(redis_setup):
    # after a Redis outage the first Admit on each billing replica succeeds: a pooled connection
    # Redis closed is retried, not used once more and answered 503
    from services.billing.rates import RateLimiter

    proxy, prefix = redis_setup
    limiter = RateLimiter(_via(proxy), key_prefix=f"{prefix}billing")
    try:
        assert (await limiter.hit("org", "sync_exec", "100/minute")).allowed
        proxy.cut()
        await asyncio.sleep(0.3)
        proxy.restore()
        decision = await limiter.hit("org", "sync_exec", "100/minute")
        assert decision.allowed and decision.remaining == 98
    finally:
        await limiter.close()


async def test_a_follower_of_a_redis_that_stops_answering_ends_with_the_reconnect_frame(
    redis_setup,
):
    # a Redis that drops packets (not refuses them) must not hold a follower for good: each read
    # waits 0.7 s at most, and the follower retries for retry_s, then ends
    proxy, prefix = redis_setup

    def blackhole() -> None:
        proxy.swallowing = True

    await _follower_ends_with_the_reconnect_frame(
        prefix, _via(proxy), blackhole, 6, block_ms=200, timeout_s=0.5
    )


async def test_billing_rate_counters_of_a_redis_that_stops_answering_are_unavailable_in_time(
    redis_setup,
):
    # an Admit on a Redis that drops packets must not wait for good (a read timeout, bounded
    # attempts)
    from services.billing.rates import RateLimiter
    from services.common import db

    proxy, prefix = redis_setup
    limiter = RateLimiter(_via(proxy), key_prefix=f"{prefix}billing", timeout_s=0.5)
    try:
        assert (await limiter.hit("org", "sync_exec", "100/minute")).allowed
        proxy.swallowing = True
        error = await fails_in_time(lambda: limiter.hit("org", "sync_exec", "100/minute"), 2)
        assert db.unavailable_store(error) == "Redis", repr(error)
    finally:
        proxy.swallowing = False
        await limiter.close()


async def test_an_archived_run_is_served_whole_while_redis_is_away(redis_setup):
    # listeners of a run ended and archived during a Redis outage are served it from the
    # database, not sent a reconnect frame after retry_s on every reconnect until Redis is back
    proxy, prefix = redis_setup
    archive: list[events_pb2.Event] = []

    async def archived(run_id: str) -> list[events_pb2.Event]:
        return list(archive)

    owner_client, other_client = redis_client(_via(proxy)), redis_client(_via(proxy))
    owner = RedisEventLog(owner_client, prefix, 10_000, 60, archived, retry_s=30)
    other = RedisEventLog(other_client, prefix, 10_000, 60, archived, retry_s=30, block_ms=200)
    run_id = str(uuid.uuid4())
    try:
        owner.open(run_id)
        owner.append(_chunk(run_id, "a"))
        await owner.flush(run_id)
        proxy.cut()
        owner.append(events_pb2.Event(run_id=run_id, done=events_pb2.DoneEvent(response="a")))
        owner.close(run_id)
        archive.extend(
            owner.owned_events(run_id) or []
        )  # TurnRunner.archive: from the owner's copy, then forget
        owner.forget(run_id, archived=True)

        async def listen(log: RedisEventLog) -> list[events_pb2.Event]:
            return [event async for event in log.follow(run_id, 0)]

        for log in (owner, other):
            events = await asyncio.wait_for(listen(log), 5)
            assert [(e.seq, e.WhichOneof("payload")) for e in events] == [
                (0, "response_chunk"),
                (1, "done"),
            ]
    finally:
        proxy.restore()
        await owner.aclose()
        await owner_client.aclose()
        await other_client.aclose()


async def test_events_refused_after_an_outage_are_never_served_by_their_writer(redis_setup):
    # a replica cut off past its run's lease writes its held events once back; the stream refuses
    # them (another replica ended the run), and its own listeners are not served them either:
    # they are in neither the stream nor the archive
    proxy, prefix = redis_setup
    owner_client, other_client = redis_client(_via(proxy)), redis_client(redis_url())
    owner = RedisEventLog(owner_client, prefix, 10_000, 60, no_archive, retry_s=30)
    other = RedisEventLog(other_client, prefix, 10_000, 60, no_archive, retry_s=30, block_ms=200)
    run_id = str(uuid.uuid4())
    try:
        owner.open(run_id)
        owner.append(_chunk(run_id, "a"))
        await owner.flush(run_id)
        proxy.cut()
        owner.append(_chunk(run_id, "held"))
        await asyncio.sleep(0.3)  # the write fails and waits for Redis
        reaped = events_pb2.Event(run_id=run_id, done=events_pb2.DoneEvent(response="", error=True))
        await other.append_after_end(
            run_id, reaped
        )  # the other replica's reaper ended the run meanwhile
        proxy.restore()
        await owner.flush(run_id, 10)

        async def listen() -> list[events_pb2.Event]:
            return [event async for event in owner.follow(run_id, 0)]

        events = await asyncio.wait_for(listen(), 10)
        assert [(e.seq, e.WhichOneof("payload")) for e in events] == [
            (0, "response_chunk"),
            (1, "done"),
        ]
        assert owner.owned_events(run_id) is None  # its copy is no longer the stream's
    finally:
        await owner.aclose()
        await owner_client.aclose()
        await other_client.aclose()
