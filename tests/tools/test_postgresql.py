"""The postgresql integration against the local PostgreSQL: inspection, read-only queries, limits,
cancel."""

from __future__ import annotations

import asyncio
import datetime
import time
import uuid

import asyncpg
import pytest

from loopline.tools.v1 import tools_pb2
from services.common import pb
from services.tools.integrations.postgresql import iso_duration, jsonable


def run(action: str, **parameters):
    return {"integration": "postgresql", "action": action, "parameters": parameters}


@pytest.fixture
async def pg_tools(start_tools, pg_schema, pg_dsn):
    """A tools server whose operator allows private addresses (the test database is on loopback)."""
    tools = await start_tools(tools_allow_private_network=True)
    await tools.create_credential("postgresql", {"dsn": pg_dsn})
    return tools


async def test_list_schemas_and_tables_and_describe_table(pg_tools, pg_schema):
    schemas = (await pg_tools.ok("execute_integration_tool", run("list_schemas")))["result"][
        "schemas"
    ]
    assert pg_schema in schemas and "public" in schemas
    assert "pg_catalog" not in schemas

    tables = (await pg_tools.ok("execute_integration_tool", run("list_tables", schema=pg_schema)))[
        "result"
    ]["tables"]
    assert tables == [{"schema": pg_schema, "name": "items", "type": "BASE TABLE"}]

    described = (
        await pg_tools.ok(
            "execute_integration_tool", run("describe_table", schema=pg_schema, table="items")
        )
    )["result"]
    assert [c["name"] for c in described["columns"]] == ["id", "name", "price"]
    assert described["columns"][1] == {
        "name": "name",
        "type": "text",
        "nullable": False,
        "default": None,
    }
    assert described["primary_key"] == ["id"]
    assert described["indexes"][0]["name"] == "items_pkey"

    error = await pg_tools.failed(
        "execute_integration_tool", run("describe_table", schema=pg_schema, table="nope")
    )
    assert f"table {pg_schema}.nope not found" in error


async def test_run_query_returns_columns_rows_and_costs_the_action_price(pg_tools, pg_schema):
    response = await pg_tools.tool(
        "execute_integration_tool",
        run(
            "run_query",
            sql=f"SELECT id, name, price FROM {pg_schema}.items WHERE id >= $1 ORDER BY id",
            params=[2],
        ),
    )
    assert response.success, response.error
    assert response.millicredits == 500
    result = pb.output_of(response)["result"]
    assert result["columns"] == [
        {"name": "id", "type": "int4"},
        {"name": "name", "type": "text"},
        {"name": "price", "type": "numeric"},
    ]
    assert result["rows"] == [[2, "banana", "0.25"], [3, "cherry", "12.00"]]
    assert result["row_count"] == 2 and result["rows_truncated"] is False

    limited = (
        await pg_tools.ok(
            "execute_integration_tool",
            run("run_query", sql=f"SELECT * FROM {pg_schema}.items", max_rows=1),
        )
    )["result"]
    assert limited["row_count"] == 1 and limited["rows_truncated"] is True


async def test_write_queries_are_refused_by_the_read_only_transaction(pg_tools, pg_schema, pg_dsn):
    for sql in (
        f"INSERT INTO {pg_schema}.items VALUES (4, 'durian', 9)",
        f"DELETE FROM {pg_schema}.items",
        f"CREATE TABLE {pg_schema}.evil (x int)",
        f"WITH gone AS (DELETE FROM {pg_schema}.items RETURNING *) SELECT count(*) FROM gone",
    ):
        error = await pg_tools.failed("execute_integration_tool", run("run_query", sql=sql))
        assert "read-only transaction" in error, error
    # Sneaking out of the transaction with a second statement is refused too.
    error = await pg_tools.failed(
        "execute_integration_tool", run("run_query", sql=f"COMMIT; DELETE FROM {pg_schema}.items")
    )
    assert "PostgreSQL error" in error
    connection = await asyncpg.connect(pg_dsn)
    try:
        assert await connection.fetchval(f"SELECT count(*) FROM {pg_schema}.items") == 3
    finally:
        await connection.close()


