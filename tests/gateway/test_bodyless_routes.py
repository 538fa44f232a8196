"""Routes that take no body refuse one as every route refuses a bad body; a trailing slash is 404.

As the README says: `POST /assistant/chat/{id}/cancel`, `set-default` and
`DELETE /assistant/chat/{id}` answer a malformed body (`not json`) or an unknown field
(`{"reason": "mine", "foo": 1}`) 400 and a body over LOOPLINE_MAX_BODY_BYTES 413, never a 200
that silently ignores it. `POST /assistant/chat/` is 404, not a 307 before any API key is
checked with the request's Host header in its Location.
"""

from __future__ import annotations

import pytest

from tests.orchestrator.helpers import run_turn

BIG = b"x" * (1_048_576 + 1)


async def _routes(services, client) -> list[tuple[str, str, int]]:
    """(method, path, status with no body) of every route that takes no body."""
    body, _ = await run_turn(client, {"say": "hi"})
    created = await client.post(
        "/credentials",
        json={
            "integration_name": "http",
            "auth_type": "bearer_token",
            "auth_data": {"token": "tok-1234567890"},
        },
    )
    assert created.status_code == 201, created.text
    credential = created.json()["credential_id"]
    return [
        (
            "POST",
            f"/assistant/chat/{body['chat_id']}/cancel",
            400,
        ),  # nothing running: "No active execution"
        ("POST", f"/credentials/{credential}/set-default", 200),
        ("POST", f"/credentials/{credential}/refresh-discovery", 400),  # not an MCP server
        ("DELETE", "/organizations/settings/composer-llm", 200),
        ("DELETE", f"/credentials/{credential}", 204),
        ("DELETE", f"/assistant/chat/{body['chat_id']}", 200),
    ]


@pytest.mark.parametrize(
    "content, status, words",
    [
        (b"not json", 400, "not valid JSON"),
        (b'{"reason": "mine", "foo": 1}', 400, "Unknown field(s): foo, reason"),
        (b"[]", 400, "must be a JSON object"),
        (BIG, 413, "exceeds"),
    ],
)
async def test_a_route_that_takes_no_body_refuses_one(services, content, status, words):
    async with services.client() as client:
        for method, path, _ in await _routes(services, client):
            response = await client.request(
                method, path, content=content, headers={"content-type": "application/json"}
            )
            assert response.status_code == status, (
                method,
                path,
                response.status_code,
                response.text,
            )
            assert words in response.json()["detail"], (method, path, response.text)


async def test_no_body_or_an_empty_object_is_taken_and_the_key_is_checked_first(services):
    async with services.client() as client:
        for method, path, expected in await _routes(
            services, client
        ):  # in order: the deletes come last
            response = await client.request(
                method, path, content=b"{}" if method == "POST" else b""
            )
            assert response.status_code == expected, (method, path, response.text)
            anonymous = await client.request(
                method, path, content=b"not json", headers={"authorization": ""}
            )
            assert anonymous.status_code == 401, (method, path, anonymous.text)


@pytest.mark.parametrize(
    "method, path",
    [("POST", "/assistant/chat/"), ("GET", "/assistant/chats/"), ("GET", "/credentials/")],
)
async def test_a_trailing_slash_is_not_found_not_a_redirect_to_the_callers_host(
    services, method, path
):
    async with services.client() as client:
        response = await client.request(
            method, path, headers={"host": "evil.example", "authorization": ""}
        )
    assert response.status_code == 404, response.text
    assert "location" not in response.headers
