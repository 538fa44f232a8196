"""MCP servers over HTTP connect to the address the outbound policy checked.

The host of an organization's MCP server is resolved and checked once; if the MCP client
resolved it again when it connects, a second DNS answer of 127.0.0.1 would reach a loopback
server with the organization's `Authorization` header. The resolver here
answers a public address first and loopback afterwards (DNS rebinding).
"""

from __future__ import annotations

import socket
from typing import Any

import pytest

from services.tools.mcp_client import McpConnector
from services.tools.netpolicy import OutboundPolicyError
from tests.tools.tools_stack import serve_asgi

PUBLIC = (
    "93.184.216.34"  # a global address (never connected to: the policy or the test stops first)
)


def named_mcp_app(seen: list[dict[str, str]]) -> Any:
    """A Streamable HTTP MCP server with one tool, echo(text), that records every request's headers
    and takes any Host header (the SDK's own DNS-rebinding check would refuse the test's names)."""
    from mcp.server.mcpserver import MCPServer
    from mcp.server.transport_security import TransportSecuritySettings

    server = MCPServer("rebinding-test")

    @server.tool()
    def echo(text: str) -> str:
        """Return the text unchanged."""
        return text

    app = server.streamable_http_app(
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False)
    )

    async def recording(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            seen.append({k.decode().lower(): v.decode() for k, v in scope["headers"]})
        await app(scope, receive, send)

    return recording


def _answers(monkeypatch: pytest.MonkeyPatch, name: str, answer: Any) -> list[str]:
    """Make `socket.getaddrinfo` answer `answer(n)` (an IPv4 address) for the n-th lookup of `name`
    (n from 0); other names resolve as usual. Returns the addresses answered, in order."""
    real = socket.getaddrinfo
    answered: list[str] = []

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host not in (name, name.encode()):
            return real(host, port, *args, **kwargs)
        address = answer(len(answered))
        answered.append(address)
        return [
            (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (address, int(port or 0)))
        ]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return answered


@pytest.mark.parametrize("operation", ["list_tools", "call_tool"])
async def test_a_second_dns_answer_of_loopback_never_reaches_the_loopback_server(
    monkeypatch, operation
):
    seen: list[dict[str, str]] = []
    async with serve_asgi(named_mcp_app(seen)) as base:
        port = int(base.rsplit(":", 1)[1])
        answered = _answers(
            monkeypatch, "mcp.rebind.test", lambda n: PUBLIC if n == 0 else "127.0.0.1"
        )
        connector = McpConnector(5.0, 65536, allow_private_network=False)
        target = {
            "url": f"http://mcp.rebind.test:{port}/mcp",
            "headers": {"Authorization": "Bearer org-mcp-token"},
        }
        with pytest.raises(OutboundPolicyError) as refused:
            if operation == "list_tools":
                await connector.list_tools(target)
            else:
                await connector.call_tool(target, "echo", {"text": "hi"})
        await connector.aclose()
    assert seen == []  # nothing reached the loopback server, so neither did the header
    assert answered[0] == PUBLIC and "127.0.0.1" in answered[1:]  # the rebinding did happen
    assert "loopback" in str(refused.value) and "org-mcp-token" not in str(refused.value)


async def test_the_connection_goes_to_the_checked_address_with_the_name_in_the_host_header(
    monkeypatch,
):
    """Where loopback is allowed (the operator's LOOPLINE_TOOLS_ALLOW_PRIVATE_NETWORK), a name is
    resolved by the policy's lookup and the request still names the host it was sent to."""
    seen: list[dict[str, str]] = []
    async with serve_asgi(named_mcp_app(seen)) as base:
        port = int(base.rsplit(":", 1)[1])
        answered = _answers(monkeypatch, "mcp.name.test", lambda n: "127.0.0.1")
        connector = McpConnector(5.0, 65536, allow_private_network=True)
        target = {
            "url": f"http://mcp.name.test:{port}/mcp",
            "headers": {"Authorization": "Bearer org-mcp-token"},
        }
        result = await connector.call_tool(target, "echo", {"text": "hi"})
        await connector.aclose()
    assert result["content"][0]["text"] == "hi"
    assert seen and all(h["host"] == f"mcp.name.test:{port}" for h in seen)
    assert all(h.get("authorization") == "Bearer org-mcp-token" for h in seen)
    assert answered  # every connection was resolved by the policy's lookup
