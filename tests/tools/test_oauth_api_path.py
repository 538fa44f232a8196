"""The OAuth2 `api_request` action keeps the access token on the API's base path: e.g.
`/../../steal3` must not send `Authorization: Bearer <access token>` to `/steal3` on the host."""

from __future__ import annotations

import httpx
import pytest

from services.tools.catalogue import ActionContext, ActionError
from services.tools.oauth import OAuth2Provider, api_path_error, integration_of

PROVIDER = OAuth2Provider(
    name="acme",
    display_name="Acme",
    description="",
    authorize_url="http://auth.test/authorize",
    token_url="http://auth.test/token",
    client_id="c",
    client_secret="",
    scope="",
    api_base_url="http://api.test/api",
)
CTX = ActionContext(
    secret={"access_token": "at-secret"},
    auth_type="oauth2",
    timeout_s=5,
    max_output_bytes=100_000,
    allow_private_network=False,
)


@pytest.fixture
def sent(monkeypatch):
    """The URLs the action requested, through a mock transport (no network)."""
    urls: list[str] = []
    real = httpx.AsyncClient

    def handler(request: httpx.Request) -> httpx.Response:
        urls.append(str(request.url))
        return httpx.Response(200, json={"ok": True})

    monkeypatch.setattr(
        httpx, "AsyncClient", lambda **kw: real(transport=httpx.MockTransport(handler), **kw)
    )
    return urls


@pytest.mark.parametrize(
    "path",
    [
        "/../../steal3",
        "/..",
        "/./me",
        "/v1/../../x",
        "/%2e%2e/x",
        "/%2E./x",
        "/.%2e/x",
        "/v1/%2F%2Fevil",
        "/a%5c..%5cb",
        "/a\\..\\b",
        "//evil.test/x",
        "http://evil.test/x",
        "me",
    ],
)
async def test_a_path_leaving_the_api_base_path_is_refused_before_any_request(sent, path):
    action = integration_of(PROVIDER, 5).actions["api_request"]
    with pytest.raises(ActionError, match="path must be a path on the API"):
        await action.handler(CTX, {"path": path})
    assert sent == []


@pytest.mark.parametrize(
    "path", ["/me", "/v1/items?q=../x", "/v1/a..b/c.d", "/v1/items#..", "/v1/%41"]
)
async def test_a_path_on_the_api_is_sent_under_the_base_path(sent, path):
    assert api_path_error(path) is None
    action = integration_of(PROVIDER, 5).actions["api_request"]
    result = await action.handler(CTX, {"path": path})
    assert result == {"status": 200, "body": {"ok": True}}
    assert sent[0].startswith("http://api.test/api/")


# `..;` is `..` to servlet containers (they drop path parameters after normalizing), so
# `/..;/secret` must not reach the provider as `/api/..;/secret` with the access token, nor
# percent-encoded once or more (a proxy may decode before the server does).
@pytest.mark.parametrize(
    "path",
    [
        "/..;/secret",
        "/v1/..;/secret",
        "/%2e%2e%3b/secret",
        "/%2E%2E%3B/secret",
        "/%2E%2E/secret",
        "/.%2E/secret",
        "/%252e%252e/secret",
        "/%25252e%25252e%25253b/secret",
        "/v1/%252F%252Fevil",
        "/v1/%255c..%255csecret",
        "/v1;jsessionid=x/me",
        "/v1/me;x=1",
        "/v1/%3Bx",
        "/%EF%BC%8E%EF%BC%8E/secret",
        "/\uff0e\uff0e/secret",
        "/v1/a%00b",
        "/v1/a%0d%0ab",
        "/%" + "25" * 6 + "2e",
    ],
)
async def test_path_parameters_and_dot_segments_in_every_encoding_are_refused(sent, path):
    action = integration_of(PROVIDER, 5).actions["api_request"]
    with pytest.raises(ActionError, match="path must be a path on the API"):
        await action.handler(CTX, {"path": path})
    assert sent == []


@pytest.mark.parametrize(
    "path", ["/v1/items?filter=a;b", "/v1/%2541", "/v1/...", "/v1/a.b.c", "/v1/%E2%82%AC"]
)
async def test_paths_that_only_look_alike_are_sent(sent, path):
    assert api_path_error(path) is None
    action = integration_of(PROVIDER, 5).actions["api_request"]
    assert (await action.handler(CTX, {"path": path}))["status"] == 200
