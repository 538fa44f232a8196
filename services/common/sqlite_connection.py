"""A sqlean `sqlite3` connection in SQLAlchemy's `Connection.execute` shape (`txn`'s SQLite side).

Each prebuilt Core statement is compiled once to SQL text and then executed as a raw DBAPI
call, with no SQLAlchemy execution machinery per statement; parameters and results are
converted for the column types the services use (datetimes, dates, booleans, JSON).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

from sqlalchemy import JSON, Boolean, Date, DateTime
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.exc import DBAPIError, MultipleResultsFound, NoResultFound

from services.common.sqlite_driver import sqlite3

# The dialect prebuilt statements are compiled with: sqlite3 accepts ":name" parameters
# from a dict, so the caller's parameter dict is passed straight through.
_NAMED_SQLITE = sqlite_dialect.dialect(paramstyle="named")


def _datetime_text(value: datetime.datetime | None) -> str | None:
    """A datetime as SQLAlchemy's SQLite DATETIME stores it (naive UTC, microseconds)."""
    if value is None:
        return None
    if value.tzinfo is not None:
        if value.tzinfo is not datetime.UTC:
            value = value.astimezone(datetime.UTC)
        value = value.replace(tzinfo=None)
    return value.isoformat(" ", "microseconds")


def _date_text(value: datetime.date | None) -> str | None:
    return None if value is None else value.isoformat()


def _datetime_value(text: str | None) -> datetime.datetime | None:
    return (
        None if text is None else datetime.datetime.fromisoformat(text).replace(tzinfo=datetime.UTC)
    )


def _date_value(text: str | None) -> datetime.date | None:
    return None if text is None else datetime.date.fromisoformat(text)


def _kind(type_: Any) -> str | None:
    """The kind of value conversion a column type needs on SQLite: "datetime" (also a
    TypeDecorator over DateTime), "date", "json", "boolean", or None (stored as it comes)."""
    if isinstance(type_, DateTime) or isinstance(getattr(type_, "impl_instance", None), DateTime):
        return "datetime"
    if isinstance(type_, Date):
        return "date"
    if isinstance(type_, JSON):
        return "json"
    if isinstance(type_, Boolean):
        return "boolean"
    return None


# Parameter values out to sqlite3, and column values back, as SQLAlchemy's SQLite types convert
# them.
_BIND_CONVERTERS: dict[str | None, Callable[[Any], Any]] = {
    "datetime": _datetime_text,
    "date": _date_text,
    "json": lambda value: None if value is None else json.dumps(value),
}
_RESULT_CONVERTERS: dict[str | None, Callable[[Any], Any]] = {
    "datetime": _datetime_value,
    "date": _date_value,
    "json": lambda text: None if text is None else json.loads(text),
    "boolean": lambda value: None if value is None else bool(value),
}


class _Compiled(NamedTuple):
    """A statement compiled for SQLite: SQL text, default parameters, converters, and `make_row`
    (the `_make` of the result's namedtuple row type; None for a statement without rows)."""

    statement: Any  # kept alive so that id(statement) stays unique while cached
    sql: str
    defaults: dict[str, Any]
    binds: tuple[tuple[str, Callable[[Any], Any]], ...]
    make_row: Callable[[Iterable[Any]], Any] | None
    columns: tuple[tuple[int, Callable[[Any], Any]], ...]


def _compile(statement: Any, keys: tuple[str, ...] | None) -> _Compiled:
    compiled = statement.compile(
        dialect=_NAMED_SQLITE, column_keys=list(keys) if keys is not None else None
    )
    params = compiled.params
    if keys is not None:  # an INSERT: every column it renders must come from the caller
        missing = [name for name in params if name not in keys]
        if missing:
            raise ValueError(f"INSERT into {statement.table.name} needs values for {missing}")
    # values written into the statement (e.g. `.values(running_id=None)`), not the caller's
    # bindparam()s
    defaults = {
        name: value
        for name, value in params.items()
        if keys is None and not compiled.binds[name].required
    }
    binds = tuple(
        (name, convert)
        for name in params
        if (convert := _BIND_CONVERTERS.get(_kind(compiled.binds[name].type))) is not None
    )
    make_row: Callable[[Iterable[Any]], Any] | None = None
    columns: tuple[tuple[int, Callable[[Any], Any]], ...] = ()
    exported = list(getattr(statement, "exported_columns", ()) or ())
    if exported:
        names = [column.key for column in exported]
        # attr-defined: mypy types a namedtuple of run-time field names as a plain tuple
        make_row = collections.namedtuple("Row", names, rename=True)._make  # type: ignore[attr-defined]
        columns = tuple(
            (index, convert)
            for index, column in enumerate(exported)
            if (convert := _RESULT_CONVERTERS.get(_kind(column.type))) is not None
        )
    return _Compiled(statement, str(compiled), defaults, binds, make_row, columns)


