"""One database transaction per call, run as a synchronous function on either backend.

A hot-path transaction is a plain function `fn(conn, *args)` over a synchronous SQLAlchemy
`Connection`, so it is written once for both backends:

- SQLite: the function runs on one dedicated worker thread with a synchronous engine over
  the stdlib `sqlite3` driver: one thread hop per transaction instead of two per statement
  through aiosqlite. The single thread also serializes this process's write transactions;
  other processes and this process's aiosqlite engine are handled by SQLite's locking and
  busy timeout (WAL, `services.common.db.SQLITE_PRAGMAS`).
- PostgreSQL (asyncpg) and anything else: `AsyncConnection.run_sync(fn)`, i.e. the same
  function on the event loop through SQLAlchemy's greenlet bridge (no thread hop exists).

The function's transaction commits when it returns and rolls back when it raises.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import create_engine
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from services.common.db import apply_sqlite_pragmas

T = TypeVar("T")


class TxnRunner:
    """Runs `fn(conn, *args)` in one transaction on the database of `engine`.

    Args:
        engine: the service's async engine (its URL and dialect are reused).
        thread_name: name prefix of the SQLite worker thread (shows in py-spy and logs).
    """

    def __init__(self, engine: AsyncEngine, thread_name: str = "db-txn") -> None:
        self.engine = engine
        self.dialect = engine.dialect.name
        self._sync: Engine | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        if self.dialect == "sqlite":
            url = engine.url.set(drivername="sqlite")
            self._sync = create_engine(
                url, connect_args={"timeout": 30, "check_same_thread": False}, pool_size=1, max_overflow=0
            )
            apply_sqlite_pragmas(self._sync)
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=thread_name)

    def _in_thread(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        assert self._sync is not None
        with self._sync.begin() as conn:
            return fn(conn, *args)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(conn, *args)` in one transaction; returns its result, re-raises its error."""
        if self._executor is not None:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, functools.partial(self._in_thread, fn, args))
        async with self.engine.begin() as conn:
            return await conn.run_sync(fn, *args)

    def close(self) -> None:
        """Stop the worker thread and close the synchronous engine (SQLite)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._sync is not None:
            self._sync.dispose()
            self._sync = None
