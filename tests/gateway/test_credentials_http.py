"""Credential routes over HTTP and the SDK, and whole turns using a credential created over HTTP.

Shapes: the SDK's `modulex/types/credentials.py`. Owner/admin only; secrets never returned.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import asyncpg
import httpx
import pytest
from modulex import Modulex
from modulex._exceptions import NotFoundError
from modulex._exceptions import PermissionError as PermissionDeniedError
from sqlalchemy import select

from tests.orchestrator.helpers import run_turn
from tests.tools.tools_stack import PG_DSN

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
            "detail": "auth_type must be one of api_key, bearer, bearer_token, oauth2, custom, "
            "mcp_server"
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


async def test_credential_expiry_in_the_past_or_unreadable_is_400_and_nothing_is_stored(
    services_with_private_network,
):
    """Like an API key's: a credential already expired would only fail the calls that pick it."""
    pg = {"integration_name": "postgresql", "auth_data": {"dsn": SECRET_DSN}}
    async with services_with_private_network.client() as client:
        for expires_at, expected in [
            ("2001-01-01T00:00:00Z", "expires_at must be in the future"),
            ("2001-01-01", "expires_at must be in the future"),
            ("next tuesday", "expires_at must be an ISO 8601 date"),
        ]:
            response = await client.post("/credentials", json={**pg, "expires_at": expires_at})
            assert response.status_code == 400, (expires_at, response.text)
            assert expected in response.json()["detail"]
        assert (await client.get("/credentials")).json()["total"] == 0
        kept = await _create_pg(client, expires_at="2099-01-01T00:00:00+02:00")
        assert kept["expires_at"] == "2099-01-01T00:00:00+02:00"


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
