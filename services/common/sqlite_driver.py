"""The one SQLite library of every Loopline process: sqlean, with sqlite-vec on each connection.

The standard library's sqlite3 cannot load extensions, and vector search on SQLite needs
sqlite-vec. Two SQLite libraries in one process are unsafe: POSIX locks belong to the process,
not the connection, so each library's bookkeeping drops the other's locks, and the last one to
close a database removes the WAL index the other still has mapped (SIGBUS). So every connection
the project opens to a SQLite file (services, migrations, readiness, tests) comes from here:
`sqlite3` is sqlean (the same module API, its own SQLite build), `connect` opens a connection
with sqlite-vec's functions loaded, and `AIOSQLITE` is the DB-API module SQLAlchemy's aiosqlite
dialect is given (`services.common.db.create_engine`).
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
import types
from typing import TYPE_CHECKING, Any

import aiosqlite
from sqlalchemy.dialects.sqlite.aiosqlite import AsyncAdapt_aiosqlite_dbapi

if TYPE_CHECKING:  # sqlean is CPython's sqlite3 module built against its own SQLite
    import sqlite3
else:
    import sqlean as sqlite3

__all__ = ["AIOSQLITE", "connect", "sqlite3"]

# sqlite-vec's loadable library, found without importing its package, which imports numpy
# (15 MiB in every service).
_spec = importlib.util.find_spec("sqlite_vec")
if _spec is None or _spec.origin is None:
    raise ImportError("sqlite-vec is not installed: run make venv")
SQLITE_VEC = str(pathlib.Path(_spec.origin).parent / "vec0")


def connect(database: str | pathlib.Path, **kwargs: Any) -> sqlite3.Connection:
    """`sqlite3.connect(database, **kwargs)` with sqlite-vec's functions (vec_distance_cosine...)
    loaded; extension loading is switched off again before the connection is handed out."""
    connection = sqlite3.connect(database, **kwargs)
    try:
        connection.enable_load_extension(True)
        connection.load_extension(SQLITE_VEC)
        connection.enable_load_extension(False)
    except BaseException:
        connection.close()
        raise
    return connection


def _aiosqlite_connect(
    database: str | bytes | pathlib.Path, *, iter_chunk_size: int = 64, **kwargs: Any
) -> aiosqlite.Connection:
    """aiosqlite.connect with the connection opened by `connect` (in aiosqlite's own thread)."""
    location = database.decode() if isinstance(database, bytes) else str(database)
    return aiosqlite.Connection(functools.partial(connect, location, **kwargs), iter_chunk_size)


_DBAPI_NAMES = (
    "DatabaseError",
    "Error",
    "IntegrityError",
    "NotSupportedError",
    "OperationalError",
    "ProgrammingError",
    "sqlite_version",
    "sqlite_version_info",
)

# aiosqlite as the dialect reads it: its Connection class, `connect` above, and sqlean's error
# classes and version (aiosqlite re-exports the standard library's, which sqlean never raises).
AIOSQLITE = AsyncAdapt_aiosqlite_dbapi(
    types.SimpleNamespace(  # type: ignore[arg-type]
        Connection=aiosqlite.Connection,
        connect=_aiosqlite_connect,
        **{name: getattr(sqlite3, name) for name in _DBAPI_NAMES},
    ),
    sqlite3,
)
