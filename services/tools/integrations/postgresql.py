"""The `postgresql` integration: inspect a database and run read-only queries.

The connection comes from the organization's credential: an `api_key`-type secret whose one field is
`dsn` (`postgresql://user:password@host:port/database`). The connection requires TLS unless the
DSN's `sslmode` says otherwise (`?sslmode=disable` for a server without TLS; DEFAULT_SSLMODE). Every
action opens its own connection with `default_transaction_read_only=on` and a `statement_timeout`
equal to the action's time limit, runs inside a READ ONLY transaction, and closes the connection in
`finally` (also when the tool call is cancelled: asyncpg then sends the server a cancel request for
the running statement)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import decimal
import ipaddress
import logging
import re
import sys
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from services.tools import failures
from services.tools.catalogue import ActionContext, ActionError
from services.tools.integrations.postgresql_dsn import DEFAULT_SSLMODE, dsn_sslmode, parse_dsn
from services.tools.netpolicy import OutboundPolicyError, resolve_checked

if TYPE_CHECKING:
    import asyncpg

# asyncpg (~3 MiB resident) is imported by the first action that connects, not at start.

log = logging.getLogger(__name__)

MAX_ROWS_LIMIT = 1000

MANIFEST: dict[str, Any] = {
    "name": "postgresql",
    "display_name": "PostgreSQL",
    "description": "Inspect a PostgreSQL database (schemas, tables, columns) and run read-only SQL "
    "queries.",
    "categories": ["database", "developer-tools"],
    "auth": [
        {
            "type": "api_key",
            "label": "Connection URL",
            "description": "A PostgreSQL connection URL, kept encrypted as the credential's "
            "secret. "
            "Use a role with read access only, as a second safeguard.",
            "fields": {
                "type": "object",
                "properties": {
                    "dsn": {
                        "type": "string",
                        "pattern": "^postgres(ql)?://",
                        "description": "postgresql://user:password@host:5432/database",
                        "writeOnly": True,
                    }
                },
                "required": ["dsn"],
                "additionalProperties": False,
            },
        }
    ],
    "actions": [
        {
            "name": "list_schemas",
            "description": "List the database's schemas (system schemas left out).",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
            "credit_cost_millicredits": 100,
        },
        {
            "name": "list_tables",
            "description": "List tables and views, with their schema and kind.",
            "parameters": {
                "type": "object",
                "properties": {
                    "schema": {
                        "type": "string",
                        "description": "Only this schema (default: every non-system schema).",
                    }
                },
                "additionalProperties": False,
            },
            "credit_cost_millicredits": 100,
        },
        {
            "name": "describe_table",
            "description": "Describe a table: columns (type, nullable, default), primary key and "
            "indexes.",
            "parameters": {
                "type": "object",
                "properties": {
                    "table": {"type": "string", "minLength": 1, "description": "Table name."},
                    "schema": {
                        "type": "string",
                        "default": "public",
                        "description": "Schema name (default public).",
                    },
                },
                "required": ["table"],
                "additionalProperties": False,
            },
            "credit_cost_millicredits": 100,
        },
        {
            "name": "run_query",
            "description": "Run one read-only SQL statement (SELECT, WITH, EXPLAIN, SHOW) and "
            "return columns and rows. "
            "Writes are refused by the database. Use $1, $2... placeholders with `params`.",
            "parameters": {
                "type": "object",
                "properties": {
                    "sql": {"type": "string", "minLength": 1, "description": "One SQL statement."},
                    "params": {
                        "type": "array",
                        "items": {"type": ["string", "number", "boolean", "null"]},
                        "description": "Values for $1, $2, ... placeholders.",
                    },
                    "max_rows": {
                        "type": "integer",
                        "minimum": 1,
                        "maximum": MAX_ROWS_LIMIT,
                        "default": 100,
                        "description": "Return at most this many rows (rows_truncated tells if "
                        "there were more).",
                    },
                },
                "required": ["sql"],
                "additionalProperties": False,
            },
            "credit_cost_millicredits": 500,
        },
    ],
}


def iso_duration(value: datetime.timedelta) -> str:
    """`value` as an ISO 8601 duration (section 4.4.3.2), e.g. "P1DT2H3M4.5S", "-PT30M",
    "PT0S": what JSON libraries write for a duration (pydantic's timedelta), not Python's
    str() "1 day, 2:03:04.500000". Days stay days (PostgreSQL's
    interval as asyncpg reads it has no months part left)."""
    total = (value.days * 86_400 + value.seconds) * 1_000_000 + value.microseconds
    sign, total = ("-", -total) if total < 0 else ("", total)
    days, rest = divmod(total, 86_400 * 1_000_000)
    hours, rest = divmod(rest, 3_600 * 1_000_000)
    minutes, rest = divmod(rest, 60 * 1_000_000)
    seconds, micros = divmod(rest, 1_000_000)
    clock = (f"{hours}H" if hours else "") + (f"{minutes}M" if minutes else "")
    if seconds or micros:
        clock += (f"{seconds}.{micros:06d}".rstrip("0") if micros else str(seconds)) + "S"
    if not days and not clock:
        return "PT0S"
    return f"{sign}P" + (f"{days}D" if days else "") + (f"T{clock}" if clock else "")


def jsonable(value: Any) -> Any:
    """A JSON value for a PostgreSQL value: dates ISO 8601, intervals ISO 8601 durations
    (`iso_duration`), numerics and UUIDs as strings, bytes base64."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return (
            value if value == value and value not in (float("inf"), float("-inf")) else str(value)
        )
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return iso_duration(value)
    if isinstance(
        value,
        (
            uuid.UUID,
            ipaddress.IPv4Address,
            ipaddress.IPv6Address,
            ipaddress.IPv4Network,
            ipaddress.IPv6Network,
        ),
    ):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    asyncpg = sys.modules.get("asyncpg")  # a Record exists only once asyncpg was loaded
    if asyncpg is not None and isinstance(value, asyncpg.Record):
        return {k: jsonable(v) for k, v in value.items()}
    return str(value)


