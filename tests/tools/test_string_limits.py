"""Integration names, auth types, URLs, scopes and queries: every RPC of the tools service
refuses a string past the gateway's limit with INVALID_ARGUMENT before any work, and stores
nothing."""

from __future__ import annotations

import grpc
import pytest

from loopline.tools.v1 import tools_pb2
from services.common import pb
from services.common.errors import status_details
from services.tools import servicer as tools_server
from tests.tools.refusals import GOOD_ID, no_database, no_network, refused, too_long

ORG = "org-a"


def _string_calls(stub, field, value):
    """(call, request) of every RPC carrying the string field `field`, set to `value` (the other
    fields valid)."""
    credential = {
        "organization_id": ORG,
        "integration_name": "http",
        "auth_type": "bearer",
        "auth_data": pb.to_struct({"token": "tok-1234567890ab"}),
    }
    oauth = {
        "organization_id": ORG,
        "integration_name": "acme",
        "redirect_uri": "https://app.example.com/cb",
    }
    if field == "integration_name":
        return [
            (
                stub.CreateCredential,
                tools_pb2.CreateCredentialRequest(**{**credential, field: value}),
            ),
            (
                stub.ListCredentials,
                tools_pb2.ListCredentialsRequest(organization_id=ORG, integration_name=value),
            ),
            (
                stub.ResolveCredentialSecret,
                tools_pb2.ResolveCredentialSecretRequest(
                    organization_id=ORG, credential_id=GOOD_ID, integration_name=value
                ),
            ),
            (stub.InitiateOAuth2, tools_pb2.InitiateOAuth2Request(**{**oauth, field: value})),
        ]
    if field == "auth_type":
        return [
            (
                stub.CreateCredential,
                tools_pb2.CreateCredentialRequest(**{**credential, field: value}),
            ),
            (
                stub.ListCredentials,
                tools_pb2.ListCredentialsRequest(organization_id=ORG, auth_type=value),
            ),
        ]
    if field == "server_url":
        return [
            (
                stub.CreateMcpServer,
                tools_pb2.CreateMcpServerRequest(organization_id=ORG, server_url=value),
            )
        ]
    if field in ("redirect_uri", "scope"):
        return [(stub.InitiateOAuth2, tools_pb2.InitiateOAuth2Request(**{**oauth, field: value}))]
    assert field == "query", field
    return [
        (stub.SearchKnowledge, tools_pb2.SearchKnowledgeRequest(organization_id=ORG, query=value))
    ]


def _of_length(field, length, char="x"):
    """A value of `field` with `length` characters (a URL for the URL fields)."""
    prefix = "https://app.example.com/" if field in ("server_url", "redirect_uri") else ""
    return prefix + char * (length - len(prefix))


async def _acme(start_tools):
    """A tools server with one OAuth2 integration, `acme`."""
    import json

    provider = json.dumps(
        [
            {
                "name": "acme",
                "authorize_url": "https://auth.example/authorize",
                "token_url": "https://auth.example/token",
                "client_id": "loopline-client",
                "api_base_url": "https://api.example",
            }
        ]
    )
    return await start_tools(tools_oauth2_integrations=provider)


@pytest.mark.parametrize(
    ("field", "limit"),
    [
        ("integration_name", 100),
        ("auth_type", 32),
        ("server_url", 2_048),
        ("redirect_uri", 2_048),
        ("scope", 2_048),
        ("query", 2_048),
    ],
)
async def test_every_rpc_refuses_a_string_past_the_gateways_limit_before_any_work(
    start_tools, monkeypatch, field, limit
):
    tools = await _acme(start_tools)
    no_database(tools, monkeypatch)
    no_network(tools, monkeypatch)
    for length, char in ((limit + 1, "x"), (limit + 1, "é"), (100_000, "x")):
        for call, request in _string_calls(tools.stub, field, _of_length(field, length, char)):
            details = await refused(call, request)
            too_long(details, field, limit, length)


@pytest.mark.parametrize(
    ("field", "limit"),
    [
        ("integration_name", 100),
        ("auth_type", 32),
        ("server_url", 2_048),
        ("redirect_uri", 2_048),
        ("scope", 2_048),
        ("query", 2_048),
    ],
)
async def test_a_string_at_the_limit_passes_the_length_check(
    start_tools, monkeypatch, field, limit
):
    tools = await _acme(start_tools)

    async def stop(
        *_args, **_kwargs
    ):  # a server_url at the limit goes on to the URL policy: stop there, offline
        raise tools_server.ActionError("no network in this test")

    monkeypatch.setattr(tools_server, "check_url_policy", stop)
    for call, request in _string_calls(tools.stub, field, _of_length(field, limit, "é")):
        try:
            await call(request)
        except (
            grpc.aio.AioRpcError
        ) as error:  # refused for another reason (an unknown integration, ...), not its length
            details = status_details(error)
            assert details.code != grpc.StatusCode.INTERNAL, details
            assert details.reason != "FIELD_TOO_LONG", details


async def test_refused_strings_store_nothing(start_tools):
    tools = await _acme(start_tools)
    for field in ("integration_name", "auth_type"):
        await refused(*_string_calls(tools.stub, field, "x" * 5_000)[0])
    for field in ("integration_name", "redirect_uri", "scope"):
        await refused(*_string_calls(tools.stub, field, _of_length(field, 5_000))[-1])
    listed = await tools.stub.ListCredentials(tools_pb2.ListCredentialsRequest(organization_id=ORG))
    assert listed.total == 0
    async with tools.server.servicer.oauth._sessions() as session:
        from sqlalchemy import func, select

        from services.tools.models import OAuthState

        assert (
            await session.execute(select(func.count()).select_from(OAuthState))
        ).scalar_one() == 0


async def test_the_gateways_credential_list_refuses_a_long_integration_name_filter(tmp_path):
    from tests.tools.tools_stack import tools_stack

    async with tools_stack(tmp_path) as stack, stack.client() as client:
        refused = await client.get("/credentials", params={"integration_name": "x" * 101})
        assert refused.status_code == 400, refused.text
        assert refused.json() == {
            "detail": "integration_name must be at most 100 characters (it has 101)"
        }
        listed = await client.get("/credentials", params={"integration_name": "x" * 100})
        assert listed.status_code == 200 and listed.json()["credentials"] == []
