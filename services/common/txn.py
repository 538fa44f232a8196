"""One database transaction per call, run as a synchronous function (billing, orchestrator).

Every hot-path transaction is a plain function `fn(conn, *args)` over a connection with
SQLAlchemy's `Connection.execute(statement, params)` shape, so it is written once for both
backends:

- SQLite: the function runs on one dedicated worker thread that holds one `sqlite3` (sqlean)
  connection (`SqliteConnection`): each prebuilt Core statement is compiled once to SQL
  text and then executed as a raw DBAPI call, with no SQLAlchemy execution machinery per
  statement. The worker **group-commits**: it takes every transaction queued while it was
  busy, runs each inside its own SAVEPOINT of one `BEGIN IMMEDIATE` transaction (a function
  that raises rolls back only its own savepoint) and commits them together. No caller is
  answered before the COMMIT that contains its work has returned; when that COMMIT fails,
  every caller of the batch gets the error and nothing of the batch is kept. The single
  thread also serializes this process's writers; other processes (the admin CLI) are
  handled by SQLite's locking and busy timeout. **When the worker is idle** (no
  transaction of this process queued or unanswered) a transaction runs at once on the
  caller's thread instead, on a second connection of the worker's: a lone transaction then
  costs ~35 µs of CPU instead of ~75 µs with the two thread hand-offs (docs/performance.md).
  That connection has a busy timeout of 0: when another connection holds the write lock its
  `BEGIN IMMEDIATE` fails at once and the job goes to the worker, which waits for the lock.
  Neither connection checkpoints the WAL by itself (no COMMIT on the event loop ever
  fsyncs): the worker thread checkpoints every `CHECKPOINT_EVERY` commits, and no job runs
  inline while one is due. A caller with a large transaction passes `inline=False`.
- PostgreSQL (asyncpg) and anything else: `AsyncConnection.run_sync(fn)`, i.e. the same
  function on the event loop through SQLAlchemy's greenlet bridge (no thread hop exists).

A function's work commits when it returns and rolls back when it raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple, TypeVar

from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from services.common.db import SQLITE_BUSY_TIMEOUT_MS, set_sqlite_pragmas
from services.common.sqlite_connection import SqliteConnection
from services.common.sqlite_driver import connect, sqlite3

T = TypeVar("T")
_log = logging.getLogger(__name__)

#: Commits of the worker's connection between its WAL checkpoints (PASSIVE, on the worker thread).
CHECKPOINT_EVERY = 256
#: Queued by an inline commit that reached CHECKPOINT_EVERY: the worker checkpoints.
_CHECKPOINT = object()


class _Job(NamedTuple):
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


def _deliver(outcomes: list[tuple[asyncio.Future, bool, Any]]) -> None:
    """Resolve the futures of a committed (or failed) batch, on their event loop."""
    for future, ok, value in outcomes:
        if future.done():  # the caller was cancelled; its work is committed all the same
            continue
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)


class SqliteWorker:
    """One thread, one `sqlite3` connection, group commit; a lone transaction runs inline (see
    the module docstring).

    Args:
        database: the SQLite file path (":memory:" gives a private database).
        max_batch: most transactions committed together.
        thread_name: the worker thread's name (shows in py-spy and thread dumps).

    A database the thread cannot open (a directory, no permission, locked past SQLite's busy
    timeout) fails every transaction submitted, with the error as SQLAlchemy's
    (`sqlalchemy.exc.OperationalError`), and is logged once.
    """

    def __init__(self, database: str, max_batch: int = 256, thread_name: str = "db-txn") -> None:
        self.database = database
        self.max_batch = max_batch
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._lock = (
            threading.Lock()
        )  # held while the connection is used (a worker batch, an inline job, a checkpoint)
        self._raw: sqlite3.Connection | None = (
            None  # the inline connection, set by the worker thread once connected
        )
        self._conn: SqliteConnection | None = None
        self._outstanding = (
            0  # jobs queued and not yet answered: none, or a job would overtake them inline
        )
        self._commits = 0  # commits since the last checkpoint (under _lock)
        self._checkpoint_queued = False
        self._thread = threading.Thread(target=self._main, name=thread_name, daemon=True)
        self._thread.start()

    def submit(
        self, fn: Callable[..., T], args: tuple[Any, ...], inline: bool = True
    ) -> asyncio.Future[T]:
        """Run `fn(conn, *args)` in a transaction; the future resolves after the COMMIT that
        contains it.

        With `inline` (the default), when nothing of this worker is queued or unanswered (a
        checkpoint included) and the write lock is free, it runs at once on the calling thread
        (the future is resolved on the next loop turn); otherwise it is queued for the worker
        thread (group commit).
        Raises RuntimeError after `close()`.
        """
        if self._closed:
            raise RuntimeError("the database worker is closed")
        loop = asyncio.get_running_loop()
        job = _Job(fn, args, loop.create_future(), loop)
        if (
            inline
            and self._outstanding == 0
            and not self._checkpoint_queued
            and self._raw is not None
            and self._lock.acquire(blocking=False)
        ):
            try:
                ran = self._run_inline(job)
            finally:
                self._lock.release()
            if ran:
                return job.future
        self._outstanding += 1
        self._queue.put(job)
        return job.future

    def close(self) -> None:
        """Finish every queued transaction, then stop the thread and close the connection."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()

    def _run_inline(self, job: _Job) -> bool:
        """Run `job` now on the inline connection (busy timeout 0), under `_lock`, unless another
        connection holds the write lock (False: the worker's connection waits for it)."""
        raw, conn = self._raw, self._conn
        if raw is None or conn is None:  # the worker thread has stopped
            return False
        try:
            raw.execute("BEGIN IMMEDIATE")
        except (
            sqlite3.OperationalError
        ):  # busy (another process or engine writes), or worse: the worker's turn
            return False
        outcomes = self._transact(raw, conn, [job], begun=True)
        # answered on the next loop turn, as from the worker: awaiting a transaction still lets
        # other tasks run (a loop of many awaits of inline transactions cannot hold the event loop)
        job.loop.call_soon(_deliver, [(done.future, ok, value) for done, ok, value in outcomes])
        self._committed()
        return True

    def _committed(self) -> None:
        """Count a commit (under `_lock`); ask the worker thread for a checkpoint when one is
        due."""
        self._commits += 1
        if self._commits >= CHECKPOINT_EVERY and not self._checkpoint_queued:
            self._checkpoint_queued = True
            self._queue.put(_CHECKPOINT)

    def _answer(self, items: list[tuple[asyncio.Future, bool, Any]]) -> None:
        """On the jobs' event loop: the worker answered `items`."""
        self._outstanding -= len(items)
        _deliver(items)

    def _main(self) -> None:
        raw = inline = None
        try:
            raw = self._connect(SQLITE_BUSY_TIMEOUT_MS)
            if (
                self.database != ":memory:"
            ):  # a private in-memory database has one connection: no inline runs
                inline = self._connect(0)
        except Exception as exc:  # noqa: BLE001 - every caller hears why (before: the thread died, callers hung)
            for opened in (raw, inline):
                if opened is not None:
                    opened.close()
            self._refuse(exc)
            return
        try:
            conn = SqliteConnection(raw)
            if inline is not None:
                self._raw, self._conn = inline, SqliteConnection(inline)
            stop = False
            while not stop:
                job = self._queue.get()
                if job is None:
                    break
                batch = []
                while True:
                    if job is _CHECKPOINT:
                        with self._lock:
                            self._checkpoint(raw)
                    else:
                        batch.append(job)
                    if len(batch) >= self.max_batch:
                        break
                    try:
                        job = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if job is None:
                        stop = True
                        break
                if batch:
                    with self._lock:
                        outcomes = self._transact(raw, conn, batch)
                        self._committed()
                        if self._commits >= CHECKPOINT_EVERY:
                            self._checkpoint(raw)
                    self._dispatch(outcomes)
        finally:
            self._raw = None
            with self._lock:
                if inline is not None:
                    inline.close()
            raw.close()

    def _refuse(self, error: Exception) -> None:
        """The connection could not be opened: answer every job, queued or to come, with `error`
        (a sqlite3 error as SQLAlchemy's, e.g. sqlalchemy.exc.OperationalError) until close()."""
        _log.error("the database %s cannot be opened: %s", self.database, error)
        if isinstance(error, sqlite3.Error):  # raised as SQLAlchemy's, like a statement's errors
            error = DBAPIError.instance(None, None, error, sqlite3.Error)
        while (job := self._queue.get()) is not None:
            if job is not _CHECKPOINT:
                self._dispatch([(job, False, error)])

    def _connect(self, busy_timeout_ms: int) -> sqlite3.Connection:
        """A connection with SQLITE_PRAGMAS, `busy_timeout_ms`, and no automatic WAL checkpoint
        (`_checkpoint`)."""
        raw = connect(
            self.database, isolation_level=None, check_same_thread=False, cached_statements=256
        )
        set_sqlite_pragmas(raw.execute)
        raw.execute(f"PRAGMA busy_timeout={busy_timeout_ms}")
        raw.execute(
            "PRAGMA wal_autocheckpoint=0"
        )  # the worker thread checkpoints, never a COMMIT on the event loop
        return raw

    def _checkpoint(self, raw: sqlite3.Connection) -> None:
        """A PASSIVE WAL checkpoint (never waits for readers or writers); errors are left to
        SQLite's next one."""
        self._commits = 0
        self._checkpoint_queued = False
        with contextlib.suppress(sqlite3.Error):
            raw.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()

    def _dispatch(self, outcomes: list[tuple[_Job, bool, Any]]) -> None:
        """Answer the jobs of a worker batch on their event loops."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, bool, Any]]] = {}
        for job, ok, value in outcomes:
            by_loop.setdefault(job.loop, []).append((job.future, ok, value))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
                loop.call_soon_threadsafe(self._answer, items)

    @staticmethod
    def _transact(
        raw: sqlite3.Connection, conn: SqliteConnection, batch: list[_Job], begun: bool = False
    ) -> list[tuple[_Job, bool, Any]]:
        """Run `batch` in one transaction (`begun`: its BEGIN IMMEDIATE was executed), a savepoint
        per job; COMMIT; returns each job's (job, ok, result or error)."""
        outcomes: list[tuple[_Job, bool, Any]] = []
        try:
            if not begun:
                raw.execute("BEGIN IMMEDIATE")
            single = len(batch) == 1
            for job in batch:
                if not single:
                    raw.execute("SAVEPOINT job")
                try:
                    result = job.fn(conn, *job.args)
                except Exception as error:  # this job's own refusal or failure: undo only its work
                    if single:
                        if raw.in_transaction:
                            raw.execute("ROLLBACK")
                    else:
                        raw.execute("ROLLBACK TO job")
                        raw.execute("RELEASE job")
                    outcomes.append((job, False, error))
                else:
                    if not single:
                        raw.execute("RELEASE job")
                    outcomes.append((job, True, result))
                if not single and not raw.in_transaction:
                    # SQLite itself rolled the transaction back (I/O error, disk full, ...):
                    # nothing of this batch is kept, so nobody may hear "done".
                    raise sqlite3.OperationalError(
                        "the batch transaction was rolled back by SQLite"
                    )
            if raw.in_transaction:
                raw.execute("COMMIT")
        except BaseException as error:  # BEGIN, savepoint bookkeeping or COMMIT failed
            if raw.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    raw.execute("ROLLBACK")
            failure = (
                DBAPIError.instance("COMMIT", None, error, sqlite3.Error)
                if isinstance(error, sqlite3.Error)
                else error
            )
            outcomes = [(job, False, failure) for job in batch]
        return outcomes


