"""Rate limits: moving window per (org, rate class), memory:// or Redis."""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest

from services.billing.rates import RateLimiter

BACKENDS = ["memory://"] + (
    [os.environ["LOOPLINE_TEST_REDIS_URL"]] if os.environ.get("LOOPLINE_TEST_REDIS_URL") else []
)


@pytest.fixture(params=BACKENDS, ids=lambda url: url.split(":", 1)[0])
async def limiter(request):
    limiter = RateLimiter(request.param, key_prefix=f"test-{uuid.uuid4().hex}")
    try:
        yield limiter
    finally:
        await limiter.close()


async def test_a_burst_across_a_window_boundary_never_passes_more_than_the_limit(limiter):
    first = [await limiter.hit("org", "sync_exec", "3/second") for _ in range(3)]
    assert all(d.allowed for d in first) and [d.remaining for d in first] == [2, 1, 0]
    await asyncio.sleep(0.6)  # a fixed window could have rolled over here; a moving one has not
    late = await limiter.hit("org", "sync_exec", "3/second")
    assert not late.allowed and late.remaining == 0 and late.reset_seconds >= 1
    await asyncio.sleep(0.5)
    assert (await limiter.hit("org", "sync_exec", "3/second")).allowed


async def test_rate_limits_are_per_org_and_rate_class(limiter):
    assert (await limiter.hit("a", "sync_exec", "1/minute")).allowed
    assert not (await limiter.hit("a", "sync_exec", "1/minute")).allowed
    assert (await limiter.hit("b", "sync_exec", "1/minute")).allowed
    assert (await limiter.hit("a", "async_exec", "1/minute")).allowed
    unlimited = await limiter.hit("a", "sync_exec", None)
    assert unlimited.allowed and unlimited.limit == 0


async def test_peek_does_not_count(limiter):
    await limiter.hit("a", "sync_exec", "2/minute")
    for _ in range(3):
        assert (await limiter.peek("a", "sync_exec", "2/minute")).remaining == 1
