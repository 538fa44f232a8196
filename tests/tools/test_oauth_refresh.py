"""OAuth2 credentials past their first access token: renewal with the refresh token before a call
(expiring soon) and after a 401, both client authentication methods at the token endpoint, one
renewal for concurrent calls (also across two replicas on PostgreSQL), the reconnect state after a
refused renewal, and nothing marked when the token endpoint is down.

The authorization server is a local Starlette app (`AuthServer`): access tokens live 2 s, refresh
tokens rotate (single use), and its API at /api/me accepts only live access tokens.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import json
import logging
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from loopline.tools.v1 import tools_pb2
from services.common import pb
from services.tools.oauth import OAuth2Provider, parse_providers
from tests.tools.conftest import ORG, StartTools, ToolsClient
from tests.tools.tools_stack import serve_asgi

CLIENT_ID = "loopline-client"
CLIENT_SECRET = "client-secret-xyz"
LIFETIME_S = 2
CALL = {"integration": "acme", "action": "api_request", "parameters": {"path": "/me"}}


@dataclass
class AuthServer:
    """The authorization server's state: what it issued and what it was asked.

    `method` is the client authentication it requires (the other one is refused, invalid_client);
    `refuse` makes it answer invalid_grant to refresh requests, `unavailable` 503 to them;
    `send_refresh_token` false issues access tokens alone; `refresh_delay_s` holds each refresh
    open (so that concurrent calls overlap); `pkce` false expects no code challenge or verifier.
    """

    method: str = "client_secret_post"
    refuse: bool = False
    unavailable: bool = False
    send_refresh_token: bool = True
    refresh_delay_s: float = 0.0
    lifetime_s: int = LIFETIME_S
    pkce: bool = True
    codes: dict[str, dict[str, Any]] = field(default_factory=dict)
    access: dict[str, float] = field(default_factory=dict)  # access token -> expiry (monotonic)
    refresh: set[str] = field(default_factory=set)  # refresh tokens not used yet
    refreshes: int = 0  # refresh requests answered with a token
    refresh_requests: int = 0
    methods_seen: list[str] = field(default_factory=list)
    issued: list[str] = field(default_factory=list)  # every token issued (secrets to look for)
    _serial: Any = field(default_factory=itertools.count)

    def tokens(self) -> dict[str, Any]:
        """A new token response (access token live for `lifetime_s`, a new refresh token)."""
        n = next(self._serial)
        access = f"at-secret-{n}-{time.monotonic_ns()}"
        self.access[access] = time.monotonic() + self.lifetime_s
        body: dict[str, Any] = {
            "access_token": access,
            "token_type": "Bearer",
            "expires_in": self.lifetime_s,
        }
        self.issued.append(access)
        if self.send_refresh_token:
            refresh = f"rt-secret-{n}-{time.monotonic_ns()}"
            self.refresh.add(refresh)
            self.issued.append(refresh)
            body["refresh_token"] = refresh
        return body

    def client_method(self, headers: Any, form: Any) -> str | None:
        """The client authentication method a token request used, when it is valid."""
        basic = base64.b64encode(f"{CLIENT_ID}:{CLIENT_SECRET}".encode()).decode()
        if headers.get("authorization") == f"Basic {basic}" and "client_secret" not in form:
            return "client_secret_basic"
        if (
            "authorization" not in headers
            and form.get("client_id") == CLIENT_ID
            and form.get("client_secret") == CLIENT_SECRET
        ):
            return "client_secret_post"
        return None

    def app(self) -> Any:
        """The Starlette app: /authorize, /token, /api/me."""
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, RedirectResponse
        from starlette.routing import Route

        async def authorize(request: Request) -> Any:
            q = request.query_params
            code = f"code-{next(self._serial)}"
            self.codes[code] = {
                "challenge": q.get("code_challenge"),
                "redirect_uri": q["redirect_uri"],
                "query": dict(q),
            }
            target = {"code": code, "state": q["state"]}
            return RedirectResponse(f"{q['redirect_uri']}?{urllib.parse.urlencode(target)}", 302)

        async def token(request: Request) -> Any:
            form = await request.form()
            method = self.client_method(request.headers, form)
            if method != self.method:
                return JSONResponse({"error": "invalid_client"}, status_code=401)
            self.methods_seen.append(method)
            if form.get("grant_type") == "authorization_code":
                grant = self.codes.pop(str(form.get("code")), None)
                verifier = form.get("code_verifier")
                if grant is None or form.get("redirect_uri") != grant["redirect_uri"]:
                    return JSONResponse({"error": "invalid_grant"}, status_code=400)
                if (
                    self.pkce != (verifier is not None)
                    or self.pkce
                    and grant["challenge"] != _s256(str(verifier))
                ):
                    return JSONResponse({"error": "invalid_grant"}, status_code=400)
                return JSONResponse(self.tokens())
            if form.get("grant_type") != "refresh_token":
                return JSONResponse({"error": "unsupported_grant_type"}, status_code=400)
            self.refresh_requests += 1
            await asyncio.sleep(self.refresh_delay_s)
            if self.unavailable:
                return JSONResponse({"error": "temporarily_unavailable"}, status_code=503)
            presented = str(form.get("refresh_token"))
            if self.refuse or presented not in self.refresh:
                return JSONResponse({"error": "invalid_grant"}, status_code=400)
            self.refresh.discard(presented)  # rotating: each refresh token works once
            self.refreshes += 1
            return JSONResponse(self.tokens())

        async def me(request: Request) -> Any:
            scheme, _, access = request.headers.get("authorization", "").partition(" ")
            expiry = self.access.get(access)
            if scheme != "Bearer" or expiry is None or expiry <= time.monotonic():
                return JSONResponse({"error": "invalid_token"}, status_code=401)
            return JSONResponse({"login": "octo"})

        return Starlette(
            routes=[
                Route("/authorize", authorize),
                Route("/token", token, methods=["POST"]),
                Route("/api/me", me),
            ]
        )


def _s256(verifier: str) -> str:
    digest = hashlib.sha256(verifier.encode()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def provider_config(base: str, **extra: Any) -> str:
    """LOOPLINE_TOOLS_OAUTH2_INTEGRATIONS with the integration `acme` on the server at `base`."""
    return json.dumps(
        [
            {
                "name": "acme",
                "display_name": "Acme",
                "authorize_url": f"{base}/authorize",
                "token_url": f"{base}/token",
                "client_id": CLIENT_ID,
                "client_secret": CLIENT_SECRET,
                "scopes": ["read", "write"],
                "api_base_url": f"{base}/api",
                **extra,
            }
        ]
    )


async def connect(tools: ToolsClient, org: str = ORG) -> tools_pb2.Credential:
    """Connect `acme` for `org` through the authorization code flow; the stored credential."""
    started = await tools.stub.InitiateOAuth2(
        tools_pb2.InitiateOAuth2Request(
            organization_id=org,
            integration_name="acme",
            redirect_uri="http://127.0.0.1:1/callback",
            user_id="user-1",
        )
    )
    async with httpx.AsyncClient() as browser:
        redirect = await browser.get(started.authorization_url)
    assert redirect.status_code == 302, redirect.text
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(redirect.headers["location"]).query)
    done = await tools.stub.CompleteOAuth2(
        tools_pb2.CompleteOAuth2Request(state=query["state"][0], code=query["code"][0])
    )
    return done.credential


async def credential(tools: ToolsClient, credential_id: str) -> dict[str, Any]:
    """The credential's metadata as ListCredentials shows it (GET /credentials'
    credentials_metadata)."""
    listed = await tools.stub.ListCredentials(
        tools_pb2.ListCredentialsRequest(organization_id=ORG, integration_name="acme")
    )
    (found,) = [c for c in listed.credentials if c.credential_id == credential_id]
    return pb.from_struct(found.metadata)


async def wait_until_expired(server: AuthServer) -> None:
    """Sleep until every access token issued so far has expired."""
    await asyncio.sleep(max(server.access.values()) - time.monotonic() + 0.05)


def assert_no_secret(server: AuthServer, caplog: pytest.LogCaptureFixture, *texts: str) -> None:
    """No issued token and not the client secret in `texts` or in any log record (message and
    structured fields)."""
    logged = [f"{r.getMessage()} {r.__dict__!r}" for r in caplog.records]
    for secret in [*server.issued, CLIENT_SECRET]:
        for text in [*texts, *logged]:
            assert secret not in text


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """Every log record, DEBUG included."""
    caplog.set_level(logging.DEBUG)
    return caplog


@pytest.mark.parametrize("method", ["client_secret_post", "client_secret_basic"])
async def test_a_call_after_the_access_token_expired_renews_it_and_succeeds(
    start_tools: StartTools, logs: pytest.LogCaptureFixture, method: str
):
    server = AuthServer(method=method)
    async with serve_asgi(server.app()) as base:
        tools = await start_tools(
            tools_oauth2_integrations=provider_config(base, token_endpoint_auth_method=method)
        )
        connected = await connect(tools)
        first = await credential(tools, connected.credential_id)
        assert first["scope"] == "read write" and "expires_at" in first
        outputs = []
        for _ in range(2):  # twice: the rotated refresh token was stored and works next time
            await wait_until_expired(server)
            output = await tools.ok("execute_integration_tool", CALL)
            assert output["result"] == {"status": 200, "body": {"login": "octo"}}
            outputs.append(json.dumps(output))
        assert server.refreshes == 2
        assert set(server.methods_seen) == {method}  # the exchange and both renewals
        renewed = await credential(tools, connected.credential_id)
        assert renewed["expires_at"] > first["expires_at"] and renewed["scope"] == "read write"
        assert "needs_reconnect" not in renewed
    assert_no_secret(server, logs, *outputs)


async def test_the_wrong_client_authentication_method_is_refused_and_marks_nothing(
    start_tools: StartTools, logs: pytest.LogCaptureFixture
):
    server = AuthServer(method="client_secret_post")
    async with serve_asgi(server.app()) as base:
        tools = await start_tools(tools_oauth2_integrations=provider_config(base))
        connected = await connect(tools)
        server.method = "client_secret_basic"  # the operator's configuration no longer fits
        await wait_until_expired(server)
        error = await tools.failed("execute_integration_tool", CALL)
        assert "refused Loopline's OAuth2 client" in error and "operator" in error
        assert "needs_reconnect" not in await credential(tools, connected.credential_id)
    assert_no_secret(server, logs, error)


async def test_concurrent_calls_on_one_credential_renew_it_once(start_tools: StartTools):
    server = AuthServer(refresh_delay_s=0.3)
    async with serve_asgi(server.app()) as base:
        tools = await start_tools(tools_oauth2_integrations=provider_config(base))
        await connect(tools)
        await wait_until_expired(server)
        outputs = await asyncio.gather(
            *(tools.ok("execute_integration_tool", CALL) for _ in range(8))
        )
    assert [o["result"]["status"] for o in outputs] == [200] * 8
    assert server.refresh_requests == 1


async def test_a_401_from_the_api_renews_the_token_once_and_retries_once(
    start_tools: StartTools, logs: pytest.LogCaptureFixture
):
    server = AuthServer(lifetime_s=3600, refresh_delay_s=0.2)
    async with serve_asgi(server.app()) as base:
        tools = await start_tools(tools_oauth2_integrations=provider_config(base))
        await connect(tools)
        server.access.clear()  # revoked before its expiry: the API answers 401
        outputs = await asyncio.gather(
            *(tools.ok("execute_integration_tool", CALL) for _ in range(3))
        )
        assert [o["result"]["status"] for o in outputs] == [200] * 3
        assert server.refresh_requests == 1
        server.access.clear()
        server.refuse = True  # a 401 and a refused renewal: the credential must be reconnected
        error = await tools.failed("execute_integration_tool", CALL)
    assert "must be connected again" in error and "request_credential" in error
    assert_no_secret(server, logs, error, *map(json.dumps, outputs))


@pytest.mark.parametrize("refusal", ["invalid_grant", "no_refresh_token"])
async def test_a_refused_renewal_asks_for_a_new_connection_which_clears_the_mark(
    start_tools: StartTools, logs: pytest.LogCaptureFixture, refusal: str
):
    server = AuthServer(send_refresh_token=refusal != "no_refresh_token")
    async with serve_asgi(server.app()) as base:
        tools = await start_tools(tools_oauth2_integrations=provider_config(base))
        connected = await connect(tools)
        server.refuse = True
        await wait_until_expired(server)
        error = await tools.failed("execute_integration_tool", CALL)
        assert "must be connected again" in error
        assert "call request_credential" in error.lower() and "'acme'" in error
        assert (await credential(tools, connected.credential_id))["needs_reconnect"] is True
        listed = await tools.ok("get_organization_credentials", {"integration": "acme"})
        assert listed["credentials"][0]["needs_reconnect"] is True
        asked = server.refresh_requests
        again = await tools.failed("execute_integration_tool", CALL)
        assert "must be connected again" in again
        assert server.refresh_requests == asked  # a marked credential is not renewed again
        server.refuse = False
        reconnected = await connect(tools)
        assert reconnected.credential_id == connected.credential_id  # the same credential
        assert "needs_reconnect" not in await credential(tools, connected.credential_id)
        output = await tools.ok("execute_integration_tool", CALL)
        assert output["result"]["status"] == 200
        listed = await tools.ok("get_organization_credentials", {"integration": "acme"})
        assert listed["count"] == 1 and "needs_reconnect" not in listed["credentials"][0]
    assert_no_secret(server, logs, error, again, json.dumps(output))


@pytest.mark.parametrize("outage", ["closed", "503"])
async def test_a_token_endpoint_that_cannot_answer_marks_nothing(
    start_tools: StartTools, logs: pytest.LogCaptureFixture, outage: str
):
    server = AuthServer()
    async with serve_asgi(server.app()) as base:
        tools = await start_tools(tools_oauth2_integrations=provider_config(base))
        connected = await connect(tools)
        await wait_until_expired(server)
        if outage == "503":
            server.unavailable = True
            error = await tools.failed("execute_integration_tool", CALL)
    if outage == "closed":  # the server is stopped: nothing listens on its port
        error = await tools.failed("execute_integration_tool", CALL)
    assert "try again later" in error and "connected again" not in error
    assert "needs_reconnect" not in await credential(tools, connected.credential_id)
    assert_no_secret(server, logs, error)


async def test_without_pkce_and_with_authorize_params_the_flow_still_connects(
    start_tools: StartTools,
):
    server = AuthServer(pkce=False)
    async with serve_asgi(server.app()) as base:
        tools = await start_tools(
            tools_oauth2_integrations=provider_config(
                base,
                use_pkce=False,
                authorize_params={"access_type": "offline", "prompt": "consent"},
            )
        )
        started = await tools.stub.InitiateOAuth2(
            tools_pb2.InitiateOAuth2Request(
                organization_id=ORG, integration_name="acme", redirect_uri="http://127.0.0.1:1/cb"
            )
        )
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(started.authorization_url).query)
        assert "code_challenge" not in query and "code_challenge_method" not in query
        assert query["access_type"] == ["offline"] and query["prompt"] == ["consent"]
        assert query["scope"] == ["read write"] and query["client_id"] == [CLIENT_ID]
        connected = await connect(tools)  # the server refuses a code_verifier it did not expect
        assert connected.auth_type == "oauth2"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"token_endpoint_auth_method": "private_key_jwt"}, "token_endpoint_auth_method"),
        ({"client_secret": "", "token_endpoint_auth_method": "client_secret_basic"}, "needs"),
        ({"scope": "read", "scopes": ["read"]}, "not both"),
        ({"scopes": "read write"}, "list of scope names"),
        ({"authorize_params": {"state": "x"}}, "cannot set state"),
        ({"authorize_params": {"prompt": 1}}, "strings"),
        ({"use_pkce": "no"}, "use_pkce"),
    ],
)
def test_a_malformed_provider_is_refused_at_start(extra: dict[str, Any], message: str):
    with pytest.raises(ValueError, match=message):
        parse_providers(provider_config("http://auth.test", **extra))


def test_a_provider_without_a_client_secret_authenticates_with_its_client_id_alone():
    (provider,) = parse_providers(provider_config("http://auth.test", client_secret=""))
    assert provider.auth_method == "none" and provider.default_scope == "read write"
    built = OAuth2Provider(
        name="x",
        display_name="X",
        description="",
        authorize_url="http://auth.test/a",
        token_url="http://auth.test/t",
        client_id="c",
        client_secret="s",
    )
    assert built.auth_method == "client_secret_post" and built.use_pkce


async def test_two_replicas_on_postgresql_renew_one_credential_once(
    start_tools: StartTools, pg_database: str
):
    server = AuthServer(refresh_delay_s=0.3)
    async with serve_asgi(server.app()) as base:
        config = provider_config(base)
        replicas = [
            await start_tools(tools_database_url=pg_database, tools_oauth2_integrations=config)
            for _ in range(2)
        ]
        await connect(replicas[0])
        await wait_until_expired(server)
        outputs = await asyncio.gather(
            *(replicas[i % 2].ok("execute_integration_tool", CALL) for i in range(6))
        )
    assert [o["result"]["status"] for o in outputs] == [200] * 6
    assert server.refresh_requests == 1


async def test_through_the_gateway_a_turn_is_told_to_reconnect_and_the_sdk_sees_the_state(
    tmp_path, logs: pytest.LogCaptureFixture
):
    from modulex import Modulex

    from tests.orchestrator.helpers import run_turn
    from tests.tools.tools_stack import tools_stack

    server = AuthServer()
    async with (
        serve_asgi(server.app()) as base,
        tools_stack(tmp_path, tools={"tools_oauth2_integrations": provider_config(base)}) as stack,
        stack.client() as client,
    ):
        started = await client.post(
            "/credentials/oauth2/initiate",
            json={
                "integration_name": "acme",
                "redirect_uri": f"{stack.base_url}/credentials/oauth2/callback",
            },
        )
        async with httpx.AsyncClient() as browser:
            redirect = await browser.get(started.json()["authorization_url"])
            connected = await browser.get(redirect.headers["location"])
        assert connected.status_code == 200, connected.text
        server.refuse = True
        await wait_until_expired(server)
        _body, frames = await run_turn(
            client, {"tool": "execute_integration_tool", "input": CALL}, {"say": "ok"}
        )
        result = next(f["data"] for f in frames if f["type"] == "tool_result")
        assert "must be connected again" in json.dumps(result)
        assert "request_credential" in json.dumps(result)
        sdk = Modulex(api_key=stack.api_key, organization_id=stack.org_id, base_url=stack.base_url)
        try:
            listed = await sdk.credentials.list(integration_name="acme")
        finally:
            await sdk.close()
        (shown,) = listed["credentials"]
        assert shown["credentials_metadata"]["needs_reconnect"] is True
    assert_no_secret(server, logs, json.dumps(frames), json.dumps(listed))
