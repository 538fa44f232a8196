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
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, overload

from sqlalchemy import event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

from services.common.sqlite_driver import AIOSQLITE, sqlite3

if TYPE_CHECKING:
    from alembic.config import Config


SQLITE_BUSY_TIMEOUT_MS = 30_000
SQLITE_BUSY_TIMEOUT_S = SQLITE_BUSY_TIMEOUT_MS / 1000
SQLITE_PRAGMAS = (
    f"busy_timeout={SQLITE_BUSY_TIMEOUT_MS}",
    "journal_mode=WAL",
    "synchronous=NORMAL",
    "foreign_keys=ON",
)
_PRAGMA_RETRY_S = 0.005


def set_sqlite_pragmas(execute: Callable[[str], Any]) -> None:
    """Run SQLITE_PRAGMAS through `execute` (a DB-API cursor's or sqlite3 connection's
    `execute`), the busy timeout first.

    `PRAGMA journal_mode=WAL` on a database that another connection is opening at the same
    moment can answer SQLITE_BUSY ("database is locked") at once: SQLite skips the busy handler
    where waiting could deadlock (https://www.sqlite.org/c3ref/busy_handler.html). Such a
    pragma is retried every 5 ms for up to the busy timeout (30 s); any other error, or a
    database still locked then, is raised (sqlite3.OperationalError). Seen in CI: a service's
    first connection to a new database file failed and the service never answered."""
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_S
    for pragma in SQLITE_PRAGMAS:
        while True:
            try:
                execute(f"PRAGMA {pragma}")
                break
            except sqlite3.OperationalError as exc:
                if not _sqlite_busy(exc) or time.monotonic() >= deadline:
                    raise
                time.sleep(_PRAGMA_RETRY_S)


def _sqlite_busy(exc: sqlite3.OperationalError) -> bool:
    """True for SQLITE_BUSY / SQLITE_LOCKED ("database is locked", "database table is locked"),
    read from the primary result code SQLite sets on its errors (Python 3.11+)."""
    return getattr(exc, "sqlite_errorcode", 0) & 0xFF in (
        sqlite3.SQLITE_BUSY,
        sqlite3.SQLITE_LOCKED,
    )


def apply_sqlite_pragmas(sync_engine: Any) -> None:
    """Set a 30 s busy timeout, WAL, synchronous=NORMAL and foreign keys on every new SQLite
    connection of `sync_engine` (set_sqlite_pragmas)."""

    @event.listens_for(sync_engine, "connect")
    def _pragmas(dbapi_connection, _record) -> None:  # noqa: ANN001
        cursor = dbapi_connection.cursor()
        try:
            set_sqlite_pragmas(cursor.execute)
        finally:
            cursor.close()


DEFAULT_POOL_SIZE = 4  # CommonSettings.db_pool_size
DEFAULT_TIMEOUT_S = 5.0  # CommonSettings.db_timeout_s


def engine_url(url: str) -> URL:
    """`url` as SQLAlchemy's asyncpg dialect takes it: libpq's `sslmode` query parameter (what
    managed PostgreSQL services document) becomes asyncpg's `ssl`, which takes the same values
    (disable, allow, prefer, require, verify-ca, verify-full); asyncpg's connect() has no
    `sslmode` argument (`?sslmode=require` would be a TypeError at start).
    Any other URL is returned as it is (parsed)."""
    parsed = make_url(url)
    if (
        parsed.get_backend_name() == "postgresql"
        and parsed.get_driver_name() == "asyncpg"
        and "sslmode" in parsed.query
        and "ssl" not in parsed.query
    ):
        query = dict(parsed.query)
        query["ssl"] = query.pop("sslmode")
        parsed = parsed.set(query=query)
    return parsed


ASYNCPG_TIMEOUTS = ("timeout", "command_timeout")


