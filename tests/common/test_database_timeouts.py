"""A PostgreSQL server that drops packets instead of refusing them.

A host that is gone, a firewall or a partition leaves a connection attempt or a statement
without any answer. asyncpg waits 60 s to connect and forever for a statement by default,
past the gateway's 30 s deadline (504). Each round trip is bounded by LOOPLINE_DB_TIMEOUT_S
(`db.asyncpg_timeouts`) and fails with a TimeoutError that `storage_failure` answers
UNAVAILABLE (503 + Retry-After at the gateway).
"""

from __future__ import annotations

import contextlib

import grpc
import pytest
from sqlalchemy import text
from sqlalchemy.engine import URL, make_url

from services.common import db, errors
from services.common.pg import PgPool
from tests.conftest import postgres_url, selected_backend
from tests.tcp_proxy import CuttableProxy, fails_in_time

TIMEOUT_S = 0.5


def _assert_unavailable(error: BaseException) -> None:
    assert db.is_unavailable(error), repr(error)
    failure = errors.storage_failure(error, "test")
    assert failure is not None
    message, answer = failure
    assert (message, answer.code) == ("database unavailable", grpc.StatusCode.UNAVAILABLE)


async def _engine_and_pool_unavailable(engine, pool: PgPool, engine_limit_s: float) -> None:  # noqa: ANN001
    """A statement through `engine` fails as unavailable within `engine_limit_s`, one through
    `pool` within TIMEOUT_S + 2 s."""

    async def query() -> None:
        async with db.sessionmaker(engine)() as session:
            await session.execute(text("SELECT 1"))

    _assert_unavailable(await fails_in_time(query, engine_limit_s))

    async def pooled() -> None:
        await (await pool.pool()).fetchval("SELECT 1")

    _assert_unavailable(await fails_in_time(pooled, TIMEOUT_S + 2))


def test_the_timeouts_are_the_setting_unless_the_url_sets_them():
    assert db.asyncpg_timeouts(make_url("postgresql+asyncpg://u@h/d"), 7.0) == {
        "timeout": 7.0,
        "command_timeout": 7.0,
    }
    url = make_url("postgresql+asyncpg://u@h/d?command_timeout=60")
    assert db.asyncpg_timeouts(url, 7.0) == {"timeout": 7.0, "command_timeout": 60.0}
    pool = PgPool(
        url, timeout_s=7.0
    )  # not in the DSN: asyncpg would send it to the server as a setting
    assert (pool.timeouts, pool.dsn) == (
        {"timeout": 7.0, "command_timeout": 60.0},
        "postgresql://u@h/d",
    )


@contextlib.asynccontextmanager
async def _through(proxy: CuttableProxy, url: URL):
    """(engine, PgPool), TIMEOUT_S each, to `url` through `proxy` (started here); closed after."""
    url = url.set(host="127.0.0.1", port=await proxy.start())
    engine = db.make_engine(url.render_as_string(hide_password=False), 1, TIMEOUT_S)
    pool = PgPool(url, 1, TIMEOUT_S)
    try:
        yield engine, pool
    finally:
        pool.close()
        await engine.dispose()
        await proxy.stop()


def _proxy_to_postgres() -> tuple[CuttableProxy, URL]:
    """A proxy to the test PostgreSQL and its URL; skips outside the PostgreSQL pass."""
    if selected_backend() != "postgres":
        pytest.skip("needs the PostgreSQL backend")
    target = make_url(postgres_url())
    return CuttableProxy(target.host or "127.0.0.1", target.port or 5432), target


async def test_a_server_that_never_answers_a_new_connection_is_unavailable_within_the_timeout():
    async with _through(CuttableProxy(), make_url("postgresql+asyncpg://u@127.0.0.1/d")) as (
        engine,
        pool,
    ):
        await _engine_and_pool_unavailable(engine, pool, TIMEOUT_S + 2)


async def test_a_connection_whose_server_goes_silent_is_unavailable_within_twice_the_timeout():
    proxy, url = _proxy_to_postgres()
    async with _through(proxy, url) as (engine, pool):
        async with db.sessionmaker(engine)() as session:  # a pooled connection that worked
            assert (await session.execute(text("SELECT 1"))).scalar() == 1
        assert await (await pool.pool()).fetchval("SELECT 1") == 1
        proxy.swallowing = True
        # the engine's pre-ping times out, then the new connection does
        await _engine_and_pool_unavailable(engine, pool, 2 * TIMEOUT_S + 2)


async def test_a_statement_the_server_stops_answering_mid_transaction_is_unavailable():
    proxy, url = _proxy_to_postgres()
    async with _through(proxy, url) as (engine, _pool):

        async def transaction() -> None:
            async with db.sessionmaker(engine)() as session, session.begin():
                await session.execute(text("SELECT 1"))
                proxy.swallowing = True
                await session.execute(text("SELECT 2"))

        # the statement times out, then the rollback on the way out does
        _assert_unavailable(await fails_in_time(transaction, 2 * TIMEOUT_S + 2))
