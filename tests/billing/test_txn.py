"""The SQLite transaction runner: raw statements on one worker connection, group commit.

Rules (services/common/txn.py): a caller hears "done" only after the COMMIT that contains
its work; a transaction function that raises undoes only its own work; when the COMMIT of
a batch fails, every caller of the batch gets the error and nothing of the batch is kept.
Values round-trip in the formats SQLAlchemy's SQLite types use, so the async engine (tests,
admin reads) and the worker read each other's rows.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import os
import pathlib
import threading
import uuid

import grpc
import pytest
from sqlalchemy import (
    Column,
    Date,
    Integer,
    MetaData,
    String,
    Table,
    bindparam,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.exc import DBAPIError, IntegrityError

from loopline.billing.v1 import billing_pb2_grpc
from services.billing.models import UTCDateTime
from services.billing.rates import MemoryWindows, RateLimiter
from services.billing.server import BillingServer
from services.common import db
from services.common import txn as txn_module
from services.common.sqlite_driver import sqlite3
from services.common.txn import TxnRunner
from tests.billing.helpers import admit_request, make_settings, refusal

metadata = MetaData()
items = Table(
    "items",
    metadata,
    Column("id", String, primary_key=True),
    Column("day", Date, nullable=True),
    Column("at", UTCDateTime, nullable=True),
)
# A deferred foreign key is checked at COMMIT, not at the INSERT: the way to make a COMMIT fail.
parents = Table("parents", metadata, Column("id", Integer, primary_key=True))
children = Table(
    "children", metadata, Column("id", Integer, primary_key=True), Column("parent_id", Integer)
)

INSERT_ITEM = insert(items)
SELECT_ITEMS = select(items.c.id, items.c.day, items.c.at).order_by(items.c.id)
INSERT_CHILD = insert(children)


@pytest.fixture
async def runner(tmp_path: pathlib.Path):
    engine = db.create_engine(f"sqlite+aiosqlite:///{tmp_path / 'txn.db'}")
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
        await conn.execute(text("DROP TABLE children"))
        await conn.execute(
            text(
                "CREATE TABLE children (id INTEGER PRIMARY KEY, parent_id INTEGER "
                "REFERENCES parents(id) DEFERRABLE INITIALLY DEFERRED)"
            )
        )
    runner = TxnRunner(engine)
    try:
        yield runner, engine
    finally:
        runner.close()
        await engine.dispose()


async def _ids(engine) -> list[str]:  # noqa: ANN001
    async with engine.connect() as conn:
        return [row.id for row in (await conn.execute(SELECT_ITEMS)).all()]


def _insert(conn, item_id: str) -> str:  # noqa: ANN001
    conn.execute(INSERT_ITEM, {"id": item_id, "day": None, "at": None})
    return item_id


def _insert_then_fail(conn, item_id: str) -> None:  # noqa: ANN001
    conn.execute(INSERT_ITEM, {"id": item_id, "day": None, "at": None})
    raise ValueError("refused after writing")


async def _in_one_batch(runner: TxnRunner, *jobs: tuple) -> list:
    """Hold the worker with a blocking job while `jobs` queue up, so they form one batch."""
    gate = threading.Event()
    holder = asyncio.ensure_future(
        runner.run(lambda conn: gate.wait(5), inline=False)
    )  # on the worker thread
    await asyncio.sleep(0.05)  # the worker is now inside the holder's batch
    futures = [asyncio.ensure_future(runner.run(fn, *args)) for fn, *args in jobs]
    await asyncio.sleep(0.05)
    gate.set()
    await holder
    return await asyncio.gather(*futures, return_exceptions=True)


async def test_a_failing_transaction_in_a_batch_undoes_only_its_own_work(runner):
    txn, engine = runner
    outcomes = await _in_one_batch(txn, (_insert, "a"), (_insert_then_fail, "b"), (_insert, "c"))
    assert outcomes[0] == "a" and outcomes[2] == "c"
    assert isinstance(outcomes[1], ValueError)
    assert await _ids(engine) == ["a", "c"]


async def test_a_failed_commit_fails_every_caller_of_the_batch_and_keeps_nothing(runner):
    txn, engine = runner

    def orphan(conn) -> None:  # noqa: ANN001
        conn.execute(INSERT_CHILD, {"id": 1, "parent_id": 42})  # no parent 42: COMMIT refuses

    outcomes = await _in_one_batch(txn, (_insert, "a"), (orphan,), (_insert, "c"))
    assert all(isinstance(o, IntegrityError) for o in outcomes), outcomes
    assert await _ids(engine) == []
    assert await txn.run(_insert, "d") == "d"  # the worker goes on after a failed batch
    assert await _ids(engine) == ["d"]


async def test_a_caller_is_answered_only_after_its_commit(runner):
    txn, engine = runner
    seen: list[list[str]] = []

    async def insert_and_look(item_id: str) -> None:
        await txn.run(_insert, item_id)
        seen.append(await _ids(engine))  # another connection: sees only committed rows

    await asyncio.gather(*(insert_and_look(f"k{i:02d}") for i in range(20)))
    for i, ids in enumerate(seen):
        assert len(ids) >= i + 1
    assert len(await _ids(engine)) == 20


async def _worker_ready(txn: TxnRunner) -> None:
    """Wait until the worker thread has opened its connections (inline runs need them)."""
    worker = txn._worker
    assert worker is not None  # a SQLite runner has one
    for _ in range(200):
        if worker._raw is not None:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the SQLite worker did not connect")


def _thread(conn, item_id: str) -> int:  # noqa: ANN001
    conn.execute(INSERT_ITEM, {"id": item_id, "day": None, "at": None})
    return threading.get_ident()


async def test_a_lone_transaction_runs_inline_on_the_callers_thread_and_is_committed(runner):
    txn, engine = runner
    await _worker_ready(txn)
    assert await txn.run(_thread, "a") == threading.get_ident()  # no hand-off to the worker thread
    assert await txn.run(_thread, "b", inline=False) != threading.get_ident()
    assert await _ids(engine) == ["a", "b"]  # committed: another connection sees both


async def test_a_transaction_behind_another_connections_write_waits_on_the_worker_not_the_loop(
    runner, tmp_path
):
    txn, engine = runner
    await _worker_ready(txn)
    other = sqlite3.connect(tmp_path / "txn.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # holds the write lock
    other.execute("INSERT INTO items (id) VALUES ('other')")
    first = asyncio.ensure_future(txn.run(_thread, "a"))
    second = asyncio.ensure_future(txn.run(_thread, "b"))  # must not overtake the first, now queued
    ticks = 0
    for _ in range(10):  # the loop keeps running while both wait for the lock
        await asyncio.sleep(0.01)
        ticks += 1
    assert ticks == 10 and not first.done() and not second.done()
    other.execute("COMMIT")
    other.close()
    threads = await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert (
        threading.get_ident() not in threads
    )  # the worker waited for the lock, not the event loop
    assert await _ids(engine) == ["a", "b", "other"]
    async with engine.connect() as conn:  # in the order they were submitted
        rowids = (await conn.execute(text("SELECT id FROM items ORDER BY rowid"))).scalars().all()
    assert rowids == ["other", "a", "b"]


async def test_the_worker_thread_checkpoints_the_wal_that_inline_commits_fill(runner, monkeypatch):
    txn, _ = runner
    await _worker_ready(txn)
    worker = txn._worker
    monkeypatch.setattr(txn_module, "CHECKPOINT_EVERY", 4)
    checkpoints: list[int] = []
    original = worker._checkpoint

    def spy(raw):  # noqa: ANN001
        checkpoints.append(threading.get_ident())
        original(raw)

    monkeypatch.setattr(worker, "_checkpoint", spy)
    for i in range(20):
        await txn.run(_insert, f"k{i}")
    for _ in range(200):
        if len(checkpoints) >= 2:
            break
        await asyncio.sleep(0.005)
    # every 4 commits, on the worker thread only (an inline run waits while one is due: the WAL
    # stays bounded)
    assert len(checkpoints) >= 4 and threading.get_ident() not in checkpoints


async def test_a_list_of_parameters_is_one_executemany_written_in_order_and_converted_like_one_row(
    runner,
):
    txn, engine = runner
    at = datetime.datetime(2026, 12, 1, 13, 5, 7, 123456, tzinfo=datetime.UTC)
    await txn.run(
        lambda conn: conn.execute(
            INSERT_ITEM, [{"id": f"m{i}", "day": at.date(), "at": at} for i in range(3)]
        )
    )
    await txn.run(lambda conn: conn.execute(INSERT_ITEM, {"id": "one", "day": at.date(), "at": at}))
    async with (
        engine.connect() as conn
    ):  # the same stored text as a single row's, rows in the list's order
        stored = (await conn.execute(text("SELECT id, at FROM items ORDER BY rowid"))).all()
    assert [r.id for r in stored] == ["m0", "m1", "m2", "one"] and len({r.at for r in stored}) == 1
    with pytest.raises(IntegrityError):  # a duplicate in the list: the whole transaction is undone
        await txn.run(lambda conn: conn.execute(INSERT_ITEM, [{"id": "m9"}, {"id": "m0"}]))
    assert "m9" not in {r.id for r in await txn.run(lambda conn: conn.execute(SELECT_ITEMS).all())}
    assert (await txn.run(lambda conn: conn.execute(INSERT_ITEM, []))).rowcount == 0


async def test_integrity_errors_surface_as_sqlalchemy_errors(runner):
    txn, _ = runner
    await txn.run(_insert, "a")
    with pytest.raises(IntegrityError):
        await txn.run(_insert, "a")


async def test_dates_and_datetimes_round_trip_in_sqlalchemy_formats(runner):
    txn, engine = runner
    moments = [
        datetime.datetime(2026, 11, 30, 13, 5, 7, 123456, tzinfo=datetime.UTC),
        datetime.datetime(2026, 11, 30, 13, 5, 7, tzinfo=datetime.UTC),  # no microseconds
        datetime.datetime(
            2026, 11, 30, 15, 5, 7, 1, tzinfo=datetime.timezone(datetime.timedelta(hours=2))
        ),
    ]

    def write(conn) -> None:  # noqa: ANN001
        for i, at in enumerate(moments):
            conn.execute(INSERT_ITEM, {"id": f"w{i}", "day": at.date(), "at": at})

    await txn.run(write)
    async with engine.begin() as conn:  # SQLAlchemy's own conversions write "s0"
        await conn.execute(INSERT_ITEM, {"id": "s0", "day": moments[1].date(), "at": moments[1]})
        by_sqlalchemy = (await conn.execute(SELECT_ITEMS)).all()
    by_worker = await txn.run(lambda conn: conn.execute(SELECT_ITEMS).all())
    assert [tuple(r) for r in by_worker] == [tuple(r) for r in by_sqlalchemy]
    for row, at in zip([r for r in by_worker if r.id.startswith("w")], moments, strict=True):
        assert row.at == at and row.at.tzinfo is not None and row.day == at.date()
    async with engine.connect() as conn:  # the stored text is the same for both writers
        stored = (
            (await conn.execute(text("SELECT at FROM items WHERE id IN ('w1', 's0')")))
            .scalars()
            .all()
        )
    assert stored[0] == stored[1]


def test_memory_windows_admit_exactly_the_limit_from_many_threads():
    windows = MemoryWindows()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outcomes = list(
            pool.map(lambda _: windows.check(("org", "sync_exec"), 50, 60, True)[0], range(400))
        )
    assert outcomes.count(True) == 50
    allowed, used, _ = windows.check(("org", "sync_exec"), 50, 60, False)
    assert not allowed and used == 50


async def test_synchronous_and_async_memory_hits_share_one_window():
    limiter = RateLimiter("memory://", key_prefix="t")
    assert limiter.synchronous
    first = limiter.hit_now("org", "sync_exec", "2/minute")
    second = await limiter.hit("org", "sync_exec", "2/minute")
    third = limiter.hit_now("org", "sync_exec", "2/minute")
    peek = await limiter.peek("org", "sync_exec", "2/minute")
    assert (first.allowed, second.allowed, third.allowed) == (True, True, False)
    assert (first.remaining, second.remaining, third.remaining, peek.remaining) == (1, 0, 0, 0)
    assert 1 <= third.reset_seconds <= 60 and peek.allowed


async def test_a_first_admission_that_is_denied_still_provisions_the_account(tmp_path, org):
    # Plan "all_closed": the rate layer passes once, the quota (0 runs a day) refuses.
    server = await BillingServer.start(make_settings(tmp_path, billing_default_plan="all_closed"))
    try:
        with pytest.raises(Exception) as caught:
            await server.admission.admit(org, "chat:run")
        assert getattr(caught.value, "reason", "") == "QUOTA_EXCEEDED"
        found = await server.store.account(org, provision=False)
        assert found is not None and found[0].plan == "all_closed"
        assert found[0].runs_today == 0 and found[0].allowance_reserved == 0
    finally:
        await server.stop(0)


async def test_admission_replays_within_one_batch_return_the_first_reservation(server, stub, org):
    outcomes = await asyncio.gather(
        *(stub.Admit(admit_request(org, "chat:same")) for _ in range(30))
    )
    assert len({o.reservation_id for o in outcomes}) == 1
    assert sum(not o.replayed for o in outcomes) == 1


def _redis_url() -> str:
    url = os.environ.get("LOOPLINE_TEST_REDIS_URL")
    if not url:
        pytest.skip("LOOPLINE_TEST_REDIS_URL is not set")
    return url


async def _seven_with_redis_rates(tmp_path: pathlib.Path, org: str, **settings: object) -> None:
    """The two-step admission (shared Redis rate counters): exactly 7 of 100 admitted, each once."""
    prefix = f"test-{uuid.uuid4().hex[:12]}:"
    server = await BillingServer.start(
        make_settings(
            tmp_path,
            billing_rate_limit_storage_url=_redis_url(),
            redis_key_prefix=prefix,
            **settings,
        )
    )
    try:
        assert not server.admission.rates.synchronous
        await server.admin.set_plan(org, "seven")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = billing_pb2_grpc.BillingServiceStub(channel)
            outcomes = await asyncio.gather(
                *(stub.Admit(admit_request(org, f"chat:{i}")) for i in range(100)),
                *(stub.Admit(admit_request(org, "chat:0")) for _ in range(5)),  # replays of one key
                return_exceptions=True,
            )
        admitted = {o.reservation_id for o in outcomes if not isinstance(o, BaseException)}
        denied = [refusal(o).reason for o in outcomes if isinstance(o, BaseException)]
        assert len(admitted) == 7
        assert set(denied) == {"CREDIT_PLAN_EXHAUSTED"}
        found = await server.store.account(org, provision=False)
        assert found is not None and found[0].allowance_reserved == 7
    finally:
        await server.stop(0)


async def test_two_step_admission_with_redis_rates_on_sqlite_admits_exactly_seven(tmp_path, org):
    await _seven_with_redis_rates(tmp_path, org)


async def test_two_step_admission_with_redis_rates_on_postgresql_admits_exactly_seven(
    tmp_path, postgres_url, org
):
    await _seven_with_redis_rates(tmp_path, org, billing_database_url=postgres_url)


CLEAR_DAY = update(items).where(items.c.id == bindparam("b_id")).values(day=None)
SET_DAY = update(items).where(items.c.id == bindparam("b_id")).values(day=bindparam("b_day"))


async def test_a_none_in_a_statement_is_stored_as_null_and_a_missing_bindparam_is_an_error(
    runner,
):
    # `.values(day=None)` keeps its value (no "You did not supply a value for binding parameter
    # :day") after the orchestrator's `UPDATE chats SET running_id=NULL` ran on this runner
    txn, engine = runner
    await txn.run(
        lambda conn: conn.execute(
            INSERT_ITEM, {"id": "a", "day": datetime.date(2026, 11, 30), "at": None}
        )
    )
    await txn.run(lambda conn: conn.execute(CLEAR_DAY, {"b_id": "a"}))
    rows = await txn.run(lambda conn: conn.execute(SELECT_ITEMS).all())
    assert [(r.id, r.day) for r in rows] == [("a", None)]
    with pytest.raises(DBAPIError):
        await txn.run(lambda conn: conn.execute(SET_DAY, {"b_id": "a"}))  # b_day missing