async def _connect_args(dsn: str, allow_private: bool) -> dict[str, Any]:
    """The driver's connection arguments for `dsn` under the outbound policy (URLs an
    organization supplies may not reach loopback, link-local or private addresses unless the
    operator allows them). Raises ActionError when refused.

    When the operator allows private networks, the whole DSN goes to the driver (host lists,
    sockets, every libpq parameter). Otherwise it is read once (`parse_dsn`), its host is
    resolved and checked, and the driver gets the parts — and the checked address, so no
    second lookup can lead elsewhere (DNS rebinding), except with sslmode=verify-full, whose
    certificate check must name the host (and fails for any other server).
    """
    if allow_private:
        return {"dsn": dsn, "ssl": dsn_sslmode(dsn) or DEFAULT_SSLMODE}
    parts = parse_dsn(dsn)
    try:
        addresses = await resolve_checked(parts.host, parts.port, False)
    except OutboundPolicyError as exc:  # the host is the credential's (a secret's part): not named
        raise ActionError(
            failures.policy_refusal(exc, "the database host in the credential")
        ) from exc
    args: dict[str, Any] = {
        "host": parts.host if parts.sslmode == "verify-full" else addresses[0],
        "port": parts.port,
        "user": parts.user,
        "password": parts.password,
        "database": parts.database,
    }
    args["ssl"] = parts.sslmode or DEFAULT_SSLMODE
    return args


@contextlib.asynccontextmanager
async def _readonly(ctx: ActionContext) -> AsyncIterator[asyncpg.Connection]:
    """A connection from the credential's DSN inside a READ ONLY transaction; closed on exit.

    Raises ActionError when there is no DSN or the server cannot be reached.
    """
    dsn = (ctx.secret or {}).get("dsn")
    if not isinstance(dsn, str) or not dsn:
        raise ActionError(
            "the credential has no `dsn` field; connect a PostgreSQL credential with a connection "
            "URL"
        )
    dsn = dsn.replace("postgresql+asyncpg://", "postgresql://", 1)
    target = await _connect_args(dsn, ctx.allow_private_network)
    timeout_ms = max(1, int(ctx.timeout_s * 1000))
    import asyncpg

    try:
        connection = await asyncpg.connect(
            **target,
            timeout=min(ctx.timeout_s, 10.0),
            statement_cache_size=0,
            server_settings={
                "application_name": "loopline-tools",
                "default_transaction_read_only": "on",
                "statement_timeout": str(timeout_ms),
                "idle_in_transaction_session_timeout": str(timeout_ms),
            },
        )
    except (
        TimeoutError,
        OSError,
        asyncpg.PostgresError,
        asyncpg.InterfaceError,
        ValueError,
    ) as exc:
        raise ActionError(f"could not connect to PostgreSQL: {_connect_failure(exc)}") from exc
    try:
        try:
            async with connection.transaction(readonly=True):
                yield connection
        except Exception:
            # the action's time limit cut a statement: the rollback on the interrupted connection
            # fails ("connection is closed"); the cancel is what happened
            if _cancelling():
                raise asyncio.CancelledError from None
            raise
    finally:
        # Runs on success, error and cancellation alike; never leaves a connection open.
        try:
            await asyncio.wait_for(connection.close(), timeout=5)
        except BaseException:  # noqa: BLE001 - a close that fails or hangs must not leak the socket
            connection.terminate()
            # while cancelled, the cancel goes on (the time limit's answer), not the close's error
            if not _cancelling():
                raise


