"""The OpenAPI document declares how each operation is authenticated, exactly as the gateway checks
it: the `api_key` bearer scheme and the X-Organization-ID header on every operation that answers
401 without a key (optional only on the caller's profile, which answers without it),
Idempotency-Key where it is honoured, none on the OAuth2 callback nor the system health; the
headers' schemas refuse what the gateway answers 400. A turn runs with only what the document
declares (as Swagger UI's Authorize button and "Try it out" send it)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jsonschema
import pytest

from tests.conftest import Stack, script, start_stack, stop_stack
from tests.sse_client import read_frames

NO_KEY = "Missing or invalid Authorization header; use 'Bearer <api key>'"


@pytest.fixture
async def stack(tmp_path) -> AsyncIterator[Stack]:
    """The four services with the failed-authentication limit raised past the 401s sent here."""
    running = await start_stack(
        tmp_path, gateway={"heartbeat_interval_s": 1.0, "failed_auths_per_minute": 10_000}
    )
    try:
        yield running
    finally:
        await stop_stack(running)


async def _document(stack: Stack) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=stack.base_url) as client:
        response = await client.get("/openapi.json")  # open: no key
    assert response.status_code == 200
    return response.json()


def _operations(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (method.upper(), path, operation)
        for path, operations in document["paths"].items()
        for method, operation in operations.items()
    ]


def _headers(operation: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The header parameters an operation declares, by name."""
    return {p["name"]: p for p in operation.get("parameters", ()) if p["in"] == "header"}


async def test_the_key_and_organization_are_declared_exactly_where_the_gateway_requires_them(
    stack,
):
    document = await _document(stack)
    scheme = document["components"]["securitySchemes"]["api_key"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    keyed, open_, optional = set(), set(), set()
    async with httpx.AsyncClient(base_url=stack.base_url) as client:
        for method, path, operation in _operations(document):
            url = re.sub(r"\{[^}]+\}", "x1", path)
            keyless = await client.request(method, url, headers={"X-Organization-ID": stack.org_id})
            orgless = await client.request(
                method, url, headers={"Authorization": f"Bearer {stack.api_key}"}
            )
            headers = _headers(operation)
            if keyless.status_code == 401:
                keyed.add((method, path))
                assert operation.get("security") == [{"api_key": []}], (method, path)
                assert keyless.json() == {"detail": NO_KEY}, (method, path)
                assert keyless.headers["www-authenticate"] == "Bearer"
                if headers["X-Organization-ID"]["required"]:
                    assert orgless.status_code == 400 and orgless.json() == {
                        "detail": "X-Organization-ID header is required"
                    }, (method, path)
                else:  # the caller's profile: the header is optional there
                    assert orgless.status_code == 200, (method, path, orgless.text)
                    optional.add((method, path))
            else:
                open_.add((method, path))
                assert not operation.get("security"), (method, path)
                assert "X-Organization-ID" not in headers, (method, path)
    assert ("GET", "/credentials/oauth2/callback") in open_
    assert ("GET", "/system/health") in open_
    assert optional == {("GET", "/auth/me"), ("GET", "/auth/me/organizations")}
    assert ("POST", "/assistant/chat") in keyed and len(keyed) >= 27


async def test_only_the_turn_start_declares_idempotency_key_and_its_bounds_are_the_gateways(
    stack,
):
    document = await _document(stack)
    declaring = {
        (method, path)
        for method, path, operation in _operations(document)
        if "Idempotency-Key" in _headers(operation)
    }
    assert declaring == {("POST", "/assistant/chat")}
    turn_start = document["paths"]["/assistant/chat"]["post"]
    schema = _headers(turn_start)["Idempotency-Key"]["schema"]
    async with stack.client() as client:
        for key in ("k" * 255, "k" * 256):
            declared_ok = jsonschema.Draft202012Validator(schema).is_valid(key)
            response = await client.post(
                "/assistant/chat",
                json={"message": script({"say": "hi"})},
                headers={"Idempotency-Key": key},
            )
            assert response.status_code == (200 if declared_ok else 400), (len(key), response.text)


async def test_the_organization_header_schema_refuses_what_the_gateway_answers_400(stack):
    document = await _document(stack)
    schema = _headers(document["paths"]["/assistant/chats"]["get"])["X-Organization-ID"]["schema"]
    validator = jsonschema.Draft202012Validator(schema)
    async with stack.client() as client:
        for organization in (stack.org_id, "o" * 128, "o" * 129, "org x", "org_ü".encode()):
            response = await client.get(
                "/assistant/chats", headers={"X-Organization-ID": organization}
            )
            text = (
                organization.decode("latin-1") if isinstance(organization, bytes) else organization
            )
            # a well-formed id of no membership is 403, not 400
            assert (response.status_code != 400) is validator.is_valid(text), (
                organization,
                response.text,
            )


async def test_a_turn_runs_with_only_what_the_document_declares(stack):
    """What Swagger UI sends: the Authorize dialog's key for the operation's security scheme and
    a value for each required header parameter, nothing else."""
    document = await _document(stack)
    values = {"X-Organization-ID": stack.org_id}

    def declared(operation: dict[str, Any]) -> dict[str, str]:
        headers = {}
        for requirement in operation.get("security", ()):
            for name in requirement:
                scheme = document["components"]["securitySchemes"][name]
                assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
                headers["Authorization"] = f"Bearer {stack.api_key}"
        for name, parameter in _headers(operation).items():
            if parameter["required"]:
                headers[name] = values[name]
        return headers

    paths = document["paths"]
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
        started = await client.post(
            "/assistant/chat",
            json={"message": script({"say": "Hello from the document."})},
            headers=declared(paths["/assistant/chat"]["post"]),
        )
        assert started.status_code == 200, started.text
        client.headers.update(declared(paths["/assistant/chat/{chat_id}/listen/{run_id}"]["get"]))
        frames = await read_frames(client, started.json()["stream_url"])
    assert frames[-1]["type"] == "done"
    assert frames[-1]["data"]["response"] == "Hello from the document."


async def test_every_operation_declares_x_request_id_and_every_answer_returns_it(stack):
    document = await _document(stack)
    for method, path, operation in _operations(document):
        request_id = _headers(operation).get("X-Request-ID")
        assert request_id is not None and not request_id["required"], (method, path)
        for status, response in operation["responses"].items():
            assert "X-Request-ID" in response.get("headers", {}), (method, path, status)
    async with httpx.AsyncClient(base_url=stack.base_url) as client:
        answer = await client.get("/assistant/chats", headers={"X-Request-ID": "from-the-doc.1"})
    assert answer.headers["x-request-id"] == "from-the-doc.1"