def asyncpg_timeouts(url: URL, timeout_s: float) -> dict[str, float]:
    """asyncpg's connect arguments bounding how long one database round trip may hang, in
    seconds: `timeout` (opening a connection, TLS and authentication included) and
    `command_timeout` (each statement, the pool's pre-ping included). Each is `timeout_s`
    unless `url`'s query sets it (`?command_timeout=60` wins; ValueError if not a number).

    Without them a database that drops packets instead of refusing them (a host gone, a
    network partition) would hold every request past the gateway's deadline (asyncpg waits 60 s
    to connect and forever for a statement by default). A timed-out round trip raises
    TimeoutError, which `is_unavailable` reads as "the database cannot serve now"."""
    timeouts: dict[str, float] = {}
    for name in ASYNCPG_TIMEOUTS:
        value = url.query.get(name)
        if value is None:
            timeouts[name] = timeout_s
        else:  # a repeated parameter is a tuple: the last one wins
            timeouts[name] = float(value if isinstance(value, str) else value[-1])
    return timeouts


def create_engine(url: str | URL, **kwargs: Any) -> AsyncEngine:
    """`create_async_engine(url, **kwargs)`, a SQLite URL's connections opened by the project's
    one SQLite library (`services.common.sqlite_driver`), a PostgreSQL URL's as `engine_url`
    takes it."""
    parsed = engine_url(str(url)) if isinstance(url, str) else url
    if parsed.get_backend_name() == "sqlite":
        kwargs.setdefault("module", AIOSQLITE)
    return create_async_engine(parsed, **kwargs)


def make_engine(
    url: str, pool_size: int = DEFAULT_POOL_SIZE, timeout_s: float = DEFAULT_TIMEOUT_S
) -> AsyncEngine:
    """Create an async engine for `url`; SQLite gets WAL, a 30 s busy timeout and foreign keys.

    PostgreSQL: a pool of `pool_size` connections plus as many again under bursts, checked
    before use (`pool_pre_ping`). A request waits at most `timeout_s` seconds (the setting
    LOOPLINE_DB_TIMEOUT_S) for a free connection, for a new one to open and for each statement
    (`asyncpg_timeouts`), then fails with a TimeoutError that services answer 503 / UNAVAILABLE.
    """
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            pathlib.Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30})
        apply_sqlite_pragmas(engine.sync_engine)
        return engine
    parsed = engine_url(url)
    return create_engine(
        parsed,
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=True,
        pool_timeout=timeout_s,
        connect_args=asyncpg_timeouts(parsed, timeout_s),
    )


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
        statement = _INSERT_IGNORING[key] = module.insert(table).on_conflict_do_nothing(
            index_elements=list(conflict)
        )
    return statement


# SQLSTATE classes/codes that say "the database cannot serve you now", not "this statement is
# wrong": 08 connection exception, 53 insufficient resources (53300 too many connections),
# 57P01-57P03 admin/crash shutdown and cannot connect now (PostgreSQL manual, Appendix A).
_UNAVAILABLE_SQLSTATE_PREFIXES = ("08", "53", "57P01", "57P02", "57P03")


def _chain(error: BaseException) -> list[BaseException]:
    """`error` and up to 5 errors along its `orig` / `__cause__` chain."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and len(chain) < 6:
        chain.append(current)
        current = getattr(current, "orig", None) or current.__cause__
    return chain


def _sqlstates(error: BaseException) -> list[str]:
    """The SQLSTATE codes found along `error`'s chain (asyncpg's `sqlstate`, psycopg's `pgcode`)."""
    codes = (
        getattr(current, "sqlstate", None) or getattr(current, "pgcode", None)
        for current in _chain(error)
    )
    return [code for code in codes if isinstance(code, str)]


REDIS_CONNECT_TIMEOUT_S = 5.0
# 5 s: under the orchestrator's 10 s deadline on billing's Admit (whose rate-limit counters are in
# Redis), so a Redis that answers nothing is 503 REDIS_UNAVAILABLE, not a 504 BILLING_TIMEOUT
REDIS_TIMEOUT_S = 5.0