# What a failed connection is called (`_connect_failure`), by the server's SQLSTATE class or code.
_CONNECT_SQLSTATES = {
    "28P01": "authentication failed (check the user name and password in the credential)",
    "28000": "the server refused the user (check the user name in the credential and the server's "
    "pg_hba.conf)",
    "3D000": "the database named in the credential does not exist",
    "53300": "the server has too many connections; try again later",
    "57P03": "the server is starting up or shutting down; try again later",
}
_QUERY_PARAMETER = re.compile(r"query argument \$(\d+)")
_ARGUMENT_COUNT = re.compile(r"expects (\d+) arguments?.*?(\d+) (?:was|were) passed")
_SQLSTATE = re.compile(r"[0-9A-Z]{5}")


def _connect_failure(exc: BaseException) -> str:
    """Why the connection failed, built from the exception's type and SQLSTATE, never its text
    (which names the host and address: the credential's)."""
    sqlstate = getattr(exc, "sqlstate", None)
    if isinstance(sqlstate, str) and _SQLSTATE.fullmatch(sqlstate):
        return (
            _CONNECT_SQLSTATES.get(sqlstate)
            or _CONNECT_SQLSTATES.get(sqlstate[:2] + "000")
            or (f"the server refused the connection (SQLSTATE {sqlstate})")
        )
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return failures.TIMED_OUT_CONNECTING
    kind = failures.network_failure(exc)
    if kind is not None:
        return kind
    if isinstance(exc, ValueError):
        return "the connection settings in the credential are not valid"
    if "ssl" in type(exc).__name__.lower() or "SSL" in str(
        exc
    ):  # asyncpg's "rejected SSL upgrade", an sslmode the server refuses
        return "the server refused TLS, or TLS failed (check sslmode in the credential's dsn)"
    return "the server could not be reached or broke the connection"


def _query_failure(exc: BaseException) -> str:
    """The database's own answer to the query: its SQLSTATE, condition name, primary message and
    hint (never DETAIL, which may quote row values). That message is the server's reply to the
    model's own statement (like a response body), which the model needs to correct it (`column
    "nme" does not exist`); an error asyncpg raised itself has no server message and is named
    by `_parameter_failure`."""
    message = getattr(exc, "message", None)
    if not isinstance(message, str) or not message:
        return _parameter_failure(exc)
    sqlstate = getattr(exc, "sqlstate", None)
    code = f" {sqlstate}" if isinstance(sqlstate, str) and _SQLSTATE.fullmatch(sqlstate) else ""
    text = f"PostgreSQL error{code} ({type(exc).__name__}): {' '.join(message.split())}"
    hint = getattr(exc, "hint", None)
    if isinstance(hint, str) and hint:
        text += f" (hint: {' '.join(hint.split())})"
    return text


def _parameter_failure(exc: BaseException) -> str:
    """Which query parameter does not fit, built from the placeholder's number or the counts in
    asyncpg's message (never its text, which quotes the value)."""
    text = str(exc)
    counts = _ARGUMENT_COUNT.search(text)
    if counts:
        return (
            f"invalid query parameters: the query takes {counts.group(1)} parameter(s) "
            f"($1, $2, ...), {counts.group(2)} given in params"
        )
    number = _QUERY_PARAMETER.search(text)
    if number:
        return (
            f"invalid query parameters: the value for ${number.group(1)} "
            "does not fit its placeholder's type"
        )
    return "invalid query parameters: a value in params does not fit its placeholder ($1, $2, ...)"


