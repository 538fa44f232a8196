"""MCP servers as integrations: stdio servers from settings and HTTP servers registered as
credentials (`POST /credentials/mcp-server`), their discovery, their calls in a turn, and the
error results of servers that crash, hang, refuse connections or were never discovered.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TypedDict

import pytest

from tests.orchestrator.helpers import run_turn
from tests.tools.tools_stack import failure_mcp_app, serve_asgi, tools_stack

TIME_SERVER = json.dumps(
    [
        {
            "name": "time",
            "command": sys.executable,
            "args": ["-m", "mcp_server_time", "--local-timezone", "UTC"],
        }
    ]
)


async def test_turn_calls_mcp_server_time_over_stdio(tmp_path):
    async with (
        tools_stack(tmp_path, tools={"tools_mcp_stdio_servers": TIME_SERVER}) as stack,
        stack.client() as client,
    ):
        call = {
            "integration": "time",
            "action": "get_current_time",
            "parameters": {"timezone": "Europe/Paris"},
        }
        _body, frames = await run_turn(
            client,
            {"tool": "get_integration_details", "input": {"integration": "time"}},
            {"tool": "execute_integration_tool", "input": call},
            {"say": "done"},
        )
    results = [f["data"] for f in frames if f["type"] == "tool_result"]
    details, executed = results[0]["output"], results[1]["output"]
    assert "get_current_time" in [a["name"] for a in details["actions"]]
    assert details["connected"] is True
    assert executed["integration"] == "time"
    assert executed["result"]["structured_content"]["timezone"] == "Europe/Paris"
    assert frames[-1]["type"] == "done"


async def _tool(services, tool: str, tool_input: dict[str, Any]) -> Any:
    return await services.tools.servicer.executor.execute(services.org_id, tool, tool_input)


async def test_mcp_server_registration_discovery_and_calls(services_with_private_network):
    seen: list[dict[str, str]] = []
    async with (
        serve_asgi(failure_mcp_app(seen)) as base,
        services_with_private_network.client() as client,
    ):
        response = await client.post(
            "/credentials/mcp-server",
            json={
                "server_url": f"{base}/mcp",
                "headers": {"Authorization": "Bearer mcp-secret-token"},
                "display_name": "Test Tools",
            },
        )
        assert response.status_code == 201, response.text
        registered = response.json()
        assert (
            registered["integration_name"] == "mcp_test_tools"
            and registered["auth_type"] == "mcp_server"
        )
        assert sorted(t["name"] for t in registered["tools"]) == ["big", "boom", "echo", "slow"]
        assert any(h.get("authorization") == "Bearer mcp-secret-token" for h in seen)
        cid = registered["credential_id"]
        listed = (await client.get(f"/credentials/{cid}/mcp-tools")).json()
        assert listed["total_count"] == 4 and listed["discovered_at"]
        refreshed = (await client.post(f"/credentials/{cid}/refresh-discovery")).json()
        assert (
            refreshed["success"] is True
            and refreshed["total_tools"] == 4
            and refreshed["changes"] == {"added": [], "removed": []}
        )
        detail = (await client.get(f"/credentials/{cid}", params={"include_masked": True})).text
        assert "mcp-secret-token" not in detail and "mcp-secret-token" not in json.dumps(registered)

        call = {"integration": "mcp_test_tools", "action": "echo", "parameters": {"text": "hello"}}
        _body, frames = await run_turn(
            client, {"tool": "execute_integration_tool", "input": call}, {"say": "ok"}
        )
        result = next(f["data"] for f in frames if f["type"] == "tool_result")
        assert result["output"]["result"]["content"][0]["text"] == "hello"

        boom = await _tool(
            services_with_private_network,
            "execute_integration_tool",
            {"integration": "mcp_test_tools", "action": "boom"},
        )
        assert not boom.success and "returned an error" in boom.error and "boom" in boom.error
        big = await _tool(
            services_with_private_network,
            "execute_integration_tool",
            {"integration": "mcp_test_tools", "action": "big", "parameters": {"kilobytes": 200}},
        )
        assert not big.success and "limit" in big.error


class McpRecord(TypedDict):
    """A structured MCP tool result (module level: the SDK reads the tool's annotations)."""

    id: int
    tags: list[str]


def _structured_mcp_app() -> Any:
    """An MCP server whose tools return structured content, as the SDK's MCPServer serves it."""
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("structured")

    @server.tool()
    def text(kilobytes: int) -> str:
        """`kilobytes` KiB of text (structured as {"result": text}, and the text itself)."""
        return "x" * (kilobytes * 1024)

    @server.tool()
    def record() -> McpRecord:
        """An object (structured, and its JSON as text)."""
        return {"id": 7, "tags": ["a", "b"]}

    return server.streamable_http_app()


async def test_an_mcp_result_reaches_the_model_once_and_counts_once_against_the_output_limit(
    services_with_private_network,
):
    """An MCP result reaches the model once: structured_content without the text block the
    MCP specification adds "for backwards compatibility". Counting both would make the model
    read it twice and push a 33,000-character result over the 65,536-byte limit (66,074)."""
    async with (
        serve_asgi(_structured_mcp_app()) as base,
        services_with_private_network.client() as client,
    ):
        registered = await client.post(
            "/credentials/mcp-server", json={"server_url": f"{base}/mcp"}
        )
        assert registered.status_code == 201, registered.text
        name = registered.json()["integration_name"]
        big = await _tool(
            services_with_private_network,
            "execute_integration_tool",
            {"integration": name, "action": "text", "parameters": {"kilobytes": 40}},
        )
        assert big.success, big.error
        assert big.output["result"] == {
            "content": [{"type": "text", "text": "x" * 40 * 1024}]
        }  # the text, not {"result": text} too
        record = await _tool(
            services_with_private_network,
            "execute_integration_tool",
            {"integration": name, "action": "record"},
        )
        assert record.success, record.error
        assert record.output["result"] == {
            "content": [],
            "structured_content": {"id": 7, "tags": ["a", "b"]},
        }  # the object, not its JSON too
        too_big = await _tool(
            services_with_private_network,
            "execute_integration_tool",
            {"integration": name, "action": "text", "parameters": {"kilobytes": 70}},
        )
        assert not too_big.success and "limit" in too_big.error


async def test_hanging_mcp_server_gives_an_error_result_within_the_timeout(tmp_path):
    seen: list[dict[str, str]] = []
    async with (
        tools_stack(tmp_path, tools={"tools_timeout_s": 2.0}) as stack,
        serve_asgi(failure_mcp_app(seen)) as base,
    ):
        async with stack.client() as client:
            registered = (
                await client.post("/credentials/mcp-server", json={"server_url": f"{base}/mcp"})
            ).json()
        started = time.monotonic()
        slow = await _tool(
            stack,
            "execute_integration_tool",
            {
                "integration": registered["integration_name"],
                "action": "slow",
                "parameters": {"seconds": 30},
            },
        )
        assert not slow.success and "timed out" in slow.error
        assert time.monotonic() - started < 6


async def test_crashing_and_hanging_stdio_servers_give_error_results(tmp_path):
    servers = json.dumps(
        [
            {
                "name": "crasher",
                "command": sys.executable,
                "args": ["-c", "import sys; sys.exit(3)"],
            },
            {
                "name": "hanger",
                "command": sys.executable,
                "args": ["-c", "import time; time.sleep(60)"],
            },
        ]
    )
    async with tools_stack(
        tmp_path, tools={"tools_mcp_stdio_servers": servers, "tools_timeout_s": 2.0}
    ) as stack:
        for name in ("crasher", "hanger"):
            started = time.monotonic()
            result = await _tool(
                stack, "execute_integration_tool", {"integration": name, "action": "anything"}
            )
            assert not result.success and name in result.error, result.error
            assert time.monotonic() - started < 6
        listing = await _tool(stack, "get_available_integrations", {"category": "mcp"})
        assert {i["name"] for i in listing.output["integrations"]} >= {"crasher", "hanger"}


async def test_mcp_server_on_loopback_is_refused_unless_the_operator_allows_it(tmp_path):
    async with (
        tools_stack(tmp_path, tools={"tools_allow_private_network": False}) as stack,
        stack.client() as client,
    ):
        refused = await client.post(
            "/credentials/mcp-server", json={"server_url": "http://127.0.0.1:9/mcp"}
        )
        bad = await client.post(
            "/credentials/mcp-server", json={"server_url": "ftp://example.com/mcp"}
        )
        assert refused.status_code == 400 and "loopback" in refused.json()["detail"]
        assert bad.status_code == 400
        assert (await client.get("/credentials")).json()["total"] == 0


@pytest.mark.parametrize(
    "server_url",
    [
        "http://" + "a" * 64 + ".com/mcp",
        "http://a..com/mcp",
        "http://example.com:99999/mcp",
        "http://[::1/mcp",
    ],
)
async def test_a_malformed_mcp_server_url_is_400(services_with_private_network, server_url):
    # the URL check catches UnicodeError / ValueError from parsing: 400, not 500
    async with services_with_private_network.client() as client:
        response = await client.post("/credentials/mcp-server", json={"server_url": server_url})
    assert response.status_code == 400, response.text
    assert "server_url" in response.json()["detail"]


async def test_an_mcp_server_whose_discovery_failed_says_so_when_its_tool_is_called(
    services_with_private_network,
):
    """A server that could not be reached at registration has no tools; a call to one says it has
    none and how to discover them again (not "has no action 'add'. Its actions: .")."""
    async with services_with_private_network.client() as client:
        registered = await client.post(
            "/credentials/mcp-server",
            json={"server_url": "http://127.0.0.1:1/mcp", "display_name": "Down"},
        )
    assert registered.status_code == 201, registered.text
    assert registered.json()["total_tools"] == 0 and registered.json()["discovery_error"]
    result = await _tool(
        services_with_private_network,
        "execute_integration_tool",
        {"integration": registered.json()["integration_name"], "action": "add"},
    )
    assert not result.success
    assert result.error == (
        "Integration 'mcp_down' has no actions (an MCP server's are those its discovery found; "
        "refresh it with POST /credentials/{id}/refresh-discovery)."
    )


@pytest.mark.parametrize(
    "headers, detail",
    [
        ({"Bad Header": "v"}, "headers: 'Bad Header' is not a header name"),
        (
            {"X-A": "line\r\nInjected: 1"},
            "headers: the value of 'X-A' holds a character a header cannot carry",
        ),
        ({"X-A": "café"}, "headers: the value of 'X-A' holds a character a header cannot carry"),
        ({"X-A": 1}, "headers must map header names to strings"),
    ],
)
async def test_mcp_server_headers_that_http_cannot_carry_are_400_and_nothing_is_stored(
    services_with_private_network, headers, detail
):
    """Headers HTTP cannot carry are 400 and nothing is stored, since every call to the server
    with them would fail (LocalProtocolError / UnicodeEncodeError). RFC 9110: names are tokens,
    values visible ASCII, spaces and tabs; a value is never echoed."""
    async with services_with_private_network.client() as client:
        response = await client.post(
            "/credentials/mcp-server",
            json={"server_url": "https://mcp.example.com/mcp", "headers": headers},
        )
        assert response.status_code == 400, response.text
        assert detail in response.json()["detail"] and "Injected" not in response.json()["detail"]
        assert (await client.get("/credentials")).json()["total"] == 0


async def test_a_call_to_an_mcp_server_that_refuses_connections_says_it_was_not_sent(tmp_path):
    # a refused connection says the call was not sent, so the caller knows it did not run
    from services.tools.catalogue import ActionError
    from services.tools.mcp_client import McpConnector

    connector = McpConnector(5, 65536, allow_private_network=True)
    with pytest.raises(ActionError) as failure:
        await connector.call_tool({"url": "http://127.0.0.1:1/mcp", "headers": {}}, "add", {})
    assert (
        str(failure.value)
        == "the MCP server could not be reached; the call was not sent (ConnectError)"
    )