def redis_client_options(read_timeout_s: float = REDIS_TIMEOUT_S) -> dict[str, Any]:
    """The redis-py client options of every Redis client of the services (the orchestrator's
    event streams, claims and cancel flags; billing's rate-limit counters through `limits`).

    REDIS_CONNECT_TIMEOUT_S (5 s) to connect, `read_timeout_s` seconds (REDIS_TIMEOUT_S, 5 s) for
    each reply (a client that blocks on the server, `XREAD BLOCK`, adds its block time), TCP
    keepalive, and up to 3 quick retries (50-500 ms apart) of a command that met a *connection*
    error (a pooled connection Redis closed while it was away). A reply that does not come in time
    raises redis-py's TimeoutError at once, which `is_unavailable` reads as "Redis cannot serve
    now"; the callers' own loops bound the total retry time. Without them a Redis that drops
    packets (a host gone, a partition) would hold a follower for good (no read timeout)."""
    import redis.exceptions  # noqa: PLC0415 - only a process configured with Redis imports redis-py
    from redis.asyncio.retry import Retry  # noqa: PLC0415
    from redis.backoff import ExponentialWithJitterBackoff  # noqa: PLC0415

    return {
        "socket_connect_timeout": REDIS_CONNECT_TIMEOUT_S,
        "socket_timeout": read_timeout_s,
        "socket_keepalive": True,
        "retry": Retry(
            ExponentialWithJitterBackoff(base=0.05, cap=0.5),
            3,
            supported_errors=(redis.exceptions.ConnectionError,),
        ),
    }


def is_unavailable(error: BaseException) -> bool:
    """Whether `error` means the database (or Redis) cannot be reached or takes no more
    connections right now (answer 503 / UNAVAILABLE: the client may retry), as opposed to a
    wrong statement or a bug.

    True for: SQLAlchemy's pool timeout and invalidated connections, OS-level connection errors,
    redis-py's connection and timeout errors, and driver errors whose SQLSTATE is in class 08 or 53
    or is 57P01-57P03, found on the error or along its `orig` / `__cause__` chain (asyncpg errors
    carry `sqlstate`). `unavailable_store` names which of the two it was."""
    from sqlalchemy import exc  # noqa: PLC0415 - light: sqlalchemy is loaded by every service

    down: tuple[type[BaseException], ...] = (exc.TimeoutError, ConnectionError, TimeoutError)
    redis_errors = sys.modules.get(
        "redis.exceptions"
    )  # no redis error exists unless redis-py was imported
    if redis_errors is not None:
        down += (
            redis_errors.ConnectionError,
            redis_errors.TimeoutError,
        )  # BusyLoadingError is a ConnectionError
    if any(
        isinstance(current, down)
        or (isinstance(current, exc.DBAPIError) and current.connection_invalidated)
        for current in _chain(error)
    ):
        return True
    return any(code.startswith(_UNAVAILABLE_SQLSTATE_PREFIXES) for code in _sqlstates(error))


# SQLSTATEs of a value the database cannot store (PostgreSQL manual, Appendix A): 22001 string
# too long for its column, 22003 numeric value out of range, 22021 character not in repertoire
# (a NUL in text), 22P05 untranslatable character.
_INVALID_VALUE_SQLSTATES = frozenset({"22001", "22003", "22021", "22P05"})


def is_invalid_value(error: BaseException) -> bool:
    """Whether `error` says a value of the statement cannot be stored (the caller's input, not a
    bug or an outage): one of `_INVALID_VALUE_SQLSTATES` on the error or its chain (asyncpg), or
    the sqlite3 driver's OverflowError for an integer past 64 bits."""
    if any(code in _INVALID_VALUE_SQLSTATES for code in _sqlstates(error)):
        return True
    return any(
        isinstance(current, OverflowError) and "SQLite INTEGER" in str(current)
        for current in _chain(error)
    )


# SQLSTATEs of a transaction that lost a race with another (PostgreSQL manual, Appendix A):
# 40001 serialization failure, 40P01 deadlock detected. Retrying the request is the cure.
_CONFLICT_SQLSTATES = frozenset({"40001", "40P01"})


def is_conflict(error: BaseException) -> bool:
    """Whether `error` says the transaction was rolled back because another one changed the same
    rows at the same time (`_CONFLICT_SQLSTATES` on the error or its chain): the request may be
    sent again as it is."""
    return any(code in _CONFLICT_SQLSTATES for code in _sqlstates(error))


def unavailable_store(error: BaseException) -> str | None:
    """What `error` says cannot serve right now: "Redis" when a redis-py error is on its chain
    (the rate limits and event streams of a scaled-out deployment), else "database"; None when
    `is_unavailable(error)` is False. For the log line and the status reason of the 503 /
    UNAVAILABLE answer, so that an operator looks at the right server."""
    if not is_unavailable(error):
        return None
    redis = any(type(current).__module__.split(".", 1)[0] == "redis" for current in _chain(error))
    return "Redis" if redis else "database"


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


