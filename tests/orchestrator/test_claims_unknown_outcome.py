"""A claim whose SET got no answer is released once Redis applies it (Redis backend).

Turn starts sent while Redis stalls take their request_id's claim with `SET NX PX 60000`; the
gateway's deadline cancels the calls, but Redis applies the SETs when it comes back, under
tokens no one holds, so every retry of those starts would wait (504, 409, 504) until the
claims expire, 60 s later. A claim of unknown outcome is released in the background as soon
as it shows up. Skipped without Redis.
"""

from __future__ import annotations

import asyncio
import uuid
from urllib.parse import urlsplit

import pytest

from services.orchestrator.eventlog.redis import RedisBackend
from tests.conftest import drop_redis_prefix, redis_url
from tests.scale.conftest import _reachable, no_archive


@pytest.fixture
async def backend():
    target = urlsplit(redis_url())
    if not _reachable(target.hostname or "127.0.0.1", target.port or 6379):
        pytest.skip("Redis is not reachable (LOOPLINE_TEST_REDIS_URL)")
    prefix = f"lltest:{uuid.uuid4().hex[:12]}:"
    running = RedisBackend(redis_url(), prefix, no_archive, claim_ttl_s=60)
    try:
        yield running
    finally:
        await running.close()
        await drop_redis_prefix(redis_url(), prefix)


async def _released(backend: RedisBackend, name: str, within: float) -> bool:
    deadline = asyncio.get_running_loop().time() + within
    while asyncio.get_running_loop().time() < deadline:
        token = await backend.try_claim(name)
        if token is not None:
            await backend.release_claim(name, token)
            return True
        await asyncio.sleep(0.1)
    return False


@pytest.mark.parametrize("late_s", [0.0, 1.5], ids=["applied-answer-lost", "applied-late"])
async def test_a_claim_whose_set_got_no_answer_is_released_when_it_shows_up(
    backend, monkeypatch, late_s
):
    real_set = backend.redis.set
    pending: list[asyncio.Task] = []

    async def unanswered(
        *args, **kwargs
    ):  # the SET reaches Redis (now or later); its answer never comes back
        async def apply() -> None:
            await asyncio.sleep(late_s)
            await real_set(*args, **kwargs)

        pending.append(asyncio.create_task(apply()))
        if not late_s:
            await pending[-1]
        raise asyncio.CancelledError  # the caller's deadline

    monkeypatch.setattr(backend.redis, "set", unanswered)
    with pytest.raises(asyncio.CancelledError):
        await backend.try_claim("request:abc")
    monkeypatch.undo()
    await asyncio.gather(*pending)
    assert await _released(backend, "request:abc", within=5), "the orphaned claim blocked the retry"


async def test_a_claim_held_by_another_request_is_left_alone(backend, monkeypatch):
    other = await backend.try_claim("chat-1")
    assert other is not None

    async def lost(*args, **kwargs):
        raise ConnectionError("Redis went away")  # this SET never arrived

    monkeypatch.setattr(backend.redis, "set", lost)
    with pytest.raises(ConnectionError):
        await backend.try_claim("chat-1")
    monkeypatch.undo()
    await asyncio.sleep(1.5)
    assert await backend.try_claim("chat-1") is None  # still the other request's
    await backend.release_claim("chat-1", other)
