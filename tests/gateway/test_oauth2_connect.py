"""Connecting an integration with OAuth2 (authorization code with PKCE S256) against a local
authorization server: the credential it stores, the paused run it resumes, the API calls made
with its token, and the refusals of forged, spent, denied or unreachable exchanges.
"""

from __future__ import annotations

import base64
import hashlib
import json
import urllib.parse
import uuid
from typing import Any

import httpx
from modulex import Modulex

from tests.orchestrator.helpers import run_turn
from tests.sse_client import read_frames
from tests.tools.tools_stack import serve_asgi, tools_stack


def acme_provider(auth_base: str) -> dict[str, Any]:
    """The OAuth2 integration `acme` as the operator configures it, on `oauth_server_app`."""
    return {
        "name": "acme",
        "display_name": "Acme",
        "authorize_url": f"{auth_base}/authorize",
        "token_url": f"{auth_base}/token",
        "client_id": "loopline-client",
        "client_secret": "client-secret",
        "scope": "read",
        "api_base_url": f"{auth_base}/api",
    }


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
                acme_provider(auth_base),
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
            # initiate_oauth2 always sets it
            query = urllib.parse.parse_qs(urllib.parse.urlsplit(started.authorization_url).query)  # type: ignore[type-var]
            assert query["code_challenge_method"] == ["S256"] and query["state"] == [started.state]
            assert query["client_id"] == ["loopline-client"] and query["redirect_uri"] == [callback]
            async with httpx.AsyncClient() as browser:
                # initiate_oauth2 always sets it
                redirect = await browser.get(started.authorization_url)  # type: ignore[arg-type]
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