@overload
def utc(value: datetime.datetime) -> datetime.datetime: ...
@overload
def utc(value: datetime.datetime | None) -> datetime.datetime | None: ...
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
    if (
        parsed.get_backend_name() != "sqlite"
        or not parsed.database
        or parsed.database == ":memory:"
    ):
        return None
    path = pathlib.Path(parsed.database)
    return None if path.exists() else path


#: The first 16 bytes of every SQLite database file (https://www.sqlite.org/fileformat.html, 1.3).
SQLITE_HEADER = b"SQLite format 3\x00"


class UnusableDatabaseFile(Exception):
    """The file of a SQLite URL cannot be a database; the message says why (`check_sqlite_file`)."""


def check_sqlite_file(url: str) -> None:
    """Raise UnusableDatabaseFile when the file of a SQLite `url` cannot be a database, before
    anything opens it: a folder (or other non-regular file), a file that cannot be read, a
    non-empty file without the SQLite header (SQLITE_HEADER), or a path under a file (e.g.
    LOOPLINE_DATA_DIR naming a file). Nothing for another dialect, an in-memory database, a
    file that does not exist yet (see `missing_sqlite_file`) or an empty file (SQLite's empty
    database). Opening such a file would fail later with a driver error, and for a folder the
    aiosqlite worker thread also prints a traceback once the event loop has closed.
    """
    parsed = make_url(url)
    if (
        parsed.get_backend_name() != "sqlite"
        or not parsed.database
        or parsed.database == ":memory:"
    ):
        return
    path = pathlib.Path(parsed.database)
    if not path.exists():
        for folder in path.parents:
            if folder.exists():
                if not folder.is_dir():
                    raise UnusableDatabaseFile(f"its folder {folder} is a file")
                return
        return
    if not path.is_file():
        raise UnusableDatabaseFile(
            "it is a folder, not a database file" if path.is_dir() else "it is not a regular file"
        )
    try:
        with path.open("rb") as file:
            head = file.read(len(SQLITE_HEADER))
    except OSError as unreadable:
        raise UnusableDatabaseFile(
            f"it cannot be read: {unreadable.strerror or type(unreadable).__name__}"
        ) from None
    if head and head != SQLITE_HEADER:
        raise UnusableDatabaseFile("the file is not a SQLite database (it lacks the SQLite header)")


def unusable_database(error: BaseException, url: str, service: str, setting: str) -> str | None:
    """Why `service`'s database at `url` cannot be used, as one line for an admin command's
    `{"error": ...}` (README "Administration from the command line"), when `error` (raised
    while the command parsed the URL, opened, migrated or used the database) is of that kind
    (`_unusable_reason`); None for any other error (the caller lets it propagate).

    The database is named by its file (SQLite) or dialect, name, host and port, never by the URL
    (its user and password stay out); the reason is the first line of the driver's text, URL
    password removed, cut to 300 characters; `setting` is the URL's variable, e.g.
    "LOOPLINE_BILLING_DATABASE_URL". No traceback, no SQL statement, no bound parameter."""
    # imported here: only admin commands need it
    from sqlalchemy import exc

    fix = f"run admin commands with the LOOPLINE_DATA_DIR (or {setting}) the services use"
    try:
        parsed = make_url(url)
    except exc.ArgumentError:
        return (
            f"{setting} is not a database URL "
            f"(e.g. sqlite+aiosqlite:///PATH, postgresql+asyncpg://HOST/NAME); {fix}"
        )
    path, where = _database_named(parsed)
    reason = _unusable_reason(error, path, service, setting)
    if reason is None:
        return None
    lines = reason.strip().splitlines() or [type(error).__name__]
    reason = lines[0]
    if parsed.password and len(str(parsed.password)) >= 3:
        reason = reason.replace(str(parsed.password), "***")
    return f"the {service} database {where} cannot be used: {reason[:300]}; {fix}"


