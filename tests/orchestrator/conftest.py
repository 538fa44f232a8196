"""Fixtures of the orchestrator's tests."""

from __future__ import annotations

import uuid
from urllib.parse import urlsplit

import pytest

from tests.conftest import drop_redis_prefix, redis_url, start_stack, stop_stack
from tests.scale.conftest import _reachable


@pytest.fixture
async def services_with_redis_events(tmp_path):
    """The four services with the orchestrator's run events in Redis (its own key prefix)."""
    target = urlsplit(redis_url())
    if not _reachable(target.hostname or "127.0.0.1", target.port or 6379):
        pytest.skip("Redis is not reachable (LOOPLINE_TEST_REDIS_URL)")
    prefix = f"lltest:{uuid.uuid4().hex[:12]}:"
    running = await start_stack(
        tmp_path, orchestrator={"redis_url": redis_url(), "redis_key_prefix": prefix}
    )
    try:
        yield running
    finally:
        await stop_stack(running)
        await drop_redis_prefix(redis_url(), prefix)