async def test_slow_query_returns_a_timeout_error_within_the_limit(start_tools, pg_schema, pg_dsn):
    tools = await start_tools(tools_timeout_s=1.0, tools_allow_private_network=True)
    await tools.create_credential("postgresql", {"dsn": pg_dsn})
    started = time.monotonic()
    error = await tools.failed(
        "execute_integration_tool", run("run_query", sql="SELECT pg_sleep(20)")
    )
    assert time.monotonic() - started < 3.0
    # Either limit may fire first: the service's own, or the server's statement_timeout.
    assert "timed out after 1 s" in error or "statement timeout" in error


async def _sessions_with(dsn: str, marker: str, active_only: bool) -> int:
    # pg_stat_activity keeps a session's last query while it is idle: with active_only=False
    # this counts the sessions that ran the marked query and are still open.
    connection = await asyncpg.connect(dsn)
    try:
        return await connection.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE query LIKE $1 AND pid <> pg_backend_pid() "
            "AND (state = 'active' OR NOT $2::bool)",
            f"%{marker}%",
            active_only,
        )
    finally:
        await connection.close()


async def test_cancelled_call_stops_the_running_query_and_closes_its_connection(pg_tools, pg_dsn):
    marker = f"loopline_cancel_probe_{uuid.uuid4().hex[:8]}"
    call = pg_tools.stub.ExecuteTool(
        tools_pb2.ExecuteToolRequest(
            organization_id="org-a",
            tool="execute_integration_tool",
            input=pb.to_struct(run("run_query", sql=f"SELECT pg_sleep(20) AS {marker}")),
        )
    )
    for _ in range(50):
        await asyncio.sleep(0.1)
        if await _sessions_with(pg_dsn, marker, active_only=True):
            break
    else:
        pytest.fail("the query never started")
    call.cancel()
    for _ in range(50):
        await asyncio.sleep(0.1)
        if await _sessions_with(pg_dsn, marker, active_only=False) == 0:
            break
    else:
        pytest.fail(
            "the query kept running, or its connection stayed open, after the call was cancelled"
        )


async def test_connection_errors_never_show_the_password(start_tools, pg_schema):
    tools = await start_tools(tools_allow_private_network=True)
    await tools.create_credential(
        "postgresql", {"dsn": "postgresql://postgres:Sup3rSecretPw@127.0.0.1:1/test"}
    )
    error = await tools.failed("execute_integration_tool", run("list_schemas"))
    assert "could not connect to PostgreSQL" in error
    assert "Sup3rSecretPw" not in error


async def test_outbound_policy_refuses_a_loopback_or_socket_dsn_by_default(tools_service, pg_dsn):
    await tools_service.create_credential("postgresql", {"dsn": pg_dsn})
    error = await tools_service.failed("execute_integration_tool", run("list_schemas"))
    assert "not allowed" in error and "loopback" in error
    await tools_service.create_credential(
        "postgresql",
        {"dsn": "postgresql://postgres@/test?host=/var/run/postgresql"},
        make_default=True,
    )
    error = await tools_service.failed("execute_integration_tool", run("list_schemas"))
    assert "not allowed" in error


# Security: urlsplit reads the host after the LAST "@" while asyncpg connects to the one after
# the FIRST, and ignores what follows a bracketed host; the policy refuses such DSNs, which would
# pass the check as 8.8.8.8 and connect to the local PostgreSQL as its superuser.
@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://postgres@[::ffff:127.0.0.1]:5432@8.8.8.8/test",
        "postgresql://postgres@127.0.0.1:5432@8.8.8.8/test",
        "postgresql://postgres:pw@127.0.0.1@8.8.8.8/test",
        "postgresql://postgres@[::ffff:127.0.0.1]x@8.8.8.8/test",
        "postgresql://postgres@8.8.8.8/test?host=127.0.0.1",
        "postgresql://postgres@8.8.8.8/test?hostaddr=127.0.0.1",
        "postgresql://postgres@8.8.8.8,127.0.0.1/test",
        "postgresql://postgres@8.8.8.8/test?sslrootcert=/etc/passwd",
        "postgresql://postgres@8.8.8.8/test?passfile=/root/.pgpass",
    ],
)
async def test_a_dsn_read_one_way_by_the_policy_and_another_by_the_driver_is_refused(
    tools_service, dsn, monkeypatch
):
    import asyncpg as driver

    connected: list[dict] = []

    async def spy(*args, **kwargs):
        connected.append(kwargs)
        raise OSError("not connecting in this test")

    monkeypatch.setattr(driver, "connect", spy)
    await tools_service.create_credential("postgresql", {"dsn": dsn}, make_default=True)
    error = await tools_service.failed("execute_integration_tool", run("list_schemas"))
    assert connected == [], (dsn, connected)
    assert "dsn" in error or "not allowed" in error, error


