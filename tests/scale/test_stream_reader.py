"""`StreamReader`: many followers' blocking stream reads over a few dedicated Redis connections.

Against the test Redis (LOOPLINE_TEST_REDIS_URL), each test under a key prefix of its own;
skipped without Redis and outside the PostgreSQL + Redis pass (tests/scale/conftest.py).
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis
import redis.exceptions

from services.common import db
from services.orchestrator.eventlog.reader import StreamReader
from services.orchestrator.eventlog.redis import redis_client
from tests.conftest import drop_redis_prefix, redis_url
from tests.scale.conftest import fresh_redis_prefix
from tests.tcp_proxy import CuttableProxy


@pytest.fixture
async def prefix():
    """A fresh key prefix on the test Redis, its keys deleted afterwards."""
    value = fresh_redis_prefix()
    try:
        yield value
    finally:
        await drop_redis_prefix(redis_url(), value)


@pytest.fixture
async def direct():
    """A plain client of the test Redis (publishing, direct XREADs)."""
    client = redis_client(redis_url())
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def reader(prefix, direct):
    """A StreamReader on `direct` (one shard), closed afterwards."""
    value = StreamReader(direct, f"{prefix}wake")
    try:
        yield value
    finally:
        await value.aclose()


async def _add(client, key: str, first: int, last: int) -> None:
    """XADD entries `0-first`..`0-last` with field n = their number, at once (MULTI/EXEC)."""
    async with client.pipeline(transaction=True) as pipe:
        for n in range(first, last + 1):
            pipe.xadd(key, {"n": str(n)}, id=f"0-{n}")
        await pipe.execute()


def _numbers(entries) -> list[int]:  # noqa: ANN001
    return [int(fields[b"n"]) for _, fields in entries]


async def _started(coro) -> asyncio.Task:  # noqa: ANN001
    """A task of `coro`, given time to register and be part of the XREAD in flight."""
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0.1)
    assert not task.done()
    return task


async def test_entries_as_a_direct_xread(prefix, direct, reader):
    key = f"{prefix}s"
    await _add(direct, key, 1, 5)
    [(_, expected)] = await direct.xread({key: "0-2"}, count=512, block=100)
    assert await reader.read(key, "0-2", 100) == expected
    assert _numbers(expected) == [3, 4, 5]
    started = time.monotonic()
    assert await reader.read(key, "0-5", 150) == []
    assert 0.14 <= time.monotonic() - started < 0.6
    small = StreamReader(direct, f"{prefix}wake2", count=2)
    try:
        assert _numbers(await small.read(key, "0", 100)) == [1, 2]
    finally:
        await small.aclose()


async def test_a_new_key_wakes_the_read_in_flight(prefix, direct, reader):
    first, second = f"{prefix}a", f"{prefix}b"
    waiting = await _started(reader.read(first, "0-0", 5000))  # the shard blocks on `first` alone
    late = await _started(reader.read(second, "0-0", 5000))
    await _add(direct, second, 1, 1)
    added = time.monotonic()
    assert _numbers(await late) == [1]
    assert time.monotonic() - added < 0.2
    await _add(direct, first, 1, 2)
    assert _numbers(await waiting) == [1, 2]


async def test_an_older_id_on_a_key_in_flight_is_served_at_once(prefix, direct, reader):
    key = f"{prefix}s"
    await _add(direct, key, 1, 10)
    ahead = await _started(reader.read(key, "0-10", 5000))
    started = time.monotonic()
    assert _numbers(await reader.read(key, "0-3", 5000)) == list(range(4, 11))
    assert time.monotonic() - started < 0.2
    await _add(direct, key, 11, 11)
    assert _numbers(await ahead) == [11]


async def test_a_waiter_older_than_the_read_in_flight_gets_no_gap(prefix, direct, reader):
    """Without a wake (disabled here), entries the XREAD in flight returns start after its own
    id: a waiter registered meanwhile from an older id must get the entries in between too."""

    async def no_wake() -> None:
        return None

    reader._shards[0]._wake = no_wake
    key = f"{prefix}s"
    await _add(direct, key, 1, 10)
    ahead = await _started(reader.read(key, "0-10", 5000))
    behind = await _started(reader.read(key, "0-3", 5000))
    await _add(direct, key, 11, 11)
    assert _numbers(await ahead) == [11]
    assert _numbers(await behind) == list(range(4, 12))


async def test_waiters_of_one_key_each_get_exactly_their_entries(prefix, direct, reader):
    key = f"{prefix}s"
    total = 300

    async def follow(start: int) -> list[int]:
        seen, after = [], start
        while after < total:
            entries = await reader.read(key, f"0-{after}", 2000)
            seen.extend(_numbers(entries))
            after = seen[-1] if seen else after
        return seen

    followers = [asyncio.ensure_future(follow(start)) for start in range(0, 40, 3)]
    for first in range(1, total + 1, 7):
        await _add(direct, key, first, min(first + 6, total))
        await asyncio.sleep(0.002)
    results = await asyncio.wait_for(asyncio.gather(*followers), 20)
    for start, seen in zip(range(0, 40, 3), results, strict=True):
        assert seen == list(range(start + 1, total + 1))


async def test_300_followed_streams_over_a_pool_of_10(prefix, direct):
    pool = aioredis.BlockingConnectionPool.from_url(
        redis_url(), max_connections=10, timeout=None, **db.redis_client_options(7)
    )
    client = aioredis.Redis(connection_pool=pool)
    reader = StreamReader(client, f"{prefix}wake", shards=2)
    keys, per_key = [f"{prefix}run:{n}" for n in range(300)], 12

    async def follow(key: str) -> list[int]:
        seen: list[int] = []
        while len(seen) < per_key:
            seen.extend(_numbers(await reader.read(key, f"0-{len(seen)}", 2000)))
        return seen

    try:
        followers = [asyncio.ensure_future(follow(key)) for key in keys]
        await asyncio.sleep(0.2)
        for n in range(1, per_key + 1, 3):
            for key in keys:
                await _add(direct, key, n, n + 2)
        results = await asyncio.wait_for(asyncio.gather(*followers), 30)
        assert all(seen == list(range(1, per_key + 1)) for seen in results)
        assert len(pool._in_use_connections) + len(pool._available_connections) <= 10
    finally:
        await reader.aclose()
        await client.aclose()


async def test_a_cancelled_waiter_does_not_break_the_others(prefix, direct, reader):
    key, other = f"{prefix}a", f"{prefix}b"
    leaving = await _started(reader.read(key, "0-0", 5000))
    staying = await _started(reader.read(key, "0-0", 5000))
    elsewhere = await _started(reader.read(other, "0-0", 5000))
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    await _add(direct, key, 1, 2)
    await _add(direct, other, 1, 1)
    assert _numbers(await staying) == [1, 2]
    assert _numbers(await elsewhere) == [1]
    assert _numbers(await reader.read(key, "0-1", 1000)) == [2]
    await asyncio.sleep(0.05)
    assert (
        reader._shards[0].waiters == {} and reader._shards[0].inflight is None
    )  # idle: no XREAD sent


async def test_a_broken_connection_raises_then_reads_work_again(prefix, direct):
    target = urlsplit(redis_url())
    proxy = CuttableProxy(target.hostname or "127.0.0.1", target.port or 6379)
    await proxy.start()
    client = redis_client(f"redis://127.0.0.1:{proxy.port}{target.path or '/0'}")
    reader = StreamReader(client, f"{prefix}wake")
    key = f"{prefix}s"
    errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
    try:
        await _add(direct, key, 1, 1)
        assert _numbers(await reader.read(key, "0-0", 1000)) == [1]
        pending = await _started(reader.read(key, "0-1", 5000))
        proxy.cut()
        with pytest.raises(errors):
            await asyncio.wait_for(pending, 10)
        with pytest.raises(errors):
            await asyncio.wait_for(reader.read(key, "0-1", 1000), 10)
        proxy.restore()
        await _add(direct, key, 2, 2)
        assert _numbers(await asyncio.wait_for(reader.read(key, "0-1", 1000), 10)) == [2]
        late = await _started(reader.read(f"{prefix}t", "0-0", 5000))  # wakes work again too
        await _add(direct, f"{prefix}t", 1, 1)
        assert _numbers(await asyncio.wait_for(late, 0.5)) == [1]
    finally:
        await reader.aclose()
        await client.aclose()
        await proxy.stop()


async def test_close_ends_pending_reads(prefix, direct):
    reader = StreamReader(direct, f"{prefix}wake")
    pending = await _started(reader.read(f"{prefix}s", "0-0", 5000))
    await reader.aclose()
    with pytest.raises(redis.exceptions.ConnectionError):
        await pending
    with pytest.raises(redis.exceptions.ConnectionError):
        await reader.read(f"{prefix}s", "0-0", 100)