class TxnRunner:
    """Runs `fn(conn, *args)` in one transaction on the database of `engine`.

    Args:
        engine: the service's async engine (its URL and dialect are reused).
        thread_name: the SQLite worker thread's name.

    Attributes:
        dialect: "sqlite", "postgresql", ...
    """

    def __init__(self, engine: AsyncEngine, thread_name: str = "db-txn") -> None:
        self.engine = engine
        self.dialect = engine.dialect.name
        self._worker: SqliteWorker | None = None
        if self.dialect == "sqlite":
            self._worker = SqliteWorker(engine.url.database or ":memory:", thread_name=thread_name)

    async def run(self, fn: Callable[..., T], *args: Any, inline: bool = True) -> T:
        """Run `fn(conn, *args)` in one transaction; returns its result, re-raises its error.

        On SQLite the result is returned only after the transaction is committed (group
        commit); a failed COMMIT raises a SQLAlchemy `DBAPIError` subclass. `inline=False`
        keeps a large transaction on the worker thread (`SqliteWorker.submit`).
        """
        if self._worker is not None:
            return await self._worker.submit(fn, args, inline)
        async with self.engine.begin() as conn:
            return await conn.run_sync(fn, *args)

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Callable[..., Awaitable[Any]]]:
        """A scope for several steps with awaits between them: yields `run(fn, *args)`.

        On PostgreSQL every `run` of the scope shares one transaction (and one pooled
        connection), committed when the scope exits and rolled back when it raises; a
        step's exception caught inside the scope leaves the earlier steps in place only if
        the step did not abort the transaction (use `conn.begin_nested()` in the step).
        On SQLite each `run` is its own transaction on the worker, as with `TxnRunner.run`
        (the worker is never held across an await).
        """
        if self._worker is not None:
            yield self.run
            return
        async with self.engine.begin() as conn:

            async def run(fn: Callable[..., T], *args: Any) -> T:
                return await conn.run_sync(fn, *args)

            yield run

    def close(self) -> None:
        """Finish queued transactions, stop the worker thread and close its connection (SQLite)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None