def test_the_dsn_is_parsed_once_and_the_driver_gets_its_parts():
    from services.tools.integrations.postgresql_dsn import DsnError, parse_dsn

    parts = parse_dsn(
        "postgresql://us%40er:p%40ss@db.example.com:6543/my%2Fdb?sslmode=verify-full&application_name=x"
    )
    assert (parts.host, parts.port, parts.user, parts.password, parts.database, parts.sslmode) == (
        "db.example.com",
        6543,
        "us@er",
        "p@ss",
        "my/db",
        "verify-full",
    )
    bare = parse_dsn("postgres://[2001:db8::1]/")
    assert (bare.host, bare.port, bare.user, bare.password, bare.database, bare.sslmode) == (
        "2001:db8::1",
        5432,
        "postgres",
        "",
        "postgres",
        None,
    )
    for bad in (
        "mysql://h/db",
        "postgresql:///db",
        "postgresql://h:99999/db",
        "postgresql://h/db?sslmode=sometimes",
        "postgresql://a@b@h/db",
        "postgresql://h/db?options=-c%20x",
    ):
        with pytest.raises(DsnError):
            parse_dsn(bad)


async def test_the_driver_connects_to_the_checked_address_not_the_name_again(
    start_tools, monkeypatch
):
    """No second lookup between the check and the connection (DNS rebinding): the driver gets
    the address the policy checked (the host name only for sslmode=verify-full, whose
    certificate check names the host)."""
    import asyncpg as driver

    from services.tools import netpolicy

    async def resolved(host, port, allow_private):
        return ["93.184.216.34"]

    connected: list[dict] = []

    async def spy(*args, **kwargs):
        connected.append(kwargs)
        raise OSError("not connecting in this test")

    monkeypatch.setattr(netpolicy, "resolve_checked", resolved)
    monkeypatch.setattr("services.tools.integrations.postgresql.resolve_checked", resolved)
    monkeypatch.setattr(driver, "connect", spy)
    tools = await start_tools()
    await tools.create_credential("postgresql", {"dsn": "postgresql://u:pw@db.example.com/x"})
    await tools.failed("execute_integration_tool", run("list_schemas"))
    assert (
        connected[-1]["host"] == "93.184.216.34"
        and connected[-1]["user"] == "u"
        and connected[-1]["database"] == "x"
    )
    assert connected[-1]["password"] == "pw" and "dsn" not in connected[-1]
    await tools.create_credential(
        "postgresql",
        {"dsn": "postgresql://u:pw@db.example.com/x?sslmode=verify-full"},
        make_default=True,
    )
    await tools.failed("execute_integration_tool", run("list_schemas"))
    assert connected[-1]["host"] == "db.example.com" and connected[-1]["ssl"] == "verify-full"


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (datetime.timedelta(days=1), "P1D"),
        (datetime.timedelta(days=1, hours=2, minutes=3, seconds=4.5), "P1DT2H3M4.5S"),
        (datetime.timedelta(minutes=-30), "-PT30M"),
        (datetime.timedelta(0), "PT0S"),
        (datetime.timedelta(microseconds=1), "PT0.000001S"),
        (datetime.timedelta(days=-1, hours=23), "-PT1H"),
        (datetime.timedelta(seconds=59), "PT59S"),
    ],
)
def test_an_interval_is_an_iso_8601_duration(value, text):
    # an interval column is not Python's str() of a timedelta ("1 day, 0:00:00")
    assert jsonable(value) == text == iso_duration(value)
