"""Opening an embedded SQLite database while another connection writes to it.

`PRAGMA journal_mode=WAL` on a file another connection is writing in rollback-journal mode
answers "database is locked" at once: SQLite skips the busy handler where waiting could
deadlock. In CI a service's first connection to a new database file, racing another
service's, failed that way; the orchestrator's transaction thread died and every request
waited for it until the client's timeout (tests/gateway/test_query_rules.py, httpx.ReadTimeout).
"""

from __future__ import annotations

import asyncio
import pathlib
import threading

import pytest
from sqlalchemy import func, select, table, text
from sqlalchemy.exc import OperationalError

from services.common.db import make_engine, set_sqlite_pragmas
from services.common.sqlite_driver import sqlite3
from services.common.txn import SqliteWorker

HOLD_S = 0.3
COUNT_ITEMS = select(func.count()).select_from(
    table("items")
)  # built once: the worker caches by identity


def _write_lock_held_for(path: pathlib.Path, seconds: float) -> threading.Timer:
    """A rollback-journal database at `path` whose write lock (RESERVED) another connection
    holds for `seconds`; returns the timer that releases it."""
    writer = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    writer.execute("CREATE TABLE items (id INTEGER PRIMARY KEY)")
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("INSERT INTO items VALUES (1)")

    def release() -> None:
        writer.execute("COMMIT")
        writer.close()

    timer = threading.Timer(seconds, release)
    timer.start()
    return timer


def test_the_pragmas_wait_for_a_writer_instead_of_failing_at_once(tmp_path):
    timer = _write_lock_held_for(tmp_path / "x.db", HOLD_S)
    raw = sqlite3.connect(tmp_path / "x.db", isolation_level=None)
    try:
        set_sqlite_pragmas(raw.execute)  # before: sqlite3.OperationalError: database is locked
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert raw.execute("PRAGMA busy_timeout").fetchone()[0] == 30000
        assert raw.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    finally:
        raw.close()
        timer.join()


def test_an_error_that_is_not_a_lock_is_raised_at_once():
    calls = []

    def execute(statement: str) -> None:
        calls.append(statement)
        raise sqlite3.OperationalError("disk I/O error")

    with pytest.raises(sqlite3.OperationalError, match="disk I/O"):
        set_sqlite_pragmas(execute)
    assert len(calls) == 1


async def test_an_engine_first_connection_waits_for_a_writer(tmp_path):
    timer = _write_lock_held_for(tmp_path / "x.db", HOLD_S)
    engine = make_engine(f"sqlite+aiosqlite:///{tmp_path / 'x.db'}")
    try:
        async with engine.connect() as conn:
            assert (await conn.execute(text("PRAGMA journal_mode"))).scalar() == "wal"
            assert (await conn.execute(text("SELECT count(*) FROM items"))).scalar() == 1
    finally:
        await engine.dispose()
        timer.join()


async def test_the_transaction_thread_waits_for_a_writer(tmp_path):
    timer = _write_lock_held_for(tmp_path / "x.db", HOLD_S)
    worker = SqliteWorker(str(tmp_path / "x.db"))
    try:
        count = await asyncio.wait_for(
            worker.submit(lambda conn: conn.execute(COUNT_ITEMS).scalar(), ()), 10
        )
        assert count == 1  # before: the thread died and this waited forever
    finally:
        worker.close()
        timer.join()


async def test_a_transaction_thread_that_cannot_open_its_database_answers_every_caller(tmp_path):
    worker = SqliteWorker(str(tmp_path))  # a directory: SQLite cannot open it
    try:
        for _ in range(2):
            with pytest.raises(OperationalError, match="unable to open"):  # before: waited forever
                await asyncio.wait_for(worker.submit(lambda conn: None, ()), 10)
    finally:
        worker.close()
