"""Every SQLite connection of a Loopline process comes from one library (sqlean, sqlite-vec loaded).

Two SQLite libraries in one process break each other's POSIX locks, and one can remove the WAL
index the other has mapped (SIGBUS).
"""

from __future__ import annotations

import ast
import pathlib

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.exc import IntegrityError, OperationalError

from services.common import db
from services.common.readiness import database
from services.common.sqlite_driver import connect, sqlite3
from services.common.txn import TxnRunner

ROOT = pathlib.Path(__file__).resolve().parents[2]
DRIVER = ROOT / "services" / "common" / "sqlite_driver.py"


async def test_engine_connections_are_sqlean_with_sqlite_vec(tmp_path: pathlib.Path) -> None:
    engine = db.make_engine(f"sqlite+aiosqlite:///{tmp_path / 'x.db'}")
    try:
        async with engine.connect() as connection:
            raw = (await connection.get_raw_connection()).driver_connection
            assert raw is not None
            assert isinstance(raw._conn, sqlite3.Connection)  # aiosqlite's wrapped connection
            version = (await connection.execute(text("SELECT vec_version()"))).scalar_one()
            assert version.startswith("v")
    finally:
        await engine.dispose()


async def test_engine_errors_are_sqlalchemy_errors(tmp_path: pathlib.Path) -> None:
    """sqlean's exceptions are not the standard library's: the engine still maps them."""
    engine = db.make_engine(f"sqlite+aiosqlite:///{tmp_path / 'x.db'}")
    try:
        async with engine.begin() as connection:
            await connection.execute(text("CREATE TABLE t (id INTEGER PRIMARY KEY)"))
            await connection.execute(text("INSERT INTO t VALUES (1)"))
        with pytest.raises(IntegrityError):
            async with engine.begin() as connection:
                await connection.execute(text("INSERT INTO t VALUES (1)"))
        with pytest.raises(OperationalError):
            async with engine.connect() as connection:
                await connection.execute(text("SELECT * FROM missing"))
    finally:
        await engine.dispose()


async def test_transaction_thread_and_readiness_use_sqlean(tmp_path: pathlib.Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'x.db'}"
    engine = db.make_engine(url)
    runner = TxnRunner(engine)
    try:
        version = await runner.run(lambda conn: conn.execute(select(func.vec_version())).scalar())
        assert version.startswith("v")
        async with engine.begin() as connection:
            await connection.execute(text("CREATE TABLE alembic_version (version_num TEXT)"))
            await connection.execute(text("INSERT INTO alembic_version VALUES ('head')"))
        await database(engine, timeout_s=1).probe()
    finally:
        runner.close()
        await engine.dispose()


def test_connect_loads_sqlite_vec_and_turns_extension_loading_off(tmp_path) -> None:
    connection = connect(tmp_path / "x.db")
    try:
        assert connection.execute("SELECT vec_version()").fetchone()[0].startswith("v")
        with pytest.raises(sqlite3.OperationalError):
            connection.execute("SELECT load_extension('anything')")
    finally:
        connection.close()


def _sqlite_bypasses(path: pathlib.Path) -> list[str]:
    """Where `path` opens SQLite other than through services.common.sqlite_driver."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
            names += [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        bad = {"sqlite3", "aiosqlite", "sqlalchemy.ext.asyncio.create_async_engine"}
        found += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names if n in bad]
    return found


def test_nothing_opens_sqlite_around_the_driver() -> None:
    """The standard library's sqlite3, aiosqlite, or an engine made without the driver module
    would bring a second SQLite library (or its connections) into the process."""
    allowed = {DRIVER, ROOT / "services" / "common" / "db.py"}
    found = []
    for folder in ("services", "tests", "bench", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            if path not in allowed and "_pb2" not in path.name:
                found += _sqlite_bypasses(path)
    assert found == []
