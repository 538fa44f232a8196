"""Community integrations run for real, in integration workers, through whole turns with the
scripted model: GitHub (bearer token), Airtable (API key) and Qdrant (custom: its host comes
from the credential), each against a local fake of its API (tests/tools/fake_apis.py).
"""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from sqlalchemy import select

from services.billing.models import LedgerEntry
from services.tools.config import ToolsSettings
from tests.gateway.test_oauth2_connect import oauth_server_app
from tests.orchestrator.helpers import billing_delivered, run_turn
from tests.tools.fake_apis import (
    airtable_app,
    github_app,
    make_test_ca,
    qdrant_app,
    recorder_app,
)
from tests.tools.test_oauth_refresh import CLIENT_ID, CLIENT_SECRET, AuthServer
from tests.tools.tools_stack import serve_asgi, tools_stack

PYTHON = ToolsSettings().integrations_python()
pytestmark = pytest.mark.skipif(
    not Path(PYTHON).exists(),
    reason="no .venv-integrations: `make venv` creates it (Python >= 3.12)",
)

GITHUB_TOKEN = "ghp-test-token-5d1e"
AIRTABLE_KEY = "pat-test-key-77a0"
QDRANT_KEY = "qdrant-test-key-31c9"
OAUTH_TOKEN = "at-secret-123"  # what oauth_server_app issues


def call(integration: str, action: str, **parameters: Any) -> dict[str, Any]:
    """A scripted model step that calls `integration.action`."""
    return {
        "tool": "execute_integration_tool",
        "input": {"integration": integration, "action": action, "parameters": parameters},
    }


