"""Fault-suite fixtures: every test gets its own redis-server, fresh PostgreSQL databases and the
services as real processes (tests/faults/cluster.py).

Runs in the PostgreSQL pass only (LOOPLINE_TEST_BACKEND=postgres: `make test-faults`), like
tests/scale; `make test` (SQLite) skips it at once, and `make test-pg` leaves it to its own
target (`--ignore=tests/faults`). Skipped with the reason when PostgreSQL cannot be reached or
/usr/bin/redis-server is missing. The system Redis (LOOPLINE_TEST_REDIS_URL) is never used.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest
from sqlalchemy.engine import make_url

from tests.conftest import postgres_url, selected_backend
from tests.faults.cluster import FaultCluster, make_cluster, stop_cluster
from tests.faults.redis_server import REDIS_SERVER
from tests.scale.conftest import _reachable


def _unavailable() -> str | None:
    pg = make_url(postgres_url())
    if not _reachable(pg.host or "127.0.0.1", pg.port or 5432):
        where = f"{pg.host}:{pg.port or 5432}"
        return f"PostgreSQL is not reachable at {where} (LOOPLINE_TEST_POSTGRES_URL)"
    if not os.access(REDIS_SERVER, os.X_OK):
        return f"{REDIS_SERVER} is not installed (the fault suite starts a Redis server per test)"
    return None


@pytest.fixture(autouse=True)
def _postgres_pass_only() -> None:
    if selected_backend() != "postgres":
        pytest.skip(
            "fault tests run real processes on PostgreSQL + Redis: "
            "LOOPLINE_TEST_BACKEND=postgres (make test-faults)"
        )


@pytest.fixture
async def faults(tmp_path) -> AsyncIterator[FaultCluster]:
    """Fresh databases, a Redis server of this test's own and an owner's key; the test starts
    the services (`await faults.start_default(...)`). Everything is killed at the end."""
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    cluster = await make_cluster(tmp_path)
    try:
        yield cluster
    finally:
        await stop_cluster(cluster)
