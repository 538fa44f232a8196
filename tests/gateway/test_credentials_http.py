"""Credential routes over HTTP and the SDK, whole turns on PostgreSQL and MCP, MCP servers,
OAuth2.

Shapes: the SDK's `modulex/types/credentials.py`. Owner/admin only; secrets never returned.
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
import time
import urllib.parse
import uuid
from typing import Any, TypedDict

import asyncpg
import httpx
import pytest
from modulex import Modulex
from modulex._exceptions import NotFoundError
from modulex._exceptions import PermissionError as PermissionDeniedError
from sqlalchemy import select

from tests.orchestrator.helpers import run_turn
from tests.sse_client import read_frames
from tests.tools.tools_stack import PG_DSN, failure_mcp_app, serve_asgi, tools_stack

SECRET_DSN = PG_DSN  # no password on the local server: the DSN itself is the secret under test


async def _create_pg(client: httpx.AsyncClient, **extra: Any) -> dict[str, Any]:
    response = await client.post(
        "/credentials",
        json={"integration_name": "postgresql", "auth_data": {"dsn": SECRET_DSN}, **extra},
    )
    assert response.status_code == 201, response.text
    return response.json()


async def test_credential_lifecycle_over_http_matches_the_sdk_shapes(services_with_private_network):
    async with services_with_private_network.client() as client:
        first = await _create_pg(client, display_name="Main DB", metadata={"team": "data"})
        second = await _create_pg(client, make_default=True)
        assert first["integration_name"] == "postgresql" and first["auth_type"] == "api_key"
        assert first["display_name"] == "Main DB" and first["credentials_metadata"] == {
            "team": "data"
        }
        assert first["is_default"] is True and second["is_default"] is True
        listing = (
            await client.get("/credentials", params={"integration_name": "postgresql"})
        ).json()
        assert listing["total"] == 2 and listing["has_next"] is False
        assert [c["credential_id"] for c in listing["credentials"]] == [
            second["credential_id"],
            first["credential_id"],
        ]
        assert [c["is_default"] for c in listing["credentials"]] == [True, False]
        detail = (
            await client.get(
                f"/credentials/{first['credential_id']}", params={"include_masked": "true"}
            )
        ).json()
        assert detail["organization_id"] == services_with_private_network.org_id
        assert detail["auth_data_masked"] and SECRET_DSN not in detail["auth_data_masked"]
        plain = (await client.get(f"/credentials/{first['credential_id']}")).json()
        assert plain["auth_data_masked"] is None
        promoted = await client.post(f"/credentials/{first['credential_id']}/set-default")
        assert promoted.status_code == 200 and promoted.json()["is_default"] is True
        deleted = await client.delete(f"/credentials/{first['credential_id']}")
        assert deleted.status_code == 204
        assert (await client.get(f"/credentials/{first['credential_id']}")).status_code == 404
        remaining = (await client.get("/credentials")).json()
        assert [c["credential_id"] for c in remaining["credentials"]] == [second["credential_id"]]
        assert remaining["credentials"][0]["is_default"] is True
        for response in (listing, detail, plain, remaining):
            assert SECRET_DSN not in json.dumps(response)


async def test_credential_list_filters_by_the_sdk_auth_type_names_and_refuses_unknown_ones(
    services_with_private_network,
):
    """`?auth_type=` takes the names a credential is created with (the SDK's `bearer_token` is
    stored as `bearer`); a value no credential can have is 400, not an empty list."""
    async with services_with_private_network.client() as client:
        created = await client.post(
            "/credentials",
            json={
                "integration_name": "http",
                "auth_type": "bearer_token",
                "auth_data": {"token": "tok-1234567890"},
            },
        )
        assert created.status_code == 201, created.text
        await _create_pg(client)
        for name in ("bearer_token", "bearer"):
            listing = await client.get("/credentials", params={"auth_type": name})
            assert listing.status_code == 200, listing.text
            assert [c["credential_id"] for c in listing.json()["credentials"]] == [
                created.json()["credential_id"]
            ]
        assert (await client.get("/credentials", params={"auth_type": "oauth2"})).json()[
            "total"
        ] == 0
        refused = await client.get("/credentials", params={"auth_type": "bearer-token"})
        assert refused.status_code == 400
        # the accepted names include the SDK's alias, not only the stored ones
        assert refused.json() == {
            "detail": "auth_type must be one of api_key, bearer, bearer_token, oauth2, mcp_server"
        }


def test_the_credential_auth_types_the_gateway_accepts_are_the_tools_services_and_the_sdk_aliases():
    from services.gateway.routes.credentials import CREDENTIAL_AUTH_TYPES, SDK_AUTH_TYPES
    from services.tools.credentials import STORED_AUTH_TYPES

    assert set(CREDENTIAL_AUTH_TYPES) == set(STORED_AUTH_TYPES) | set(SDK_AUTH_TYPES)
    assert set(SDK_AUTH_TYPES.values()) <= set(STORED_AUTH_TYPES)


async def test_mcp_routes_on_a_credential_of_another_kind_say_so_instead_of_not_found(
    services_with_private_network,
):
    # refresh-discovery and mcp-tools on a credential that exists must not be 404 "Credential not
    # found"
    async with services_with_private_network.client() as client:
        created = await client.post(
            "/credentials",
            json={
                "integration_name": "http",
                "auth_type": "bearer_token",
                "auth_data": {"token": "tok-1234567890"},
            },
        )
        cid = created.json()["credential_id"]
        for response in (
            await client.post(f"/credentials/{cid}/refresh-discovery"),
            await client.get(f"/credentials/{cid}/mcp-tools"),
        ):
            assert response.status_code == 400, response.text
            assert response.json() == {
                "detail": f"Credential {cid} has auth type bearer, not mcp_server:"
                " it is not an MCP server's"
            }
        assert (await client.get(f"/credentials/{uuid.uuid4()}/mcp-tools")).status_code == 404


async def test_a_credential_names_its_creator_and_their_email(services_with_private_network):
    """A credential names its creator (`created_by`) and their email (`created_by_email`)."""
    from services.gateway import identity

    async with services_with_private_network.client() as client:
        created = await _create_pg(client)
        detail = (await client.get(f"/credentials/{created['credential_id']}")).json()
        async with services_with_private_network.gateway.sessions() as session:
            email = (
                await session.execute(
                    select(identity.User.email).where(
                        identity.User.id == services_with_private_network.user_id
                    )
                )
            ).scalar_one()
        assert (detail["created_by"], detail["created_by_email"]) == (
            services_with_private_network.user_id,
            email,
        )
        response = await services_with_private_network.tools.servicer.credentials.list(
            services_with_private_network.org_id
        )
        assert [info.created_by for info in response[0]] == [services_with_private_network.user_id]


async def test_credentials_through_the_sdk(services_with_private_network):
    client = Modulex(
        api_key=services_with_private_network.api_key,
        organization_id=services_with_private_network.org_id,
        base_url=services_with_private_network.base_url,
    )
    try:
        created = await client.credentials.create(
            "postgresql", auth_data={"dsn": SECRET_DSN}, display_name="SDK DB"
        )
        assert created.credential_id and created.is_default and created.auth_type == "api_key"
        fetched = await client.credentials.get(created.credential_id, include_masked=True)
        assert (
            fetched.display_name == "SDK DB"
            and fetched.auth_data_masked
            and fetched.organization_id == services_with_private_network.org_id
        )
        listing = await client.credentials.list(integration_name="postgresql")
        assert [c["credential_id"] for c in listing["credentials"]] == [created.credential_id]
        assert (await client.credentials.set_default(created.credential_id)).is_default is True
        await client.credentials.delete(created.credential_id)
        with pytest.raises(NotFoundError):
            await client.credentials.get(created.credential_id)
    finally:
        await client.close()


async def test_credentials_need_owner_or_admin_and_stay_in_their_organization(
    services_with_private_network,
):
    async with services_with_private_network.client() as client:
        created = await _create_pg(client)
    member = await services_with_private_network.member("member")
    outsider = await services_with_private_network.member("owner", org_id="org_elsewhere")
    async with httpx.AsyncClient(base_url=services_with_private_network.base_url) as raw:
        assert (
            await raw.get(
                "/credentials", headers={"X-Organization-ID": services_with_private_network.org_id}
            )
        ).status_code == 401
        denied = await raw.get(
            "/credentials", headers=services_with_private_network.headers(api_key=member["api_key"])
        )
        # worded for every route that checks the role (not "The assistant requires ...")
        assert denied.status_code == 403 and denied.json() == {
            "detail": "This requires the owner or admin role in this organization"
        }
        # A 403 comes before any lookup: the member cannot learn whether the id exists.
        assert (
            await raw.delete(
                f"/credentials/{created['credential_id']}",
                headers=services_with_private_network.headers(api_key=member["api_key"]),
            )
        ).status_code == 403
        other = services_with_private_network.headers(outsider["api_key"], "org_elsewhere")
        for response in (
            await raw.get(f"/credentials/{created['credential_id']}", headers=other),
            await raw.delete(f"/credentials/{created['credential_id']}", headers=other),
            await raw.post(f"/credentials/{created['credential_id']}/set-default", headers=other),
        ):
            assert response.status_code == 404 and response.json() == {
                "detail": "Credential not found"
            }
        assert (await raw.get("/credentials", headers=other)).json()["total"] == 0
    client = Modulex(
        api_key=member["api_key"],
        organization_id=services_with_private_network.org_id,
        base_url=services_with_private_network.base_url,
    )
    try:
        with pytest.raises(PermissionDeniedError):
            await client.credentials.get(created["credential_id"])
    finally:
        await client.close()


async def test_bad_credential_input_is_400_with_detail_and_never_echoes_the_secret(
    services_with_private_network,
):
    async with services_with_private_network.client() as client:
        cases = [
            (
                {
                    "integration_name": "postgresql",
                    "auth_data": {"dsn": "mysql://secret-value@x/db"},
                },
                "auth_data",
            ),
            ({"integration_name": "nope", "auth_data": {"api_key": "k"}}, "Unknown integration"),
            (
                {"integration_name": "postgresql", "auth_data": {"dsn": SECRET_DSN}, "extra": 1},
                "Unknown field",
            ),
            ({"auth_data": {"dsn": SECRET_DSN}}, "integration_name"),
            (
                {"integration_name": "postgresql", "auth_data": "flat"},
                "auth_data must be an object",
            ),
            (
                {"integration_name": "postgresql", "oauth_config": {"client_secret": "s"}},
                "oauth2/initiate",
            ),
        ]
        for body, expected in cases:
            response = await client.post("/credentials", json=body)
            assert response.status_code == 400, (body, response.text)
            assert expected in response.json()["detail"]
            assert "secret-value" not in response.text
        not_json = await client.post(
            "/credentials", content=b"{", headers={"Content-Type": "application/json"}
        )
        assert not_json.status_code == 400
        assert (await client.get("/credentials", params={"limit": 0})).status_code == 400


async def test_oversized_credential_fields_are_400_naming_the_limit_and_nothing_is_stored(
    services_with_private_network,
):
    """Every string field has a limit in characters, metadata 16 KiB as JSON (with expires_at
    merged in), the secret objects their own; errors name the field, never a value. Without them
    only the 1 MiB body cap applies, and a tool result listing credentials grows without bound."""
    secret = "secret-value"
    most = 16 * 1024 - len('{"note":""}')  # metadata {"note": "m" * most} is exactly 16 KiB of JSON
    async with services_with_private_network.client() as client:
        kept = await _create_pg(client, display_name="d" * 200, metadata={"note": "m" * most})
        assert len(kept["display_name"]) == 200
        pg = {"integration_name": "postgresql", "auth_data": {"dsn": SECRET_DSN}}
        cases = [
            (
                "/credentials",
                {**pg, "display_name": "d" * 201},
                "display_name must be at most 200 characters",
            ),
            (
                "/credentials",
                {**pg, "display_name": "d" * 100_000},
                "display_name must be at most 200 characters",
            ),
            (
                "/credentials",
                {**pg, "metadata": {"note": "m" * (most + 1)}},
                "metadata must be at most 16384 bytes when JSON-encoded",
            ),
            (
                "/credentials",
                {**pg, "metadata": {"note": "m" * 900_000}},
                "metadata must be at most 16384 bytes",
            ),
            (
                "/credentials",
                {**pg, "metadata": {"note": "m" * most}, "expires_at": "2030-01-01T00:00:00Z"},
                "metadata must be at most 16384 bytes",
            ),
            (
                "/credentials",
                {**pg, "expires_at": "2" * 65},
                "expires_at must be at most 64 characters",
            ),
            (
                "/credentials",
                {**pg, "integration_name": "p" * 101},
                "integration_name must be at most 100 characters",
            ),
            (
                "/credentials",
                {**pg, "auth_type": "a" * 33},
                "auth_type must be at most 32 characters",
            ),
            (
                "/credentials",
                {**pg, "auth_data": {"dsn": secret * 6000}},
                "auth_data must be at most 65536 bytes",
            ),
            (
                "/credentials/mcp-server",
                {"server_url": "https://mcp.example.com/", "display_name": "d" * 201},
                "display_name must be at most 200",
            ),
            (
                "/credentials/mcp-server",
                {"server_url": "https://mcp.example.com/" + "a" * 2100},
                "server_url must be at most 2048 characters",
            ),
            (
                "/credentials/mcp-server",
                {
                    "server_url": "https://mcp.example.com/",
                    "headers": {"Authorization": secret * 2000},
                },
                "headers must be at most 16384 bytes",
            ),
            (
                "/credentials/oauth2/initiate",
                {
                    "integration_name": "github",
                    "redirect_uri": "https://app.example.com/cb",
                    "display_name": "d" * 201,
                },
                "display_name must be at most 200",
            ),
            (
                "/credentials/oauth2/initiate",
                {
                    "integration_name": "github",
                    "redirect_uri": "https://app.example.com/" + "c" * 2100,
                },
                "redirect_uri must be at most 2048 characters",
            ),
            (
                "/credentials/oauth2/initiate",
                {
                    "integration_name": "github",
                    "redirect_uri": "https://app.example.com/cb",
                    "scope": "repo " * 500,
                },
                "scope must be at most 2048 characters",
            ),
        ]
        for path, body, expected in cases:
            response = await client.post(path, json=body)
            assert response.status_code == 400, (path, response.text[:300])
            assert expected in response.json()["detail"], response.text[:300]
            assert secret not in response.text and len(response.text) < 300
        listing = (await client.get("/credentials")).json()
        assert [c["credential_id"] for c in listing["credentials"]] == [
            kept["credential_id"]
        ]  # nothing else stored
        # the OAuth2 callback's `error` is echoed: a bounded detail however long it is
        echoed = await client.get("/credentials/oauth2/callback", params={"error": "e" * 5000})
        assert echoed.status_code == 400 and len(echoed.json()["detail"]) <= 1000


async def test_turn_runs_a_postgresql_query_with_a_credential_created_over_http(
    services_with_private_network,
):
    try:
        connection = await asyncpg.connect(PG_DSN, timeout=3)
    except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
        pytest.skip(f"local PostgreSQL at {PG_DSN} is unreachable ({type(exc).__name__})")
    schema = f"turn_{uuid.uuid4().hex[:10]}"
    await connection.execute(f"CREATE SCHEMA {schema}")
    await connection.execute(f"CREATE TABLE {schema}.fruit (id int PRIMARY KEY, name text)")
    await connection.execute(f"INSERT INTO {schema}.fruit VALUES (1, 'apple'), (2, 'banana')")
    try:
        async with services_with_private_network.client() as client:
            credential = await _create_pg(client)
            call = {
                "integration": "postgresql",
                "action": "run_query",
                "parameters": {"sql": f"SELECT name FROM {schema}.fruit ORDER BY id"},
            }
            _body, frames = await run_turn(
                client, {"tool": "execute_integration_tool", "input": call}, {"say": "done"}
            )
    finally:
        await connection.execute(f"DROP SCHEMA {schema} CASCADE")
        await connection.close()
    results = [f["data"] for f in frames if f["type"] == "tool_result"]
    assert len(results) == 1 and results[0]["tool"] == "execute_integration_tool"
    output = results[0]["output"]
    assert output["credential_id"] == credential["credential_id"]
    assert output["result"]["rows"] == [["apple"], ["banana"]]
    assert frames[-1]["type"] == "done"
    assert SECRET_DSN not in json.dumps(frames)


async def test_turn_without_a_credential_gets_an_error_result_naming_request_credential(
    services_with_private_network,
):
    async with services_with_private_network.client() as client:
        call = {"integration": "postgresql", "action": "list_schemas", "parameters": {}}
        _body, frames = await run_turn(
            client, {"tool": "execute_integration_tool", "input": call}, {"say": "done"}
        )
    result = next(f["data"] for f in frames if f["type"] == "tool_result")
    assert "request_credential" in json.dumps(result)
    assert frames[-1]["type"] == "done" and not frames[-1]["data"].get("error")


# ---- MCP ---------------------------------------------------------------------------------------

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
    """Bug: a structured result came back twice (the text block the MCP
    specification asks for "for backwards compatibility", and structured_content), so the
    model read it twice and a 33,000-character result passed the 65,536-byte limit as 66,074."""
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


# ---- OAuth2 ------------------------------------------------------------------------------------


def oauth_server_app(issued: dict[str, Any]) -> Any:
    """A minimal OAuth2 authorization server (authorization code + PKCE S256) and an API at
    /api/me."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, RedirectResponse
    from starlette.routing import Route

    async def authorize(request: Request) -> Any:
        q = request.query_params
        code = uuid.uuid4().hex
        issued[code] = {
            "challenge": q["code_challenge"],
            "method": q["code_challenge_method"],
            "redirect_uri": q["redirect_uri"],
            "client_id": q["client_id"],
        }
        return RedirectResponse(
            f"{q['redirect_uri']}?{urllib.parse.urlencode({'code': code, 'state': q['state']})}",
            status_code=302,
        )

    async def token(request: Request) -> Any:
        form = await request.form()
        grant = issued.pop(str(form.get("code")), None)
        verifier = str(form.get("code_verifier", ""))
        challenge = (
            base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest())
            .rstrip(b"=")
            .decode()
        )
        if (
            grant is None
            or grant["method"] != "S256"
            or grant["challenge"] != challenge
            or form.get("redirect_uri") != grant["redirect_uri"]
            or form.get("client_id") != "loopline-client"
            or form.get("client_secret") != "client-secret"
            or form.get("grant_type") != "authorization_code"
        ):
            return JSONResponse({"error": "invalid_grant"}, status_code=400)
        return JSONResponse(
            {
                "access_token": "at-secret-123",
                "refresh_token": "rt-secret-456",
                "token_type": "Bearer",
                "expires_in": 3600,
                "scope": "read",
            }
        )

    async def me(request: Request) -> Any:
        if request.headers.get("authorization") != "Bearer at-secret-123":
            return JSONResponse({"error": "unauthorized"}, status_code=401)
        return JSONResponse({"login": "octo"})

    return Starlette(
        routes=[
            Route("/authorize", authorize),
            Route("/token", token, methods=["POST"]),
            Route("/api/me", me),
        ]
    )