def _database_named(parsed: URL) -> tuple[pathlib.Path | None, str]:
    """The database's file (SQLite, None otherwise) and how a message names the database: "at"
    its file, or its dialect, name, host and port."""
    sqlite = parsed.get_backend_name() == "sqlite"
    path = (
        pathlib.Path(parsed.database)
        if sqlite and parsed.database and parsed.database != ":memory:"
        else None
    )
    if path is not None:
        where = f"at {path}"
    else:
        # libpq and asyncpg also take the host and port as query parameters
        # (`…@/name?host=h&port=p`)
        host, port = (
            parsed.host or parsed.query.get("host"),
            parsed.port or parsed.query.get("port"),
        )
        host, port = (
            (host[0] if isinstance(host, tuple) else host),
            (port[0] if isinstance(port, tuple) else port),
        )
        server = f"{host or 'localhost'}:{port or 'default port'}"
        where = f"({parsed.get_backend_name()} database {parsed.database or ''!r} on {server})"
    return path, where


def _unusable_reason(
    error: BaseException, path: pathlib.Path | None, service: str, setting: str
) -> str | None:
    """Why the database at `path` (its file; None when not SQLite) cannot be used, when `error`
    says it cannot; None for any other error.

    The kind: `UnusableDatabaseFile` (`check_sqlite_file`); a URL that names an unknown dialect
    or a driver that is not installed; a driver error other than a constraint conflict
    (sqlalchemy `DBAPIError` but `IntegrityError`: "file is not a database", "database disk
    image is malformed", "unable to open database file", "no such table" in a SQLite file that is
    not this service's, a PostgreSQL database that does not exist or refuses the login); an
    Alembic `CommandError` (the file holds another migration history); an OSError on the database
    file or one of its folders (LOOPLINE_DATA_DIR names a file) or on the connection (the server
    is down)."""
    # imported here: only admin commands need them
    from alembic.util.exc import CommandError
    from sqlalchemy import exc

    if isinstance(error, UnusableDatabaseFile):
        reason = str(error)
    elif isinstance(error, exc.ArgumentError):  # NoSuchModuleError too: unknown dialect or driver
        reason = f"{setting} names no installed database dialect or driver ({error})"
    elif isinstance(error, ModuleNotFoundError):
        reason = (
            f"the driver of {setting} is not installed ({error}); "
            "use sqlite+aiosqlite or postgresql+asyncpg"
        )
    elif isinstance(error, exc.IntegrityError):
        return None
    elif isinstance(error, exc.DBAPIError):
        reason = str(error.orig if error.orig is not None else error)
    elif isinstance(error, CommandError):
        reason = f"its migration history is not {service}'s ({error})"
    elif isinstance(error, OSError):
        named = pathlib.Path(error.filename) if isinstance(error.filename, str) else None
        if named is not None and (path is None or (named != path and named not in path.parents)):
            return None  # another file: not the database's
        reason = error.strerror or str(error) or type(error).__name__
        if named is not None and named != path:
            reason = f"{reason}: {named}"
    else:
        return None
    return reason


class UnusableDatabase(Exception):
    """`service`'s database cannot be opened at all (`migrate`); the message names it and why, for
    a one-line answer of `migrate` and of a starting server (`migrate_command`, runner.run)."""


def migrate(service: str, url: str) -> None:
    """Upgrade `service`'s database at `url` to the newest migration (blocking).

    Raises UnusableDatabase when its SQLite file cannot be a database (`check_sqlite_file`:
    e.g. LOOPLINE_DATA_DIR names a file), before anything is created.
    """
    parsed = make_url(url)
    try:
        check_sqlite_file(url)
    except UnusableDatabaseFile as unusable:
        raise UnusableDatabase(
            f"the {service} database at {parsed.database} cannot be used: {unusable}; "
            "check LOOPLINE_DATA_DIR or the database URL"
        ) from None
    if parsed.get_backend_name() == "sqlite" and parsed.database and parsed.database != ":memory:":
        pathlib.Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    from alembic import command

    command.upgrade(alembic_config(service, url), "head")


def migrate_command(service: str, url: str) -> int:
    """`python -m services.<service> migrate`: `migrate`, then one line on stdout naming the
    database (its URL without the password); or one line on stderr and exit code 2 when the
    database cannot be used (UnusableDatabase), never a traceback. Returns the code."""
    try:
        migrate(service, url)
    except UnusableDatabase as unusable:
        sys.stderr.write(f"{service}: {unusable}\n")
        return 2
    print(f"{service} database migrated: {make_url(url).render_as_string(hide_password=True)}")
    return 0


async def migrate_async(service: str, url: str) -> None:
    """`migrate` from inside a running event loop (runs in a worker thread)."""
    await asyncio.to_thread(migrate, service, url)