class _Scalars:
    __slots__ = ("_rows",)

    def __init__(self, rows: list[Any]) -> None:
        self._rows = rows

    def all(self) -> list[Any]:
        return [row[0] for row in self._rows]


class SqliteResult:
    """The result of `SqliteConnection.execute`: rows fetched eagerly, SQLAlchemy Result's shape.

    Attributes:
        rowcount: rows changed by an INSERT/UPDATE/DELETE (sqlite3 `rowcount`).
    """

    __slots__ = ("rowcount", "_rows")

    def __init__(self, rowcount: int, rows: list[Any]) -> None:
        self.rowcount = rowcount
        self._rows = rows

    def first(self) -> Any:
        """The first row or None."""
        return self._rows[0] if self._rows else None

    def one(self) -> Any:
        """The only row; raises NoResultFound / MultipleResultsFound otherwise."""
        if not self._rows:
            raise NoResultFound("No row was found when one was required")
        if len(self._rows) > 1:
            raise MultipleResultsFound("Multiple rows were found when exactly one was required")
        return self._rows[0]

    def scalar(self) -> Any:
        """The first column of the first row, or None."""
        return self._rows[0][0] if self._rows else None

    def scalars(self) -> _Scalars:
        """The first column of every row (`.all()`)."""
        return _Scalars(self._rows)

    def all(self) -> list[Any]:
        """Every row."""
        return list(self._rows)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._rows)


class SqliteConnection:
    """The connection a transaction function gets on SQLite (the worker thread's `sqlite3` one).

    `execute(statement, params)` takes the same prebuilt SQLAlchemy Core statements and
    parameter dicts as `sqlalchemy.engine.Connection.execute` and returns a `SqliteResult`
    (rows are named tuples, dates and datetimes converted as SQLAlchemy's SQLite types do).
    A statement is compiled once per process and cached by identity, so it must be built
    once (module level), not per call. Driver errors are raised as SQLAlchemy's
    (`IntegrityError`, `OperationalError`, ...) like on the other backend.
    """

    dialect = _NAMED_SQLITE
    _CACHE_LIMIT = 512

    def __init__(self, raw: sqlite3.Connection) -> None:
        self._raw = raw
        self._cache: dict[tuple[int, tuple[str, ...] | None], _Compiled] = {}

    def _compiled(self, statement: Any, params: dict[str, Any]) -> _Compiled:
        keys = tuple(params) if getattr(statement, "is_insert", False) else None
        key = (id(statement), keys)
        compiled = self._cache.get(key)
        if compiled is None or compiled.statement is not statement:
            if len(self._cache) >= self._CACHE_LIMIT:
                self._cache.clear()
            compiled = self._cache[key] = _compile(statement, keys)
        return compiled

    def execute(
        self, statement: Any, params: dict[str, Any] | list[dict[str, Any]] | None = None
    ) -> SqliteResult:
        """Execute `statement` with `params` (a dict of its bound parameter names), or once per
        dict of a list of them with the same keys (one `executemany`, as SQLAlchemy's
        `Connection.execute` does with a list; rows are written in the list's order; the
        result has no rows)."""
        if isinstance(params, list):
            return self._execute_many(statement, params)
        params = params or {}
        compiled = self._compiled(statement, params)
        values = self._values(compiled, params)
        try:
            cursor = self._raw.execute(compiled.sql, values)
            rows: list[Any] = []
            make = compiled.make_row
            if make is not None:
                for raw_row in cursor.fetchall():
                    if compiled.columns:
                        raw_row = list(raw_row)
                        for index, convert in compiled.columns:
                            raw_row[index] = convert(raw_row[index])
                    rows.append(make(raw_row))
            return SqliteResult(cursor.rowcount, rows)
        except sqlite3.Error as error:
            raise DBAPIError.instance(compiled.sql, values, error, sqlite3.Error) from error

    @staticmethod
    def _values(compiled: _Compiled, params: dict[str, Any]) -> dict[str, Any]:
        values = {**compiled.defaults, **params} if compiled.defaults else dict(params)
        for name, convert in compiled.binds:
            if name in values:
                values[name] = convert(values[name])
        return values

    def _execute_many(self, statement: Any, rows: list[dict[str, Any]]) -> SqliteResult:
        if not rows:
            return SqliteResult(0, [])
        compiled = self._compiled(statement, rows[0])
        values = [self._values(compiled, params) for params in rows]
        try:
            cursor = self._raw.executemany(compiled.sql, values)
            return SqliteResult(cursor.rowcount, [])
        except sqlite3.Error as error:
            raise DBAPIError.instance(compiled.sql, values, error, sqlite3.Error) from error

    @contextlib.contextmanager
    def begin_nested(self) -> Iterator[None]:
        """A SAVEPOINT inside the current transaction: released on exit, rolled back on error."""
        self._raw.execute("SAVEPOINT nested")
        try:
            yield
        except BaseException:
            self._raw.execute("ROLLBACK TO nested")
            self._raw.execute("RELEASE nested")
            raise
        self._raw.execute("RELEASE nested")
