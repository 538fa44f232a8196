"""The four services with the tools service's settings pinned, for tests that vary them.

`tools_stack(tmp_path, tools={...})` starts billing, tools, orchestrator and gateway on port 0
with fresh SQLite databases and the tools settings in TOOLS_DEFAULTS (loopback allowed) over
any LOOPLINE_* variable; `serve_asgi` and `failure_mcp_app` serve a test MCP server.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from services.billing.config import BillingSettings
from services.billing.server import BillingServer
from services.gateway import identity
from services.gateway.config import GatewaySettings
from services.gateway.server import GatewayServer
from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.server import OrchestratorServer
from services.tools.config import ToolsSettings
from services.tools.server import ToolsServer
from tests.conftest import Stack, stop_stack

# The local server has no TLS: said explicitly (TLS is required otherwise).
PG_DSN = "postgresql://postgres@127.0.0.1:5432/test?sslmode=disable"

# Explicit tools settings, so that LOOPLINE_* variables in the environment cannot change a test.
TOOLS_DEFAULTS: dict[str, Any] = {
    "tools_database_url": "",
    "tools_timeout_s": 30.0,
    "tools_max_output_bytes": 64 * 1024,
    "tools_credential_key": "",
    "tools_allow_private_network": True,
    "tools_search_millicredits": 100,
    "tools_mcp_stdio_servers": "",
    "tools_oauth2_integrations": "",
    "tools_integration_hosts": "",
    "tools_integration_costs": "",
}


async def start_tools_stack(tmp_path, *, tools: dict[str, Any] | None = None) -> Stack:
    """Billing, tools (loopback allowed by default), orchestrator and gateway on port 0, and an
    owner."""
    common = {
        "data_dir": tmp_path,
        "host": "127.0.0.1",
        "redis_url": "",
        "log_level": "WARNING",
        "shutdown_grace_s": 1.0,
    }
    billing = await BillingServer.start(BillingSettings(**common, billing_port=0))
    tools_server = await ToolsServer.start(
        ToolsSettings(**common, tools_port=0, **{**TOOLS_DEFAULTS, **(tools or {})})
    )
    tools_addr = f"127.0.0.1:{tools_server.port}"
    orchestrator = await OrchestratorServer.start(
        OrchestratorSettings(
            **common,
            billing_addr=f"127.0.0.1:{billing.port}",
            tools_addr=tools_addr,
            orchestrator_port=0,
        )
    )
    gateway = await GatewayServer.start(
        GatewaySettings(
            **common,
            orchestrator_addr=f"127.0.0.1:{orchestrator.port}",
            tools_addr=tools_addr,
            billing_addr=f"127.0.0.1:{billing.port}",
            http_port=0,
            gateway_grpc_port=0,
            heartbeat_interval_s=1.0,
        )
    )
    org_id = f"org_{uuid.uuid4().hex[:12]}"
    owner = await identity.create_member(gateway.sessions, org_id, "owner")
    return Stack(
        billing, tools_server, orchestrator, gateway, org_id, owner["api_key"], owner["user_id"]
    )


@asynccontextmanager
async def tools_stack(tmp_path, **kwargs: Any) -> AsyncIterator[Stack]:
    """`start_tools_stack` as a context manager that stops the services afterwards."""
    stack = await start_tools_stack(tmp_path, **kwargs)
    try:
        yield stack
    finally:
        await stop_stack(stack)


@asynccontextmanager
async def serve_asgi(app: Any, tls: tuple[str, str] | None = None) -> AsyncIterator[str]:
    """Serve an ASGI app with uvicorn on 127.0.0.1 (port 0, lifespan on) in this event loop;
    yields its base URL. `tls`: (certificate file, key file) to serve HTTPS."""
    import asyncio
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    sock.setblocking(False)
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=1,
            ssl_certfile=tls[0] if tls else None,
            ssl_keyfile=tls[1] if tls else None,
        )
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            await task
            raise RuntimeError("test ASGI server failed to start")
        await asyncio.sleep(0.01)
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(task, 5)
        except TimeoutError:
            server.force_exit = True
            task.cancel()


def failure_mcp_app(seen_headers: list[dict[str, str]]) -> Any:
    """A Streamable HTTP MCP server (the `mcp` SDK's MCPServer) with tools for every outcome.

    Tools: echo(text) -> text; boom() raises; slow(seconds) sleeps; big(kilobytes) returns that
    much text. Every request's headers are appended to `seen_headers`.
    """
    import asyncio

    from mcp.server.mcpserver import MCPServer

    server = MCPServer("loopline-test")

    @server.tool()
    def echo(text: str) -> str:
        """Return the text unchanged."""
        return text

    @server.tool()
    def boom() -> str:
        """Always fail."""
        raise RuntimeError("the boom tool exploded")

    @server.tool()
    async def slow(seconds: float) -> str:
        """Sleep, then answer."""
        await asyncio.sleep(seconds)
        return "late"

    @server.tool()
    def big(kilobytes: int) -> str:
        """Return `kilobytes` KiB of text."""
        return "x" * (kilobytes * 1024)

    app = server.streamable_http_app()

    async def recording(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            seen_headers.append({k.decode().lower(): v.decode() for k, v in scope["headers"]})
        await app(scope, receive, send)

    return recording
