"""Async SQLAlchemy engines and Alembic migrations, one database per service.

The embedded default is SQLite through aiosqlite (WAL, busy timeout); PostgreSQL
works by URL (`postgresql+asyncpg://...`). Each service keeps its own migration
history in `services/<name>/migrations`.
"""

from __future__ import annotations

import asyncio
import datetime
import importlib
import pathlib
from typing import TYPE_CHECKING, Any

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

if TYPE_CHECKING:
    from alembic.config import Config


SQLITE_PRAGMAS = ("journal_mode=WAL", "synchronous=NORMAL", "foreign_keys=ON", "busy_timeout=30000")


def apply_sqlite_pragmas(sync_engine: Any) -> None:
    """Set WAL, synchronous=NORMAL, foreign keys and a 30 s busy timeout on every new SQLite connection."""

    @event.listens_for(sync_engine, "connect")
    def _pragmas(dbapi_connection, _record) -> None:  # noqa: ANN001
        cursor = dbapi_connection.cursor()
        for pragma in SQLITE_PRAGMAS:
            cursor.execute(f"PRAGMA {pragma}")
        cursor.close()


DEFAULT_POOL_SIZE = 4  # CommonSettings.db_pool_size


def make_engine(url: str, pool_size: int = DEFAULT_POOL_SIZE) -> AsyncEngine:
    """Create an async engine for `url`; SQLite gets WAL, a 30 s busy timeout and foreign keys.

    PostgreSQL: a pool of `pool_size` connections plus as many again under bursts (a request
    beyond that waits for a free one, up to 30 s), checked before use (`pool_pre_ping`).
    """
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            pathlib.Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_async_engine(url, connect_args={"timeout": 30})
        apply_sqlite_pragmas(engine.sync_engine)
        return engine
    return create_async_engine(url, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True)


_INSERT_IGNORING: dict[tuple[str, str, tuple[str, ...]], Any] = {}


def insert_ignoring(dialect: str, table: Any, conflict: tuple[str, ...]) -> Any:
    """`INSERT ... ON CONFLICT (conflict) DO NOTHING` into `table` for the dialect named `dialect`
    ("sqlite" or "postgresql"), built once per (dialect, table, conflict) and cached.

    The dialect's module is imported on first use: importing `sqlalchemy.dialects.postgresql`
    costs ~2 MiB resident in a process that never talks to PostgreSQL. Raises ValueError for
    another dialect.
    """
    key = (dialect, table.name, conflict)
    statement = _INSERT_IGNORING.get(key)
    if statement is None:
        if dialect not in ("sqlite", "postgresql"):
            raise ValueError(f"unsupported database dialect {dialect!r} (sqlite or postgresql)")
        module = importlib.import_module(f"sqlalchemy.dialects.{dialect}")
        statement = _INSERT_IGNORING[key] = module.insert(table).on_conflict_do_nothing(index_elements=list(conflict))
    return statement


# SQLSTATE classes/codes that say "the database cannot serve you now", not "this statement is wrong":
# 08 connection exception, 53 insufficient resources (53300 too many connections), 57P01-57P03
# admin/crash shutdown and cannot connect now (PostgreSQL manual, Appendix A).
_UNAVAILABLE_SQLSTATE_PREFIXES = ("08", "53", "57P01", "57P02", "57P03")


def is_unavailable(error: BaseException) -> bool:
    """Whether `error` means the database cannot be reached or takes no more connections right now
    (answer 503 / UNAVAILABLE: the client may retry), as opposed to a wrong statement or a bug.

    True for: SQLAlchemy's pool timeout and invalidated connections, OS-level connection
    errors, and driver errors whose SQLSTATE is in class 08 or 53 or is 57P01-57P03, found on
    the error or along its `orig` / `__cause__` chain (asyncpg errors carry `sqlstate`).
    """
    from sqlalchemy import exc  # noqa: PLC0415 - light: sqlalchemy is loaded by every service

    seen = 0
    current: BaseException | None = error
    while current is not None and seen < 6:
        seen += 1
        if isinstance(current, (exc.TimeoutError, ConnectionError, TimeoutError)):
            return True
        if isinstance(current, exc.DBAPIError) and current.connection_invalidated:
            return True
        code = getattr(current, "sqlstate", None) or getattr(current, "pgcode", None)
        if isinstance(code, str) and code.startswith(_UNAVAILABLE_SQLSTATE_PREFIXES):
            return True
        current = getattr(current, "orig", None) or current.__cause__
    return False


def sessionmaker(engine: AsyncEngine) -> async_sessionmaker:
    """A session factory that keeps objects usable after commit."""
    return async_sessionmaker(engine, expire_on_commit=False)


def alembic_config(service: str, url: str) -> Config:
    """The Alembic config of `service` (its `migrations` folder) pointed at `url`."""
    from alembic.config import (
        Config,  # imported on use: Alembic is only needed to migrate
    )

    folder = pathlib.Path(__file__).resolve().parent.parent / service / "migrations"
    config = Config()
    config.set_main_option("script_location", str(folder))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def utc(value: datetime.datetime | None) -> datetime.datetime | None:
    """A stored datetime (or one to store) as aware UTC: a naive one is taken as UTC (every time
    is stored in UTC; SQLite hands them back naive), an aware one converted; None stays None."""
    if value is None:
        return None
    if value.tzinfo is None:
        return value.replace(tzinfo=datetime.UTC)
    return value if value.tzinfo is datetime.UTC else value.astimezone(datetime.UTC)


def missing_sqlite_file(url: str) -> pathlib.Path | None:
    """The file of a SQLite `url` when it does not exist yet, else None (another dialect, an
    in-memory database, or a file that exists). Admin commands refuse to run on such a URL:
    migrating it would create an empty database beside the one the services use."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or not parsed.database or parsed.database == ":memory:":
        return None
    path = pathlib.Path(parsed.database)
    return None if path.exists() else path


def migrate(service: str, url: str) -> None:
    """Upgrade `service`'s database at `url` to the newest migration (blocking)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database and parsed.database != ":memory:":
        pathlib.Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    from alembic import command

    command.upgrade(alembic_config(service, url), "head")


async def migrate_async(service: str, url: str) -> None:
    """`migrate` from inside a running event loop (runs in a worker thread)."""
    await asyncio.to_thread(migrate, service, url)
