"""Every answer of the gateway matches its OpenAPI document, so a client generated from it reads
every answer: a success response of every operation has a schema (the models the handlers
build), and a session calling every documented operation (a turn with a question, its resume,
a cancel, the chats, the organization settings, the account routes, credentials with an MCP
server and an OAuth2 connection, knowledge bases, integrations, the usage overview) has each
response checked by schemathesis' response conformance (status documented, body and SSE frames
of the documented schema)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import schemathesis

from tests.conftest import SCRIPTED, Stack, script, start_stack, stop_stack
from tests.gateway.test_oauth2_connect import acme_provider, oauth_server_app
from tests.tools.tools_stack import PG_DSN, failure_mcp_app, serve_asgi

Answers = list[httpx.Response]


async def _document(client: httpx.AsyncClient) -> dict[str, Any]:
    response = await client.get("/openapi.json")
    assert response.status_code == 200
    return response.json()


def _operations(document: dict[str, Any]) -> set[tuple[str, str]]:
    return {
        (method.upper(), path)
        for path, operations in document["paths"].items()
        for method in operations
    }


def _template(document: dict[str, Any], path: str) -> str:
    """The documented path template that `path` matches (literal segments before parameters)."""
    matches = [
        template
        for template in document["paths"]
        if re.fullmatch(re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(template)), path)
    ]
    assert matches, path
    return min(matches, key=lambda template: template.count("{"))


async def test_every_success_response_declares_its_schema(services):
    async with services.client() as client:
        document = await _document(client)
    for method, path in _operations(document):
        responses = document["paths"][path][method.lower()]["responses"]
        successes = {code: r for code, r in responses.items() if code.startswith("2")}
        assert successes, (method, path)
        for code, response in successes.items():
            if code == "204":
                assert "content" not in response, (method, path)
                continue
            content = response["content"]
            assert content, (method, path, code)
            for media, declared in content.items():
                assert declared.get("schema"), (method, path, code, media)
    listen = document["paths"]["/assistant/chat/{chat_id}/listen/{run_id}"]["get"]
    assert list(listen["responses"]["200"]["content"]) == ["text/event-stream"]
    schemas = document["components"]["schemas"]
    assert schemas["TurnStarted"]["required"] == [
        "status",
        "chat_id",
        "run_id",
        "thread_id",
        "stream_url",
    ]
    # FastAPI's 422 "Validation Error" is not declared: the gateway answers such requests 400
    assert "HTTPValidationError" not in schemas


@pytest.fixture
async def reachable(tmp_path) -> AsyncIterator[Stack]:
    """The four services (the suite's backend) with an OAuth2 provider and an MCP server they may
    reach on loopback; `extra["mcp_url"]` is the MCP server's URL."""
    async with (
        serve_asgi(oauth_server_app({})) as auth_base,
        serve_asgi(failure_mcp_app([])) as mcp_base,
    ):
        provider = acme_provider(auth_base)
        stack = await start_stack(
            tmp_path,
            gateway={"heartbeat_interval_s": 1.0},
            tools={
                "tools_allow_private_network": True,
                "tools_oauth2_integrations": json.dumps([provider]),
            },
        )
        stack.extra["mcp_url"] = f"{mcp_base}/mcp"
        try:
            yield stack
        finally:
            await stop_stack(stack)


async def _ok(answer: Any, status: int = 200) -> Any:
    response = await answer
    assert response.status_code == status, (response.request.url, response.text)
    if response.headers.get("content-type", "").startswith("application/json"):
        return response.json()
    return response.text


async def _turns(client: httpx.AsyncClient) -> None:
    """A turn that asks a question (started twice with one Idempotency-Key), answered by a resume;
    a second turn cancelled while it waits; the chats read and one deleted; some refusals."""
    body = {
        "message": script(
            {"tool": "ask_user_yes_no", "input": {"message": "Go on?"}}, {"say": "Done."}
        )
    }
    key = {"Idempotency-Key": "openapi-session-1"}
    asked = await _ok(client.post("/assistant/chat", json=body, headers=key))
    replayed = await client.post("/assistant/chat", json=body, headers=key)
    assert replayed.headers["idempotent-replayed"] == "true"
    chat = f"/assistant/chat/{asked['chat_id']}"
    await _ok(client.get(asked["stream_url"]))
    status = await _ok(client.get(f"{chat}/status"))
    await _ok(client.get(chat))
    resumed = await _ok(
        client.post(
            f"{chat}/resume",
            json={
                "request_id": status["pending_request_id"],
                "response": {"kind": "yes_no", "answer": True},
            },
        )
    )
    await _ok(client.get(resumed["stream_url"], params={"after": 0}))
    assert "next_page_token" in await _ok(client.get(chat, params={"page_size": 1}))
    await _ok(client.post(f"{chat}/cancel"), 400)  # nothing running
    second = await _ok(
        client.post(
            "/assistant/chat",
            json={"message": script({"tool": "ask_user_free_text", "input": {"message": "?"}})},
        )
    )
    await _ok(client.get(second["stream_url"]))
    await _ok(client.post(f"/assistant/chat/{second['chat_id']}/cancel"))
    await _ok(client.get("/assistant/chats", params={"limit": 10}))
    await _ok(client.delete(chat))
    await _ok(client.get(chat), 404)
    await _ok(client.get("/assistant/chats", headers={"Authorization": "Bearer nope"}), 401)


async def _settings(client: httpx.AsyncClient) -> None:
    await _ok(client.get("/organizations/settings"))
    await _ok(client.put("/organizations/settings/composer-llm", json=SCRIPTED))
    await _ok(client.get("/organizations/settings"))
    await _ok(client.delete("/organizations/settings/composer-llm"))


async def _account(client: httpx.AsyncClient, browser: httpx.AsyncClient) -> None:
    """The system health (no key), the caller's profile and organizations, an API key's life."""
    await _ok(browser.get("/system/health"))
    await _ok(client.get("/auth/me"))
    await _ok(client.get("/auth/me/organizations", params={"role": "owner"}))
    created = await _ok(client.post("/api-keys", json={"name": "openapi session"}), 201)
    await _ok(client.get("/api-keys", params={"include_revoked": "true"}))
    await _ok(client.get(f"/api-keys/{created['id']}"))
    await _ok(client.delete(f"/api-keys/{created['id']}"))
    await _ok(client.get("/api-keys/key_missing"), 404)


async def _credentials(client: httpx.AsyncClient, browser: httpx.AsyncClient, stack: Stack) -> None:
    """A credential's life; an MCP server's registration and discovery; an OAuth2 connection
    whose callback the browser (no API key) reaches."""
    created = await _ok(
        client.post(
            "/credentials",
            json={"integration_name": "postgresql", "auth_data": {"dsn": PG_DSN}},
        ),
        201,
    )
    one = f"/credentials/{created['credential_id']}"
    await _ok(client.get("/credentials", params={"integration_name": "postgresql"}))
    await _ok(client.get(one, params={"include_masked": "true"}))
    await _ok(client.post(f"{one}/set-default"))
    await _ok(client.delete(one), 204)
    server = await _ok(
        client.post(
            "/credentials/mcp-server",
            json={"server_url": stack.extra["mcp_url"], "display_name": "Test Tools"},
        ),
        201,
    )
    assert server["total_tools"] > 0, server
    await _ok(client.get(f"/credentials/{server['credential_id']}/mcp-tools"))
    await _ok(client.post(f"/credentials/{server['credential_id']}/refresh-discovery"))
    started = await _ok(
        client.post(
            "/credentials/oauth2/initiate",
            json={
                "integration_name": "acme",
                "redirect_uri": f"{stack.base_url}/credentials/oauth2/callback",
            },
        )
    )
    async with httpx.AsyncClient() as authorization_server:
        redirect = await authorization_server.get(started["authorization_url"])
    assert redirect.status_code == 302
    connected = await _ok(browser.get(redirect.headers["location"]))
    assert connected["status"] == "connected"


async def _knowledge(client: httpx.AsyncClient) -> None:
    kb = await _ok(client.post("/knowledge-bases", json={"name": "Animals"}), 201)
    base = f"/knowledge-bases/{kb['id']}"
    await _ok(client.get("/knowledge-bases"))
    document = await _ok(
        client.post(
            f"{base}/documents",
            files={"file": ("lemurs.txt", b"Lemurs live in Madagascar.", "text/plain")},
        ),
        201,
    )
    await _ok(client.get(f"{base}/documents/{document['id']}"))
    await _ok(client.get(f"{base}/documents/{document['id']}/status"))
    await _ok(client.get(base))
    await _ok(client.get(f"{base}/documents", params={"status": "processing"}))
    found = await _ok(
        client.post(f"{base}/search", json={"query": "lemurs", "search_type": "keyword"})
    )
    assert found["total_matches"] == 1, found
    await _ok(
        client.post(
            "/knowledge-bases/search", json={"knowledge_base_ids": [kb["id"]], "query": "x"}
        )
    )
    hybrid = await _ok(client.post(f"{base}/hybrid-search", json={"query": "lemurs"}))
    assert hybrid["matches"], hybrid
    context = await _ok(
        client.post(f"{base}/retrieve-context", json={"query": "lemurs", "min_score": 0})
    )
    assert "Madagascar" in context["context"], context
    await _ok(client.delete(f"{base}/documents/{document['id']}"), 204)
    await _ok(client.delete(base), 204)
    await _ok(client.get(base), 404)


async def _integrations(client: httpx.AsyncClient) -> None:
    """Every integrations route, details and OAuth2 flags included, and a 404."""
    await _ok(client.get("/integrations/browse", params={"page_size": 20}))
    await _ok(client.get("/integrations/browse", params={"type": "llm_provider"}))
    await _ok(client.get("/integrations/tools"))
    await _ok(client.get("/integrations/tools/acme"))
    await _ok(client.get("/integrations/tools/postgresql"))
    await _ok(client.get("/integrations/llm-providers"))
    await _ok(client.get("/integrations/llm-providers/openai"))
    await _ok(client.get("/integrations/knowledge-providers"))
    await _ok(client.get("/integrations/knowledge-providers/loopline_knowledge"))
    await _ok(client.get("/integrations/scripted"))
    await _ok(client.get("/integrations/no_such_integration"), 404)


async def _dashboard(client: httpx.AsyncClient) -> None:
    """The usage overview, and a paging value out of range."""
    await _ok(client.get("/dashboard/analytics/overview", params={"limit": 5, "offset": 0}))
    await _ok(client.get("/dashboard/analytics/overview", params={"limit": 0}), 400)


async def test_every_answer_of_every_operation_matches_the_document(reachable):
    answers: Answers = []

    async def record(response: httpx.Response) -> None:
        answers.append(response)

    hooks = {"response": [record]}
    async with (
        reachable.client(event_hooks=hooks) as client,
        httpx.AsyncClient(base_url=reachable.base_url, event_hooks=hooks) as browser,
    ):
        document = await _document(client)
        await _turns(client)
        await _settings(client)
        await _account(client, browser)
        await _credentials(client, browser, reachable)
        await _knowledge(client)
        await _integrations(client)
        await _dashboard(client)
    answers = [a for a in answers if a.request.url.path != "/openapi.json"]
    schema = schemathesis.openapi.from_dict(document)
    answered = set()
    for response in answers:
        method, template = response.request.method, _template(document, response.request.url.path)
        response.request.read()  # schemathesis reads the request's body (a multipart upload)
        schema[template][method].validate_response(response)  # raises on any mismatch
        if response.is_success:
            answered.add((method, template))
    assert answered == _operations(document)  # every operation answered with success once
    assert {a.status_code for a in answers} >= {200, 201, 204, 400, 401, 404}
