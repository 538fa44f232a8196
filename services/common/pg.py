"""Hot-path statements straight on asyncpg (PostgreSQL), shared by the orchestrator and billing.

A service whose hot transactions are each one SQL statement (data-modifying CTEs: a single
statement is atomic without BEGIN/COMMIT) sends them on a small asyncpg pool of its own
(`PgPool`) instead of SQLAlchemy's `AsyncConnection.run_sync`: one round trip per
transaction, no greenlet bridge, no pool pre-ping, no BEGIN/COMMIT round trips, and no
reset query when a connection goes back to the pool (`no_reset`). asyncpg prepares and
caches each statement per connection (docs/performance.md).

Values are converted as the services' SQLAlchemy types do, so rows written here read the
same through the ORM and vice versa:

- JSON columns: sent as `json.dumps` text (Python None is stored as JSON `null`), read
  with `loads`.
- Datetimes: `timestamp with time zone` columns take and give timezone-aware datetimes; asyncpg
  returns them in UTC. `services.common.db.utc(value)` normalizes a value before it is bound (a
  naive datetime is taken as UTC, like `services.billing.models.UTCDateTime`).
- Rows: `record_type(*fields)` builds a tuple type with attribute access (like
  SQLAlchemy's `Row`), so code written against `row.name` works on both paths.
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

from sqlalchemy import JSON

from services.common import db


@functools.cache
def _dialect() -> Any:
    # imported on first use: a SQLite process never loads the PostgreSQL dialect
    from sqlalchemy.dialects import postgresql

    return postgresql.dialect()


def pg_type(column: Any) -> str:
    """The column's PostgreSQL type as written in a cast, e.g. `VARCHAR(36)`, `JSON`, `BIGINT`."""
    return column.type.compile(dialect=_dialect())


def is_json(column: Any) -> bool:
    """True when `column` is a JSON column (values go as `json.dumps` text)."""
    return isinstance(column.type, JSON)


def param(column: Any, value: Any) -> Any:
    """`value` as asyncpg binds it for `column` (JSON columns: `json.dumps` text)."""
    return json.dumps(value) if is_json(column) else value


def loads(value: Any) -> Any:
    """A JSON column's value as read from asyncpg (text) -> the Python value; other values as they
    are."""
    return json.loads(value) if isinstance(value, str) else value


class Record(tuple):
    """A result row with attribute access (like SQLAlchemy's `Row`) built from an asyncpg Record."""

    __slots__ = ()
    _fields: tuple[str, ...] = ()

    def __getattr__(self, name: str) -> Any:
        try:
            return self[self._fields.index(name)]
        except ValueError:
            raise AttributeError(name) from None


def record_type(*fields: str) -> type[Record]:
    """A `Record` subclass whose columns are `fields`, in order: `record_type("a", "b")((1, 2)).b ==
    2`."""
    return type("Row", (Record,), {"__slots__": (), "_fields": fields})


async def no_reset(connection: Any) -> None:
    """asyncpg's pool `reset`: nothing to undo. Each statement sent through a `PgPool` is a whole
    transaction that leaves no session state (no LISTEN, advisory lock, SET or open transaction),
    so the default reset query (`RESET ALL; UNLISTEN *; ...`, one more round trip per statement)
    is skipped."""


def asyncpg_dsn(url: Any) -> str:
    """The asyncpg DSN (`postgresql://...`, password kept) of a SQLAlchemy URL
    (`postgresql+asyncpg://...`)."""
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


class PgPool:
    """A small asyncpg pool of a service's own, opened on first use.

    Statements sent through it must each be a whole transaction (one statement, or a
    transaction opened and closed within one checkout): connections are returned without
    a reset query (`no_reset`).

    Args:
        url: the service's SQLAlchemy URL (`postgresql+asyncpg://...`; a `sqlalchemy.engine.URL`).
        max_size: connections of the pool at most (a statement holds one for one round trip).
        timeout_s: seconds a connection may take to open and a statement to answer, as the
            service's SQLAlchemy engine (`db.asyncpg_timeouts`; LOOPLINE_DB_TIMEOUT_S): then
            TimeoutError, answered 503 / UNAVAILABLE.
    """

    def __init__(
        self, url: Any, max_size: int = 4, timeout_s: float = db.DEFAULT_TIMEOUT_S
    ) -> None:
        self.timeouts = db.asyncpg_timeouts(url, timeout_s)
        # asyncpg would take the two as server settings (unknown DSN parameters are sent to the
        # server)
        self.dsn = asyncpg_dsn(url.difference_update_query(db.ASYNCPG_TIMEOUTS))
        self.max_size = max_size
        self._pool: Any = None
        self._opening: asyncio.Lock | None = None

    async def pool(self) -> Any:
        """The asyncpg pool, created on first use (min 1 connection, `max_size` at most)."""
        if self._pool is None:
            if self._opening is None:
                self._opening = asyncio.Lock()
            async with self._opening:
                if self._pool is None:
                    import asyncpg

                    self._pool = await asyncpg.create_pool(
                        self.dsn,
                        min_size=1,
                        max_size=self.max_size,
                        reset=no_reset,
                        timeout=self.timeouts["timeout"],
                        command_timeout=self.timeouts["command_timeout"],
                    )
        return self._pool

    def close(self) -> None:
        """Close the pool's connections at once (at shutdown; statements in flight fail)."""
        if self._pool is not None:
            self._pool.terminate()
            self._pool = None