def results(frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [f["data"] for f in frames if f["type"] == "tool_result"]


async def fakes(exit_stack: AsyncExitStack, tmp_path: Path, seen: dict[str, list]) -> dict:
    """Start the fakes; returns the tools settings that send the integrations' hosts to them."""
    ca, cert, key = make_test_ca(tmp_path, ["api.github.com", "api.airtable.com"])
    github = await exit_stack.enter_async_context(
        serve_asgi(github_app(seen["github"], GITHUB_TOKEN, OAUTH_TOKEN), tls=(cert, key))
    )
    airtable = await exit_stack.enter_async_context(
        serve_asgi(airtable_app(seen["airtable"], AIRTABLE_KEY), tls=(cert, key))
    )
    qdrant = await exit_stack.enter_async_context(
        serve_asgi(qdrant_app(seen["qdrant"], QDRANT_KEY))
    )
    hosts = {
        "api.github.com": urlsplit(github).netloc,
        "api.airtable.com": urlsplit(airtable).netloc,
    }
    return {"ca": ca, "tls": (cert, key), "qdrant": qdrant, "hosts": json.dumps(hosts)}


@pytest.fixture
def seen() -> dict[str, list]:
    return {"github": [], "airtable": [], "qdrant": []}


async def connect(client, integration: str, auth_type: str, auth_data: dict) -> None:
    response = await client.post(
        "/credentials",
        json={"integration_name": integration, "auth_type": auth_type, "auth_data": auth_data},
    )
    assert response.status_code == 201, response.text


async def test_github_actions_run_in_a_worker_against_a_local_fake(tmp_path, seen, monkeypatch):
    async with AsyncExitStack() as stack_of:
        fake = await fakes(stack_of, tmp_path, seen)
        monkeypatch.setenv("SSL_CERT_FILE", fake["ca"])
        stack = await stack_of.enter_async_context(
            tools_stack(tmp_path, tools={"tools_integration_hosts": fake["hosts"]})
        )
        client = await stack_of.enter_async_context(stack.client())
        await connect(client, "github", "bearer_token", {"token": GITHUB_TOKEN})
        _body, frames = await run_turn(
            client,
            call("github", "get_repository", owner="octo", repo="hello"),
            call(
                "github", "create_issue", owner="octo", repo="hello", title="Bug", body="It broke"
            ),
            call("github", "get_repository", owner="octo", repo="missing"),
            {"say": "done"},
        )
        found, created, missing = results(frames)
        assert found["output"]["result"]["success"] is True, found
        repository = found["output"]["result"]["repository"]
        assert repository["full_name"] == "octo/hello" and repository["stars"] == 42
        assert created["output"]["result"]["issue"]["number"] == 7
        assert missing["output"] == {
            "success": False,
            "error": "github.get_repository failed: the github API answered HTTP 404",
        }
        assert [s["authorization"] for s in seen["github"]] == [f"Bearer {GITHUB_TOKEN}"] * 3
        assert seen["github"][0]["host"] == "api.github.com"
        assert seen["github"][1]["body"] == {"title": "Bug", "body": "It broke"}
        assert GITHUB_TOKEN not in json.dumps(frames)
        assert frames[-1]["type"] == "done"


async def test_an_api_key_and_a_custom_credential_reach_their_apis(tmp_path, seen, monkeypatch):
    async with AsyncExitStack() as stack_of:
        fake = await fakes(stack_of, tmp_path, seen)
        monkeypatch.setenv("SSL_CERT_FILE", fake["ca"])
        stack = await stack_of.enter_async_context(
            tools_stack(tmp_path, tools={"tools_integration_hosts": fake["hosts"]})
        )
        client = await stack_of.enter_async_context(stack.client())
        await connect(client, "airtable", "api_key", {"api_key": AIRTABLE_KEY})
        await connect(
            client, "qdrant", "custom", {"base_url": fake["qdrant"], "api_key": QDRANT_KEY}
        )
        _body, frames = await run_turn(
            client,
            call("airtable", "list_bases"),
            call("qdrant", "list_collections"),
            {"say": "ok"},
        )
        bases, collections = results(frames)
        assert bases["output"]["result"]["bases"][0]["name"] == "Roadmap"
        assert [c["name"] for c in collections["output"]["result"]["collections"]] == [
            "docs",
            "faq",
        ]
        assert seen["airtable"][0]["authorization"] == f"Bearer {AIRTABLE_KEY}"
        assert seen["qdrant"][0]["api_key"] == QDRANT_KEY
        text = json.dumps(frames)
        assert AIRTABLE_KEY not in text and QDRANT_KEY not in text


async def test_a_host_from_the_credential_obeys_the_outbound_policy(tmp_path, seen):
    async with AsyncExitStack() as stack_of:
        qdrant = await stack_of.enter_async_context(serve_asgi(qdrant_app(seen["qdrant"], "k")))
        stack = await stack_of.enter_async_context(
            tools_stack(tmp_path, tools={"tools_allow_private_network": False})
        )
        client = await stack_of.enter_async_context(stack.client())
        await connect(client, "qdrant", "custom", {"base_url": qdrant, "api_key": "k"})
        _body, frames = await run_turn(client, call("qdrant", "list_collections"), {"say": "ok"})
        (result,) = results(frames)
        assert result["output"] == {
            "success": False,
            "error": "qdrant.list_collections failed: the outbound policy of this deployment "
            "refused its connection to a loopback address",
        }
        assert seen["qdrant"] == []


async def test_catalogue_details_show_effects_costs_and_how_to_connect(tmp_path):
    costs = json.dumps({"github.delete_repository": 1000, "github": 300})
    async with (
        tools_stack(tmp_path, tools={"tools_integration_costs": costs}) as stack,
        stack.client() as client,
    ):
        details = {
            "tool": "get_integration_details",
            "input": {"integration": "github"},
        }
        listing = {"tool": "get_available_integrations", "input": {"query": "notion"}}
        everything = {"tool": "get_available_integrations", "input": {}}
        _body, frames = await run_turn(client, details, listing, everything, {"say": "ok"})
        github, notion, catalogue = (r["output"] for r in results(frames))
        actions = {a["name"]: a for a in github["actions"]}
        assert actions["delete_repository"]["effects"] == ["delete"]
        assert actions["delete_repository"]["credit_cost_millicredits"] == 1000
        assert actions["get_repository"]["credit_cost_millicredits"] == 300
        assert "auth_data" not in actions["get_repository"]["parameters"]["properties"]
        assert {o["type"] for o in github["auth_options"]} == {"oauth2", "bearer"}
        assert [i["name"] for i in notion["integrations"]] == ["notion"]
        assert notion["integrations"][0]["description"] and "note" not in notion
        assert catalogue["count"] > 190 and "query" in catalogue["note"]
        assert set(catalogue["integrations"][0]) == {
            "name",
            "display_name",
            "connected",
            "auth_types",
        }


async def test_a_catalogue_integration_connects_with_the_operator_s_oauth2_app(
    tmp_path, seen, monkeypatch
):
    issued: dict[str, Any] = {}
    async with AsyncExitStack() as stack_of:
        fake = await fakes(stack_of, tmp_path, seen)
        monkeypatch.setenv("SSL_CERT_FILE", fake["ca"])
        # over HTTPS: the token request trusts the CA of SSL_CERT_FILE, as the workers do
        auth = await stack_of.enter_async_context(
            serve_asgi(oauth_server_app(issued), tls=fake["tls"])
        )
        # the operator gives the client (and, here, a local authorization server); the scopes,
        # PKCE and client authentication come from GitHub's manifest
        app = {
            "name": "github",
            "client_id": "loopline-client",
            "client_secret": "client-secret",
            "authorize_url": f"{auth}/authorize",
            "token_url": f"{auth}/token",
        }
        stack = await stack_of.enter_async_context(
            tools_stack(
                tmp_path,
                tools={
                    "tools_integration_hosts": fake["hosts"],
                    "tools_oauth2_integrations": json.dumps([app]),
                },
            )
        )
        client = await stack_of.enter_async_context(stack.client())
        callback = f"{stack.base_url}/credentials/oauth2/callback"
        started = await client.post(
            "/credentials/oauth2/initiate",
            json={"integration_name": "github", "redirect_uri": callback},
        )
        assert started.status_code == 200, started.text
        query = parse_qs(urlsplit(started.json()["authorization_url"]).query)
        assert query["scope"] == ["repo user read:org workflow"]
        assert query["code_challenge_method"] == ["S256"]
        async with httpx.AsyncClient(verify=fake["ca"]) as browser:
            redirect = await browser.get(started.json()["authorization_url"])
            connected = await browser.get(redirect.headers["location"])
        assert connected.status_code == 200, connected.text
        assert connected.json()["integration_name"] == "github"
        assert connected.json()["auth_type"] == "oauth2"
        _body, frames = await run_turn(
            client, call("github", "get_repository", owner="octo", repo="hello"), {"say": "ok"}
        )
        (found,) = results(frames)
        assert found["output"]["result"]["repository"]["full_name"] == "octo/hello"
        assert seen["github"][-1]["authorization"] == f"Bearer {OAUTH_TOKEN}"
        assert OAUTH_TOKEN not in json.dumps(frames)


async def test_the_model_cannot_send_a_credential_to_a_host_of_its_choice(tmp_path, monkeypatch):
    """Datadog's actions take the API host from a `region` parameter: with a credential, a
    region the model names must be one Datadog's own code names, or the credential's own."""
    seen: list[dict[str, Any]] = []
    ca, cert, key = make_test_ca(tmp_path, ["api.attacker.test", "api.datadoghq.eu"])
    monkeypatch.setenv("SSL_CERT_FILE", ca)
    async with AsyncExitStack() as stack_of:
        fake = await stack_of.enter_async_context(
            serve_asgi(recorder_app(seen, {"dashboards": []}), tls=(cert, key))
        )
        hosts = {h: urlsplit(fake).netloc for h in ("api.attacker.test", "api.datadoghq.eu")}
        stack = await stack_of.enter_async_context(
            tools_stack(tmp_path, tools={"tools_integration_hosts": json.dumps(hosts)})
        )
        client = await stack_of.enter_async_context(stack.client())
        keys = {"api_key": "dd-api-key-1", "application_key": "dd-app-key-2"}
        await connect(client, "datadog", "api_key", keys)
        _body, frames = await run_turn(
            client,
            call("datadog", "search_dashboards", region="attacker.test"),
            call("datadog", "search_dashboards", region="ATTACKER\u3002test"),  # a Unicode dot
            call("datadog", "search_dashboards", region="datadoghq.eu"),
            {"say": "ok"},
        )
        steered, disguised, own = results(frames)
        for refused in (steered, disguised):
            assert refused["output"]["success"] is False
            assert "a host named in its parameters" in refused["output"]["error"]
        assert own["output"]["result"]["success"] is True
        assert [s["host"] for s in seen] == ["api.datadoghq.eu"]
        assert seen[0]["headers"]["dd-api-key"] == "dd-api-key-1"
        # a region stored with the keys is the owner's choice: it wins over the model's
        other = await client.post(
            "/credentials",
            json={
                "integration_name": "datadog",
                "auth_type": "api_key",
                "auth_data": {**keys, "region": "attacker.test"},
                "make_default": True,
            },
        )
        assert other.status_code == 201, other.text
        _body, frames = await run_turn(
            client, call("datadog", "search_dashboards", region="datadoghq.eu"), {"say": "ok"}
        )
        assert results(frames)[0]["output"]["result"]["success"] is True
        assert seen[-1]["host"] == "api.attacker.test"


async def test_an_action_that_answers_an_error_fails_and_costs_nothing(tmp_path, seen):
    async with AsyncExitStack() as stack_of:
        qdrant = await stack_of.enter_async_context(
            serve_asgi(qdrant_app(seen["qdrant"], QDRANT_KEY))
        )
        stack = await stack_of.enter_async_context(tools_stack(tmp_path))
        client = await stack_of.enter_async_context(stack.client())
        await connect(client, "qdrant", "custom", {"base_url": qdrant, "api_key": "wrong-key"})
        failed = call("qdrant", "list_collections")
        body, frames = await run_turn(client, {**failed, "tool_call_id": "call_q1"}, {"say": "ok"})
        (result,) = results(frames)
        assert result["output"]["success"] is False
        assert result["output"]["error"].startswith(
            "qdrant.list_collections failed: it answered an error: API error (403)"
        )
        await billing_delivered(stack)
        async with stack.billing.store.sessions() as session:
            charged = (
                (
                    await session.execute(
                        select(LedgerEntry).where(
                            LedgerEntry.org_id == stack.org_id, LedgerEntry.kind == "tool_usage"
                        )
                    )
                )
                .scalars()
                .all()
            )
        assert charged == []


async def test_oauth2_for_a_catalogue_integration_without_an_app_says_what_is_missing(tmp_path):
    async with tools_stack(tmp_path) as stack, stack.client() as client:
        started = await client.post(
            "/credentials/oauth2/initiate",
            json={"integration_name": "github", "redirect_uri": "https://app.example/cb"},
        )
    assert started.status_code == 400
    assert "offers OAuth2, but this deployment has no OAuth2 app" in started.json()["detail"]


async def test_an_oauth2_token_the_api_refuses_is_renewed_and_the_action_retried(
    tmp_path, seen, monkeypatch
):
    server = AuthServer(lifetime_s=3600)
    ca, cert, key = make_test_ca(tmp_path, ["api.github.com"])
    monkeypatch.setenv("SSL_CERT_FILE", ca)
    async with AsyncExitStack() as stack_of:
        auth = await stack_of.enter_async_context(serve_asgi(server.app()))
        github = await stack_of.enter_async_context(
            serve_asgi(github_app(seen["github"], accepted=server.access), tls=(cert, key))
        )
        app = {
            "name": "github",
            "client_id": CLIENT_ID,
            "client_secret": CLIENT_SECRET,
            "authorize_url": f"{auth}/authorize",
            "token_url": f"{auth}/token",
        }
        tools = {
            "tools_integration_hosts": json.dumps({"api.github.com": urlsplit(github).netloc}),
            "tools_oauth2_integrations": json.dumps([app]),
        }
        stack = await stack_of.enter_async_context(tools_stack(tmp_path, tools=tools))
        client = await stack_of.enter_async_context(stack.client())
        callback = f"{stack.base_url}/credentials/oauth2/callback"
        started = await client.post(
            "/credentials/oauth2/initiate",
            json={"integration_name": "github", "redirect_uri": callback},
        )
        async with httpx.AsyncClient() as browser:
            redirect = await browser.get(started.json()["authorization_url"])
            assert (await browser.get(redirect.headers["location"])).status_code == 200
        (first,) = server.access
        server.access.clear()  # revoked before its expiry: GitHub answers 401
        _body, frames = await run_turn(
            client, call("github", "get_repository", owner="octo", repo="hello"), {"say": "ok"}
        )
        (found,) = results(frames)
        assert found["output"]["result"]["repository"]["full_name"] == "octo/hello"
        (second,) = server.access
        assert server.refresh_requests == 1
        assert [s["authorization"] for s in seen["github"]] == [
            f"Bearer {first}",
            f"Bearer {second}",
        ]
        assert not any(token in json.dumps(frames) for token in server.issued)
