"""Fixtures of the tools service tests: a real grpc.aio server on port 0 with SQLite in tmp_path.

PostgreSQL tests use the local server at postgresql://postgres@127.0.0.1:5432/test
(trust auth) and are skipped, with the reason, only when it cannot be reached.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import asyncpg
import grpc
import pytest

from loopline.tools.v1 import tools_pb2, tools_pb2_grpc
from services.common import pb
from services.tools.config import ToolsSettings
from services.tools.server import ToolsServer

# The local server has no TLS: said explicitly (TLS is required otherwise).
PG_DSN = "postgresql://postgres@127.0.0.1:5432/test?sslmode=disable"
ORG = "org-a"
OTHER_ORG = "org-b"


class ToolsClient:
    """A started ToolsServer with a stub, and helpers that speak JSON."""

    def __init__(
        self, server: ToolsServer, channel: grpc.aio.Channel, settings: ToolsSettings
    ) -> None:
        self.server = server
        self.channel = channel
        self.settings = settings
        self.stub = tools_pb2_grpc.ToolsServiceStub(channel)

    async def tool(
        self, tool: str, tool_input: dict[str, Any], org: str = ORG
    ) -> tools_pb2.ExecuteToolResponse:
        """ExecuteTool for `org`."""
        return await self.stub.ExecuteTool(
            tools_pb2.ExecuteToolRequest(
                organization_id=org,
                tool=tool,
                input=pb.to_struct(tool_input),
                run_id="run-1",
                tool_call_id="call-1",
            )
        )

    async def ok(self, tool: str, tool_input: dict[str, Any], org: str = ORG) -> Any:
        """ExecuteTool that must succeed; returns the output as JSON."""
        response = await self.tool(tool, tool_input, org)
        assert response.success, response.error
        assert response.error == ""
        return pb.output_of(response)

    async def failed(self, tool: str, tool_input: dict[str, Any], org: str = ORG) -> str:
        """ExecuteTool that must fail as a result (not an RPC error); returns the error text."""
        response = await self.tool(tool, tool_input, org)
        assert not response.success, pb.output_of(response)
        assert response.error
        assert response.millicredits == 0
        return response.error

    async def create_credential(
        self,
        integration: str,
        auth_data: dict[str, Any],
        org: str = ORG,
        auth_type: str = "",
        **kwargs: Any,
    ) -> tools_pb2.Credential:
        """CreateCredential; returns the Credential message."""
        response = await self.stub.CreateCredential(
            tools_pb2.CreateCredentialRequest(
                organization_id=org,
                integration_name=integration,
                auth_type=auth_type,
                auth_data=pb.to_struct(auth_data),
                **kwargs,
            )
        )
        return response.credential


StartTools = Callable[..., Awaitable[ToolsClient]]


@pytest.fixture
async def start_tools(tmp_path) -> AsyncIterator[StartTools]:
    """A factory: `await start_tools(**settings)` starts a ToolsServer (own SQLite file) and
    returns its client."""
    started: list[ToolsClient] = []

    async def start(**overrides: Any) -> ToolsClient:
        data_dir = tmp_path / f"server{len(started)}"
        # Explicit values, so that LOOPLINE_* variables in the environment cannot change a test.
        defaults: dict[str, Any] = {
            "tools_database_url": "",
            "auto_migrate": True,
            "tools_timeout_s": 30.0,
            "tools_max_output_bytes": 64 * 1024,
            "tools_credential_key": "",
            "tools_allow_private_network": False,
            "tools_search_millicredits": 100,
            "host": "127.0.0.1",
        }
        settings = ToolsSettings(data_dir=data_dir, tools_port=0, **{**defaults, **overrides})
        server = await ToolsServer.start(settings)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        client = ToolsClient(server, channel, settings)
        started.append(client)
        return client

    yield start
    for client in started:
        await client.channel.close()
        await client.server.stop(0)


@pytest.fixture
async def tools_service(start_tools: StartTools) -> ToolsClient:
    """A tools server with the default settings (outbound policy: public addresses only)."""
    return await start_tools()


@pytest.fixture
def pg_dsn() -> str:
    """The local PostgreSQL's URL (tests import no module of this folder: fixtures only)."""
    return PG_DSN