def _cancelling() -> bool:
    """Whether the current task is being cancelled (the action's time limit, `asyncio.timeout`, or
    the call's end). Found as a flaky test under load: a 1 s limit that fired with the server's
    own statement_timeout answered "InterfaceError: cannot perform operation: connection is
    closed" (the rollback's error) instead of "timed out after 1 s"."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def list_schemas(ctx: ActionContext, params: dict[str, Any]) -> dict[str, Any]:
    """{"schemas": [name, ...]} — every schema except pg_catalog, information_schema and
    pg_toast*."""
    async with _readonly(ctx) as conn:
        rows = await conn.fetch(
            "SELECT nspname FROM pg_namespace WHERE nspname NOT IN ('pg_catalog', "
            "'information_schema') "
            "AND nspname NOT LIKE 'pg_toast%' AND nspname NOT LIKE 'pg_temp_%' ORDER BY nspname"
        )
    return {"schemas": [r["nspname"] for r in rows]}


async def list_tables(ctx: ActionContext, params: dict[str, Any]) -> dict[str, Any]:
    """{"tables": [{"schema", "name", "type"}]} where type is "BASE TABLE", "VIEW", ...
    (information_schema)."""
    schema = params.get("schema")
    async with _readonly(ctx) as conn:
        rows = await conn.fetch(
            "SELECT table_schema, table_name, table_type FROM information_schema.tables "
            "WHERE ($1::text IS NULL AND table_schema NOT IN ('pg_catalog', 'information_schema')) "
            "OR table_schema = $1::text ORDER BY table_schema, table_name",
            schema,
        )
    return {
        "tables": [
            {"schema": r["table_schema"], "name": r["table_name"], "type": r["table_type"]}
            for r in rows
        ]
    }


async def describe_table(ctx: ActionContext, params: dict[str, Any]) -> dict[str, Any]:
    """{"schema", "table", "columns": [{"name", "type", "nullable", "default"}], "primary_key":
    [...], "indexes": [{"name", "definition"}]}. Raises ActionError when the table does not
    exist."""
    schema, table = params.get("schema") or "public", params["table"]
    async with _readonly(ctx) as conn:
        columns = await conn.fetch(
            "SELECT column_name, data_type, is_nullable, column_default FROM "
            "information_schema.columns "
            "WHERE table_schema = $1 AND table_name = $2 ORDER BY ordinal_position",
            schema,
            table,
        )
        if not columns:
            raise ActionError(
                f"table {schema}.{table} not found (call list_tables to see the tables)"
            )
        primary_key = await conn.fetch(
            "SELECT a.attname FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = ANY(i.indkey) "
            "WHERE i.indisprimary AND n.nspname = $1 AND c.relname = $2 ORDER BY "
            "array_position(i.indkey, a.attnum)",
            schema,
            table,
        )
        indexes = await conn.fetch(
            "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = $1 AND tablename = $2 "
            "ORDER BY indexname",
            schema,
            table,
        )
    return {
        "schema": schema,
        "table": table,
        "columns": [
            {
                "name": r["column_name"],
                "type": r["data_type"],
                "nullable": r["is_nullable"] == "YES",
                "default": r["column_default"],
            }
            for r in columns
        ],
        "primary_key": [r["attname"] for r in primary_key],
        "indexes": [{"name": r["indexname"], "definition": r["indexdef"]} for r in indexes],
    }


async def run_query(ctx: ActionContext, params: dict[str, Any]) -> dict[str, Any]:
    """{"columns": [{"name", "type"}], "rows": [[value, ...]], "row_count": n, "rows_truncated":
    bool}.

    One statement only (asyncpg's extended protocol refuses several). Raises
    ActionError with PostgreSQL's answer on an SQL error (`_query_failure`: SQLSTATE,
    condition, message, hint), e.g. "cannot execute INSERT in a read-only transaction" for a
    write; for a parameter that does not fit, which one (`_parameter_failure`).
    """
    max_rows = int(params.get("max_rows", 100))
    args = params.get("params") or []
    import asyncpg

    async with _readonly(ctx) as conn:
        try:
            statement = await conn.prepare(params["sql"])
            attributes = statement.get_attributes()
            if attributes:
                cursor = await statement.cursor(*args)
                records = await cursor.fetch(max_rows + 1)
            else:
                await statement.fetch(*args)
                records = []
        except asyncpg.PostgresError as exc:
            raise ActionError(_query_failure(exc)) from exc
        except (asyncpg.InterfaceError, TypeError, ValueError, OverflowError) as exc:
            raise ActionError(_parameter_failure(exc)) from exc
    truncated = len(records) > max_rows
    records = records[:max_rows]
    return {
        "columns": [{"name": a.name, "type": a.type.name} for a in attributes],
        "rows": [[jsonable(v) for v in record.values()] for record in records],
        "row_count": len(records),
        "rows_truncated": truncated,
    }


HANDLERS = {
    "list_schemas": list_schemas,
    "list_tables": list_tables,
    "describe_table": describe_table,
    "run_query": run_query,
}
