"""MCP servers as integrations: an organization's registered servers and the operator's.

- Organization servers: registered by URL (Streamable HTTP) with optional headers, as a
  credential of auth type `mcp_server` whose secret is `{"url", "headers"}` (headers often
  carry a token, so both are encrypted like any secret). Each such credential is its own
  integration, named `mcp_<slug>`; its discovered tools are stored on the credential row
  (`discovery`) and become the integration's actions.
- Operator stdio servers (`mcp_stdio`): each is an integration called `name` that needs no
  credential; its tools are discovered on first use (and in the background at start) and
  kept in memory (`StdioRegistry`).

Sessions are opened by `mcp_client.McpConnector`.
"""

from __future__ import annotations

import asyncio
import functools
import re
from typing import Any

from services.tools.catalogue import Action, ActionContext, ActionError, AuthOption, Integration
from services.tools.mcp_client import McpConnector
from services.tools.mcp_stdio import StdioServer
from services.tools.netpolicy import OutboundPolicyError

MCP_AUTH_TYPE = "mcp_server"
# What one MCP tool call costs, in millicredits.
MCP_ACTION_MILLICREDITS = 100


def slug(text: str) -> str:
    """A lower-case identifier made of `text`'s letters and digits ("My Server!" -> "my_server")."""
    value = re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")
    return (value or "server")[:40]


def integration_of_tools(
    name: str,
    display_name: str,
    description: str,
    tools: list[dict[str, Any]],
    auth_options: tuple[AuthOption, ...],
    call: Any,
) -> Integration:
    """An Integration whose actions are MCP `tools`; each action's handler is
    `call(ctx, tool_name, params)`."""

    def handler_for(tool_name: str) -> Any:
        async def handler(ctx: ActionContext, params: dict[str, Any]) -> Any:
            return await call(ctx, tool_name, params)

        return handler

    actions = {
        t["name"]: Action(
            name=t["name"],
            description=t["description"],
            parameters=t["input_schema"],
            credit_cost_millicredits=MCP_ACTION_MILLICREDITS,
            handler=handler_for(t["name"]),
            effects=("update",),  # a server's tool may change anything: never shown as a read
        )
        for t in tools
    }
    return Integration(
        name=name,
        display_name=display_name,
        description=description,
        categories=("mcp",),
        auth_options=auth_options,
        actions=actions,
        source="mcp",
    )


ORG_SERVER_AUTH = (
    AuthOption(
        MCP_AUTH_TYPE, "MCP server", "A Streamable HTTP MCP server URL and its headers", None
    ),
)
NO_AUTH = (AuthOption("none", "No credential", "Configured by the operator", None),)


class StdioRegistry:
    """The operator's stdio servers and their tools, discovered once per process.

    Args:
        servers: from `parse_stdio_servers`.
        connector: the McpConnector to discover and call with.
    """

    def __init__(self, servers: list[StdioServer], connector: McpConnector) -> None:
        self.servers = {s.name: s for s in servers}
        self._connector = connector
        self._tools: dict[str, list[dict[str, Any]]] = {}
        self._inflight: dict[str, asyncio.Task[list[dict[str, Any]]]] = {}

    def describe(self, server: StdioServer) -> str:
        """The integration description of a stdio server."""
        return server.description or f"Tools of the operator-configured MCP server {server.name!r}"

    async def discover_all(self) -> None:
        """Discover every server's tools (failures are logged by the connector, with the server's
        stderr, and retried on next use)."""
        for name in self.servers:
            try:
                await self.tools(name)
            except (ActionError, OutboundPolicyError, TimeoutError):
                pass  # McpConnector logged it ("stdio MCP server failed"); one record per failure

    async def tools(self, name: str) -> list[dict[str, Any]]:
        """The tools of server `name`, discovering them if not yet known. Raises as
        McpConnector.list_tools.

        Concurrent callers share one discovery (and its failure); a failed discovery is
        tried again by the next call after it ended.
        """
        if name in self._tools:
            return self._tools[name]
        task = self._inflight.get(name)
        if task is None:
            task = asyncio.create_task(self._connector.list_tools(self.servers[name]))
            self._inflight[name] = task
            task.add_done_callback(functools.partial(self._settle, name))
        return await asyncio.shield(task)

    def _settle(self, name: str, task: asyncio.Task[list[dict[str, Any]]]) -> None:
        self._inflight.pop(name, None)
        if not task.cancelled() and task.exception() is None:
            self._tools[name] = task.result()

    def discovered(self, name: str) -> list[dict[str, Any]] | None:
        """The tools of server `name` if already discovered, else None (never starts a discovery:
        a listing must not wait for a server)."""
        return self._tools.get(name)

    async def integration(self, name: str) -> Integration:
        """The integration of server `name`; raises as `tools` when it cannot be discovered."""
        server = self.servers[name]
        tools = await self.tools(name)

        async def call(_ctx: ActionContext, tool_name: str, params: dict[str, Any]) -> Any:
            return await self._connector.call_tool(server, tool_name, params)

        return integration_of_tools(name, name, self.describe(server), tools, NO_AUTH, call)