@pytest.fixture
async def pg_database(pg_dsn: str) -> AsyncIterator[str]:
    """A throwaway PostgreSQL database for the tools service's own tables (its SQLAlchemy URL),
    dropped afterwards.

    Skips the test when PostgreSQL is unreachable.
    """
    try:
        admin = await asyncpg.connect(pg_dsn, timeout=3)
    except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
        pytest.skip(f"local PostgreSQL at {pg_dsn} is unreachable ({type(exc).__name__})")
    name = f"loopline_tools_{uuid.uuid4().hex[:10]}"
    await admin.execute(f"CREATE DATABASE {name}")
    try:
        yield f"postgresql+asyncpg://postgres@127.0.0.1:5432/{name}"
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.close()


@pytest.fixture
async def pg_schema() -> AsyncIterator[str]:
    """A fresh schema in the local PostgreSQL with a table `items(id, name, price)` of 3 rows.

    Skips the test when PostgreSQL is unreachable. Drops the schema afterwards.
    """
    try:
        connection = await asyncpg.connect(PG_DSN, timeout=3)
    except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
        pytest.skip(
            f"local PostgreSQL at {PG_DSN} is unreachable ({type(exc).__name__});"
            " postgresql tests need it"
        )
    schema = f"tools_test_{uuid.uuid4().hex[:10]}"
    await connection.execute(f"CREATE SCHEMA {schema}")
    await connection.execute(
        f"CREATE TABLE {schema}.items (id int PRIMARY KEY, name text NOT NULL, price numeric(8,2))"
    )
    await connection.execute(
        f"INSERT INTO {schema}.items VALUES"
        " (1, 'apple', 1.50), (2, 'banana', 0.25), (3, 'cherry', 12.00)"
    )
    try:
        yield schema
    finally:
        await connection.execute(f"DROP SCHEMA {schema} CASCADE")
        await connection.close()


DEEP_LEVELS = (
    60  # /deep: JSON objects nested this deep ({"a": {"a": ... "x"}}), past protobuf's decode limit
)
DEEPER_LEVELS = 5000  # /deeper: arrays nested past what json.loads parses (RecursionError)


def deep_json(levels: int) -> Any:
    """`levels` objects nested in one another around "x" (what /deep serves, with DEEP_LEVELS)."""
    value: Any = "x"
    for _ in range(levels):
        value = {"a": value}
    return value


class _Handler(http.server.BaseHTTPRequestHandler):
    """/json -> {"hello": "world", "authorization": <the header>}; /slow -> waits 5 s;
    /big -> 200 KB of text; /deep -> JSON DEEP_LEVELS objects deep; /deeper -> JSON
    DEEPER_LEVELS arrays deep; /nan -> "JSON" with NaN and 1e400."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path.startswith("/slow"):
            time.sleep(5)
            body, kind = b"late", "text/plain"
        elif self.path.startswith("/big"):
            body, kind = b"x" * 200_000, "text/plain"
        elif self.path.startswith("/deeper"):
            body, kind = b"[" * DEEPER_LEVELS + b"]" * DEEPER_LEVELS, "application/json"
        elif self.path.startswith("/deep"):
            body, kind = json.dumps(deep_json(DEEP_LEVELS)).encode(), "application/json"
        elif self.path.startswith("/nan"):
            body, kind = b'{"ratio": NaN, "big": 1e400, "ok": 1}', "application/json"
        else:
            payload = {
                "hello": "world",
                "authorization": self.headers.get("Authorization"),
                "path": self.path,
            }
            body, kind = json.dumps(payload).encode(), "application/json"
        try:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence request logs
        return


@pytest.fixture
def local_http() -> Iterator[str]:
    """A small HTTP server on 127.0.0.1 (port 0) in a thread; yields its base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