async def test_oauth2_authorization_code_flow_with_pkce_end_to_end(tmp_path):
    issued: dict[str, Any] = {}
    async with serve_asgi(oauth_server_app(issued)) as auth_base:
        provider = json.dumps(
            [
                {
                    "name": "acme",
                    "display_name": "Acme",
                    "authorize_url": f"{auth_base}/authorize",
                    "token_url": f"{auth_base}/token",
                    "client_id": "loopline-client",
                    "client_secret": "client-secret",
                    "scope": "read",
                    "api_base_url": f"{auth_base}/api",
                },
                {
                    "name": "gone",
                    "display_name": "Gone",
                    "authorize_url": f"{auth_base}/authorize",
                    "token_url": "http://127.0.0.1:1/token",
                    "client_id": "loopline-client",
                    "scope": "read",
                    "api_base_url": f"{auth_base}/api",
                },
            ]
        )
        async with (
            tools_stack(tmp_path, tools={"tools_oauth2_integrations": provider}) as stack,
            stack.client() as client,
        ):
            callback = f"{stack.base_url}/credentials/oauth2/callback"
            # a turn waits for this integration's credential (OAuth auto-resume)
            paused, paused_frames = await run_turn(
                client,
                {
                    "tool": "request_credential",
                    "input": {"integration": "acme", "message": "connect Acme"},
                },
                {"say": "resumed by itself"},
            )
            assert paused_frames[-2]["data"]["auth_options"][0]["auth_type"] == "oauth2"
            sdk = Modulex(
                api_key=stack.api_key, organization_id=stack.org_id, base_url=stack.base_url
            )
            try:
                started = await sdk.credentials.initiate_oauth2(
                    "acme", redirect_uri=callback, display_name="Acme account"
                )
            finally:
                await sdk.close()
            query = urllib.parse.parse_qs(urllib.parse.urlsplit(started.authorization_url).query)
            assert query["code_challenge_method"] == ["S256"] and query["state"] == [started.state]
            assert query["client_id"] == ["loopline-client"] and query["redirect_uri"] == [callback]
            async with httpx.AsyncClient() as browser:
                redirect = await browser.get(started.authorization_url)
                assert redirect.status_code == 302
                done = await browser.get(
                    redirect.headers["location"]
                )  # the browser follows to the gateway
            assert done.status_code == 200, done.text
            connected = done.json()
            assert connected["status"] == "connected" and connected["integration_name"] == "acme"
            assert (
                connected["auth_type"] == "oauth2" and connected["display_name"] == "Acme account"
            )
            assert "at-secret" not in done.text and "rt-secret" not in done.text
            # The orchestrator is told, and the paused run resumes by itself: run_resumed on the
            # old stream.
            assert connected["orchestrator_notified"] is True
            old_stream = await read_frames(client, paused["stream_url"])
            assert old_stream[-1]["type"] == "run_resumed"
            new_run = old_stream[-1]["data"]["new_run_id"]
            rest = await read_frames(
                client, f"/assistant/chat/{paused['chat_id']}/listen/{new_run}"
            )
            assert (
                rest[-1]["type"] == "done" and rest[-1]["data"]["response"] == "resumed by itself"
            )
            again = await httpx.AsyncClient().get(redirect.headers["location"])
            assert again.status_code == 400  # the state is single-use
            listing = (await client.get("/credentials", params={"integration_name": "acme"})).json()
            assert [c["credential_id"] for c in listing["credentials"]] == [
                connected["credential_id"]
            ]
            call = {"integration": "acme", "action": "api_request", "parameters": {"path": "/me"}}
            _body, frames = await run_turn(
                client, {"tool": "execute_integration_tool", "input": call}, {"say": "ok"}
            )
            result = next(f["data"] for f in frames if f["type"] == "tool_result")
            assert result["output"]["result"] == {"status": 200, "body": {"login": "octo"}}
            assert "at-secret" not in json.dumps(frames)
            unknown = await client.post(
                "/credentials/oauth2/initiate",
                json={"integration_name": "postgresql", "redirect_uri": callback},
            )
            assert unknown.status_code == 400
            tampered = await client.get(
                "/credentials/oauth2/callback", params={"state": "forged", "code": "x"}
            )
            assert tampered.status_code == 400
            # a denial uses the state up; a forged state with `error` is unknown, not "not granted";
            # an unreachable token endpoint is named as such
            denied = (
                await client.post(
                    "/credentials/oauth2/initiate",
                    json={"integration_name": "acme", "redirect_uri": callback},
                )
            ).json()
            refused = await client.get(
                "/credentials/oauth2/callback",
                params={"state": denied["state"], "error": "access_denied"},
            )
            assert refused.status_code == 400 and refused.json() == {
                "detail": "Authorization was not granted: access_denied"
            }
            spent = await client.get(
                "/credentials/oauth2/callback", params={"state": denied["state"], "code": "abc"}
            )
            assert (
                spent.status_code == 400
                and "Unknown or expired OAuth2 state" in spent.json()["detail"]
            )
            forged = await client.get(
                "/credentials/oauth2/callback", params={"state": "forged", "error": "access_denied"}
            )
            assert (
                forged.status_code == 400
                and "Unknown or expired OAuth2 state" in forged.json()["detail"]
            )
            down = (
                await client.post(
                    "/credentials/oauth2/initiate",
                    json={"integration_name": "gone", "redirect_uri": callback},
                )
            ).json()
            unreachable = await client.get(
                "/credentials/oauth2/callback", params={"state": down["state"], "code": "abc"}
            )
            assert unreachable.status_code == 409 and unreachable.json() == {
                "detail": "The authorization server did not issue a token (its token endpoint"
                " could not be reached); start the connection again"
            }


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
    """Bug: such headers were stored (201) and every call to the server failed
    ("could not be reached or did not answer (LocalProtocolError)" / UnicodeEncodeError).
    RFC 9110: names are tokens, values visible ASCII, spaces and tabs; a value is never echoed."""
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
