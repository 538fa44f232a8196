"""The backend seam's claims and cancel requests, on memory and on a real Redis.

Claims are atomic (one of two racing takers wins, also across clients = replicas), are
released only by their holder, and expire (a crashed holder cannot block a chat). A cancel
request reaches the handler of another client through pub/sub and stays visible as a
flag for polling. `migrate` works on a fresh PostgreSQL database for every service.
Redis/PostgreSQL tests are skipped, with the reason, when the server is unreachable.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid

import pytest

from services.orchestrator.eventlog.memory import MemoryBackend
from services.orchestrator.eventlog.redis import RedisBackend
from tests.conftest import SERVICES, drop_databases, drop_redis_prefix, redis_url
from tests.scale.conftest import ROOT, fresh_redis_prefix, no_archive, unavailable_reason


@pytest.fixture
async def redis_pair():
    """Two RedisBackends (two replicas) sharing a fresh key prefix, claims expiring after 0.3 s."""
    prefix = fresh_redis_prefix()
    pair = [RedisBackend(redis_url(), prefix, no_archive, claim_ttl_s=0.3) for _ in range(2)]
    try:
        yield pair
    finally:
        for backend in pair:
            await backend.close()
        await drop_redis_prefix(redis_url(), prefix)


async def test_memory_claims_are_exclusive_and_released_by_their_holder():
    backend = MemoryBackend()
    token = await backend.try_claim("chat")
    assert token and await backend.try_claim("chat") is None
    await backend.release_claim("chat", "someone-else")
    assert await backend.try_claim("chat") is None
    await backend.release_claim("chat", token)
    assert await backend.try_claim("chat")


async def test_redis_claims_are_exclusive_across_replicas_and_expire(redis_pair):
    a, b = redis_pair
    await a.start(lambda run_id, reason: asyncio.sleep(0))
    results = await asyncio.gather(*(backend.try_claim("chat-1") for backend in (a, b, a, b)))
    winners = [token for token in results if token]
    assert len(winners) == 1
    await b.release_claim("chat-1", "not-the-token")  # not the holder: no effect
    assert await b.try_claim("chat-1") is None
    await asyncio.sleep(0.45)  # the holder "crashed": the claim expires by itself
    assert await b.try_claim("chat-1")
    token = await a.try_claim("chat-2")
    await a.release_claim("chat-2", token)
    assert await b.try_claim("chat-2")


async def test_redis_cancel_reaches_the_other_replica_and_stays_as_a_flag(redis_pair):
    a, b = redis_pair
    received: asyncio.Queue = asyncio.Queue()

    async def on_cancel(run_id: str, reason: str) -> None:
        await received.put((run_id, reason))

    await a.start(on_cancel)
    await b.start(lambda run_id, reason: asyncio.sleep(0))
    await b.request_cancel("run-1", "cancelled by user")
    assert await asyncio.wait_for(received.get(), 1.0) == ("run-1", "cancelled by user")
    assert await a.pending_cancels(["run-1", "run-2"]) == {"run-1": "cancelled by user"}


def test_migrate_command_works_on_postgresql():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    urls = asyncio.run(postgres_databases_fresh())
    try:
        for service in SERVICES:
            env = {**os.environ, f"LOOPLINE_{service.upper()}_DATABASE_URL": urls[service]}
            done = subprocess.run(
                [sys.executable, "-m", f"services.{service}", "migrate"],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
            again = subprocess.run(
                [sys.executable, "-m", f"services.{service}", "migrate"],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert again.returncode == 0, again.stderr[-2000:]  # idempotent
        assert asyncio.run(_orchestrator_has_leases(urls["orchestrator"]))
    finally:
        asyncio.run(drop_databases(list(urls.values())))


async def postgres_databases_fresh() -> dict[str, str]:
    """Empty (unmigrated) databases, one per service."""
    from tests.conftest import _database_url, _maintenance

    tag = f"llm_{uuid.uuid4().hex[:12]}"
    connection = await _maintenance()
    try:
        for service in SERVICES:
            await connection.execute(f'CREATE DATABASE "{tag}_{service}"')
    finally:
        await connection.close()
    return {service: _database_url(f"{tag}_{service}") for service in SERVICES}


async def _orchestrator_has_leases(url: str) -> bool:
    import asyncpg
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    connection = await asyncpg.connect(
        host=parsed.host, port=parsed.port or 5432, user=parsed.username, database=parsed.database
    )
    try:
        column = await connection.fetchval(
            "SELECT data_type FROM information_schema.columns "
            "WHERE table_name = 'runs' AND column_name = 'lease_until'"
        )
        return column == "timestamp with time zone"
    finally:
        await connection.close()
