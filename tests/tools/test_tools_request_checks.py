"""The tools service checks its requests itself (fresh-eyes test calling it over gRPC, past the
gateway): bounded names, documented ranges, well-formed input_json, ids that can be ours, known
profiles. Each refusal is INVALID_ARGUMENT with an ErrorInfo (domain tools.loopline.dev) naming
the field, except an id that cannot be ours, which is NOT_FOUND like any unknown id."""

from __future__ import annotations

import grpc
import orjson
import pytest

from loopline.tools.v1 import tools_pb2
from services.common import pb
from services.common.errors import TOOLS_DOMAIN, status_details
from services.gateway.routes.fields import (
    MAX_SEARCH_BASES,
    MAX_TEXT_CHARS,
    OBJECT_LIMITS,
    STRING_LIMITS,
)
from services.tools import servicer as tools_server
from services.tools.request_checks import COUNT_LIMITS, JSON_LIMITS, TEXT_LIMITS

ORG = "org-a"


async def _refused(call, request, code=grpc.StatusCode.INVALID_ARGUMENT):
    """The parsed rich status of `call(request)`, which must fail with `code` in the tools
    domain."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(request)
    details = status_details(caught.value)
    assert details.code == code, details
    assert details.domain == TOOLS_DOMAIN, details
    return details


# ---- 1. names and descriptions are bounded as the gateway bounds them ----------------------


def test_text_limits_are_the_gateways():
    assert TEXT_LIMITS["display_name"] == STRING_LIMITS["display_name"] == 200
    assert TEXT_LIMITS["name"] == STRING_LIMITS["name"] == 200
    assert TEXT_LIMITS["description"] == STRING_LIMITS["description"] == 10_000
    assert (
        TEXT_LIMITS["document_name"] == 500
    )  # the gateway cuts an upload's file name to 500 characters
    assert TEXT_LIMITS["integration_name"] == STRING_LIMITS["integration_name"] == 100
    assert TEXT_LIMITS["auth_type"] == STRING_LIMITS["auth_type"] == 32
    for field in (
        "server_url",
        "redirect_uri",
        "scope",
        "query",
    ):  # the gateway's "any other string field"
        assert field not in STRING_LIMITS
        assert TEXT_LIMITS[field] == MAX_TEXT_CHARS == 2_048
    assert (
        JSON_LIMITS
        == OBJECT_LIMITS
        == {"metadata": 16 * 1024, "auth_data": 64 * 1024, "headers": 16 * 1024}
    )
    assert COUNT_LIMITS == {"knowledge_base_ids": MAX_SEARCH_BASES} == {"knowledge_base_ids": 100}


def _too_long(details, field, limit, length):
    assert details.reason == "FIELD_TOO_LONG"
    assert details.message == f"{field} must be at most {limit} characters (it has {length})"
    assert details.metadata == {"field": field, "limit": str(limit)}


async def test_create_credential_refuses_a_display_name_past_200_characters(tools):
    def request(display_name):
        return tools_pb2.CreateCredentialRequest(
            organization_id=ORG,
            integration_name="http",
            auth_type="bearer",
            auth_data=pb.to_struct({"token": "tok-1234567890ab"}),
            display_name=display_name,
        )

    _too_long(
        await _refused(tools.stub.CreateCredential, request("x" * 5000)), "display_name", 200, 5000
    )
    _too_long(
        await _refused(tools.stub.CreateCredential, request("é" * 201)), "display_name", 200, 201
    )
    created = await tools.stub.CreateCredential(
        request("é" * 200)
    )  # characters, not bytes, as the gateway counts
    assert created.credential.display_name == "é" * 200
    listed = await tools.stub.ListCredentials(tools_pb2.ListCredentialsRequest(organization_id=ORG))
    assert listed.total == 1  # nothing stored by the refused calls


async def test_create_knowledge_base_refuses_a_long_name_or_description(tools):
    call = tools.stub.CreateKnowledgeBase
    _too_long(
        await _refused(
            call, tools_pb2.CreateKnowledgeBaseRequest(organization_id=ORG, name="x" * 100_000)
        ),
        "name",
        200,
        100_000,
    )
    _too_long(
        await _refused(
            call,
            tools_pb2.CreateKnowledgeBaseRequest(
                organization_id=ORG, name="Docs", description="d" * 10_001
            ),
        ),
        "description",
        10_000,
        10_001,
    )
    base = await call(
        tools_pb2.CreateKnowledgeBaseRequest(
            organization_id=ORG, name="n" * 200, description="d" * 10_000
        )
    )
    assert base.knowledge_base.name == "n" * 200
    listed = await tools.stub.ListKnowledgeBases(
        tools_pb2.ListKnowledgeBasesRequest(organization_id=ORG)
    )
    assert len(listed.knowledge_bases) == 1


async def test_mcp_server_and_oauth2_display_names_are_bounded_too(tools):
    details = await _refused(
        tools.stub.CreateMcpServer,
        tools_pb2.CreateMcpServerRequest(
            organization_id=ORG, server_url="https://mcp.example.com/mcp", display_name="m" * 201
        ),
    )
    _too_long(details, "display_name", 200, 201)
    details = await _refused(
        tools.stub.InitiateOAuth2,
        tools_pb2.InitiateOAuth2Request(
            organization_id=ORG,
            integration_name="github",
            redirect_uri="https://app.example.com/cb",
            display_name="o" * 201,
        ),
    )
    _too_long(details, "display_name", 200, 201)


async def test_add_document_refuses_a_name_past_500_characters(tools):
    base = (
        await tools.stub.CreateKnowledgeBase(
            tools_pb2.CreateKnowledgeBaseRequest(organization_id=ORG, name="Docs")
        )
    ).knowledge_base
    details = await _refused(
        tools.stub.AddDocument,
        tools_pb2.AddDocumentRequest(
            organization_id=ORG,
            knowledge_base_id=base.knowledge_base_id,
            name="a" * 501 + ".txt",
            text="hello",
        ),
    )
    _too_long(details, "name", 500, 505)
    added = await tools.stub.AddDocument(
        tools_pb2.AddDocumentRequest(
            organization_id=ORG,
            knowledge_base_id=base.knowledge_base_id,
            name="a" * 496 + ".txt",
            text="hello",
        )
    )
    assert len(added.document.name) == 500


# ---- 2. SearchKnowledge top_k: 1 to 50, 0 means 5 (tools.proto) ----------------------------


@pytest.mark.parametrize("top_k", [-1, 51, 10**6, -(2**31)])
async def test_search_knowledge_refuses_top_k_outside_1_to_50(tools, top_k):
    details = await _refused(
        tools.stub.SearchKnowledge,
        tools_pb2.SearchKnowledgeRequest(organization_id=ORG, query="refund", top_k=top_k),
    )
    assert details.reason == "INVALID_TOP_K"
    assert details.message == f"top_k must be between 1 and 50 (0 means 5), not {top_k}"
    assert details.metadata == {"field": "top_k"}


async def test_search_knowledge_takes_top_k_1_to_50_and_0_as_5(tools):
    base = (
        await tools.stub.CreateKnowledgeBase(
            tools_pb2.CreateKnowledgeBaseRequest(organization_id=ORG, name="Docs")
        )
    ).knowledge_base
    text = "\n\n".join(
        f"Refund rule {i}: " + "refund " * 150 for i in range(60)
    )  # 60 chunks that all match
    await tools.stub.AddDocument(
        tools_pb2.AddDocumentRequest(
            organization_id=ORG, knowledge_base_id=base.knowledge_base_id, name="r.txt", text=text
        )
    )
    for top_k, expected in ((0, 5), (1, 1), (50, 50)):
        response = await tools.stub.SearchKnowledge(
            tools_pb2.SearchKnowledgeRequest(organization_id=ORG, query="refund", top_k=top_k)
        )
        assert len(response.results) == expected


# ---- 3. ListCredentials limit: 1 to 500, 0 means 100; offset >= 0 (tools.proto) -------------


@pytest.mark.parametrize("limit", [501, -1, 2**31 - 1, -(2**31)])
async def test_list_credentials_refuses_a_limit_outside_1_to_500(tools, limit):
    details = await _refused(
        tools.stub.ListCredentials,
        tools_pb2.ListCredentialsRequest(organization_id=ORG, limit=limit),
    )
    assert details.reason == "INVALID_LIMIT"
    assert details.message == f"limit must be between 1 and 500 (0 means 100), not {limit}"
    assert details.metadata == {"field": "limit"}


@pytest.mark.parametrize("offset", [-1, -(2**31)])
async def test_list_credentials_refuses_a_negative_offset(tools, offset):
    details = await _refused(
        tools.stub.ListCredentials,
        tools_pb2.ListCredentialsRequest(organization_id=ORG, offset=offset),
    )
    assert details.reason == "INVALID_OFFSET"
    assert details.message == f"offset must be >= 0, not {offset}"
    assert details.metadata == {"field": "offset"}


async def test_list_credentials_pages_with_limit_1_to_500_and_0_as_100(tools):
    for i in range(3):
        await tools.create_credential("http", {"token": f"tok-1234567890a{i}"}, auth_type="bearer")

    async def page(limit, offset=0):
        response = await tools.stub.ListCredentials(
            tools_pb2.ListCredentialsRequest(organization_id=ORG, limit=limit, offset=offset)
        )
        return len(response.credentials), response.total

    assert await page(0) == (3, 3)
    assert await page(1) == (1, 3)
    assert await page(500, offset=2) == (1, 3)
    assert await page(2, offset=2**31 - 1) == (0, 3)


# ---- 4. ExecuteTool input_json: when set, a JSON object (tools.proto) ------------------------


def _execute(input_json: bytes) -> tools_pb2.ExecuteToolRequest:
    return tools_pb2.ExecuteToolRequest(
        organization_id=ORG,
        tool="search_knowledge",
        input=pb.to_struct({}),
        input_json=input_json,
        run_id="run-1",
        tool_call_id="call-1",
    )


@pytest.mark.parametrize(
    ("input_json", "why"),
    [
        (b"{not json", "it is not valid JSON"),
        (b"\xff\xfe", "it is not valid JSON"),
        (b'{"query": "\xff"}', "it is not valid JSON"),  # not UTF-8
        (b"[" * 2000 + b"]" * 2000, "it is not valid JSON"),  # nested past what the parser takes
        (b'[{"query": "refund"}]', "it is an array"),
        (b"null", "it is null"),
        (b'"refund"', "it is a string"),
        (b"3", "it is a number"),
        (b"true", "it is a boolean"),
    ],
)
async def test_execute_tool_refuses_input_json_that_is_not_a_json_object(tools, input_json, why):
    details = await _refused(tools.stub.ExecuteTool, _execute(input_json))
    assert details.reason == "INVALID_INPUT_JSON"
    assert details.message == f"input_json must be a JSON object (UTF-8 JSON text): {why}"
    assert details.metadata == {"field": "input_json"}


async def test_execute_tool_takes_input_json_when_it_is_an_object_and_input_when_it_is_unset(tools):
    await tools.stub.CreateKnowledgeBase(
        tools_pb2.CreateKnowledgeBaseRequest(organization_id=ORG, name="Docs")
    )
    response = await tools.stub.ExecuteTool(_execute(b'{"query": "refund"}'))
    assert response.success, response.error
    assert pb.output_of(response)["query"] == "refund"
    response = await tools.stub.ExecuteTool(_execute(b""))  # unset: `input` ({} here) is the input
    assert not response.success and "'query' is required" in response.error


# ---- 5. an id that cannot be ours is NOT_FOUND, without a database query -------------------

# Ids are str(uuid.uuid4()): 36 characters, lower-case hexadecimal and hyphens.
NOT_OURS = [
    "\x00",
    "abc",
    "",
    "x" * 10_000,
    "1d5e0f5c-0b7e-4e8e-9b0e-3f1a2b3c4d5e\x00",
    "1D5E0F5C-0B7E-4E8E-9B0E-3F1A2B3C4D5E",
    "{1d5e0f5c-0b7e-4e8e-9b0e-3f1a2b3c4d5e}",
    "1d5e0f5c0b7e4e8e9b0e3f1a2b3c4d5e",
    "1d5e0f5c-0b7e-4e8e-9b0e-3f1a2b3c4d5e\n",
]


def _no_database(tools, monkeypatch):
    """Make any database session of the stores fail the test (it would show as INTERNAL)."""

    def refuse():
        raise AssertionError("the database was queried")

    monkeypatch.setattr(tools.server.servicer.credentials, "_sessions", refuse)
    monkeypatch.setattr(tools.server.servicer.knowledge, "_sessions", refuse)
    monkeypatch.setattr(tools.server.servicer.oauth, "_sessions", refuse)


def _credential_calls(tools, credential_id):
    stub = tools.stub
    return [
        (
            stub.GetCredential,
            tools_pb2.GetCredentialRequest(organization_id=ORG, credential_id=credential_id),
        ),
        (
            stub.DeleteCredential,
            tools_pb2.DeleteCredentialRequest(organization_id=ORG, credential_id=credential_id),
        ),
        (
            stub.SetDefaultCredential,
            tools_pb2.SetDefaultCredentialRequest(organization_id=ORG, credential_id=credential_id),
        ),
        (
            stub.RefreshMcpDiscovery,
            tools_pb2.RefreshMcpDiscoveryRequest(organization_id=ORG, credential_id=credential_id),
        ),
        (
            stub.ListMcpTools,
            tools_pb2.ListMcpToolsRequest(organization_id=ORG, credential_id=credential_id),
        ),
        (
            stub.ResolveCredentialSecret,
            tools_pb2.ResolveCredentialSecretRequest(
                organization_id=ORG, credential_id=credential_id, integration_name="openai"
            ),
        ),
    ]


@pytest.mark.parametrize("bad_id", NOT_OURS)
async def test_a_credential_id_that_cannot_be_ours_is_not_found_without_a_query(
    tools, monkeypatch, bad_id
):
    _no_database(tools, monkeypatch)
    for call, request in _credential_calls(tools, bad_id):
        details = await _refused(call, request, grpc.StatusCode.NOT_FOUND)
        assert details.reason == "CREDENTIAL_NOT_FOUND", (call, details)


@pytest.mark.parametrize("bad_id", NOT_OURS)
async def test_knowledge_ids_that_cannot_be_ours_are_not_found_without_a_query(
    tools, monkeypatch, bad_id
):
    good = "1d5e0f5c-0b7e-4e8e-9b0e-3f1a2b3c4d5e"
    _no_database(tools, monkeypatch)
    stub = tools.stub
    for kb, doc in ((bad_id, good), (good, bad_id)):
        details = await _refused(
            stub.GetDocument,
            tools_pb2.GetDocumentRequest(
                organization_id=ORG, knowledge_base_id=kb, document_id=doc
            ),
            grpc.StatusCode.NOT_FOUND,
        )
        assert details.reason == "DOCUMENT_NOT_FOUND"
    details = await _refused(
        stub.AddDocument,
        tools_pb2.AddDocumentRequest(
            organization_id=ORG, knowledge_base_id=bad_id, name="a.txt", text="hello"
        ),
        grpc.StatusCode.NOT_FOUND,
    )
    assert details.reason == "KNOWLEDGE_BASE_NOT_FOUND"
    # A search names knowledge bases as a filter: one that cannot be ours matches nothing
    # (tools.proto).
    response = await stub.SearchKnowledge(
        tools_pb2.SearchKnowledgeRequest(
            organization_id=ORG, query="refund", knowledge_base_ids=[bad_id]
        )
    )
    assert list(response.results) == []


async def test_a_search_filter_keeps_the_ids_that_can_be_ours(tools):
    base = (
        await tools.stub.CreateKnowledgeBase(
            tools_pb2.CreateKnowledgeBaseRequest(organization_id=ORG, name="Docs")
        )
    ).knowledge_base
    await tools.stub.AddDocument(
        tools_pb2.AddDocumentRequest(
            organization_id=ORG,
            knowledge_base_id=base.knowledge_base_id,
            name="r.txt",
            text="Refunds in 30 days.",
        )
    )
    response = await tools.stub.SearchKnowledge(
        tools_pb2.SearchKnowledgeRequest(
            organization_id=ORG, query="refund", knowledge_base_ids=["\x00", base.knowledge_base_id]
        )
    )
    assert [r.document_name for r in response.results] == ["r.txt"]


async def test_an_oauth2_state_that_cannot_be_ours_is_invalid_without_a_query(
    start_tools, monkeypatch
):
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
    tools = await start_tools(tools_oauth2_integrations=provider)

    def refuse():
        raise AssertionError("the database was queried")

    monkeypatch.setattr(tools.server.servicer.oauth, "_sessions", refuse)
    for state in ("\x00", "s" * 65, "state with spaces", "é" * 43):
        details = await _refused(
            tools.stub.CompleteOAuth2, tools_pb2.CompleteOAuth2Request(state=state, code="code-1")
        )
        assert details.reason == "OAUTH2_STATE_INVALID"


async def test_ids_with_nul_are_not_found_on_postgresql(start_tools, pg_database):
    tools = await start_tools(tools_database_url=pg_database)
    for call, request in _credential_calls(tools, "\x00"):
        details = await _refused(call, request, grpc.StatusCode.NOT_FOUND)
        assert details.reason == "CREDENTIAL_NOT_FOUND"
    details = await _refused(
        tools.stub.GetDocument,
        tools_pb2.GetDocumentRequest(
            organization_id=ORG, knowledge_base_id="\x00", document_id="\x00"
        ),
        grpc.StatusCode.NOT_FOUND,
    )
    assert details.reason == "DOCUMENT_NOT_FOUND"
    details = await _refused(
        tools.stub.CompleteOAuth2,
        tools_pb2.CompleteOAuth2Request(state="\x00", code="c"),
    )
    assert details.reason == "OAUTH2_STATE_INVALID"
    response = await tools.stub.SearchKnowledge(
        tools_pb2.SearchKnowledgeRequest(
            organization_id=ORG, query="refund", knowledge_base_ids=["\x00"]
        )
    )
    assert list(response.results) == []


# ---- 6. integration names, auth types, URLs, scopes and queries: the gateway's limits too ---

GOOD_ID = "1d5e0f5c-0b7e-4e8e-9b0e-3f1a2b3c4d5e"


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


def _no_network(tools, monkeypatch):
    """Make any outbound step of an MCP server's registration (URL policy, discovery) fail the
    test."""

    async def refuse(*_args, **_kwargs):
        raise AssertionError("the network was used")

    monkeypatch.setattr(tools_server, "check_url_policy", refuse)
    monkeypatch.setattr(tools.server.servicer.executor.mcp, "list_tools", refuse)


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
    _no_database(tools, monkeypatch)
    _no_network(tools, monkeypatch)
    for length, char in ((limit + 1, "x"), (limit + 1, "é"), (100_000, "x")):
        for call, request in _string_calls(tools.stub, field, _of_length(field, length, char)):
            details = await _refused(call, request)
            _too_long(details, field, limit, length)


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
        await _refused(*_string_calls(tools.stub, field, "x" * 5_000)[0])
    for field in ("integration_name", "redirect_uri", "scope"):
        await _refused(*_string_calls(tools.stub, field, _of_length(field, 5_000))[-1])
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


# ---- 7. metadata, auth_data and MCP headers: at most the gateway's bytes as compact JSON ----


def _too_large(details, field, limit, size):
    assert details.reason == "FIELD_TOO_LARGE"
    assert (
        details.message
        == f"{field} must be at most {limit} bytes when JSON-encoded (it has {size})"
    )
    assert details.metadata == {"field": field, "limit": str(limit)}


def _json_of_size(key, size, char="x"):
    """{key: "..."} of `char` (padded with "x") that is `size` bytes as compact UTF-8 JSON."""
    room = size - len(orjson.dumps({key: ""}))
    width = len(char.encode())
    value = {key: char * (room // width) + "x" * (room % width)}
    assert len(orjson.dumps(value)) == size
    return value


def _credential(auth_data=None, metadata=None):
    return tools_pb2.CreateCredentialRequest(
        organization_id=ORG,
        integration_name="http",
        auth_type="bearer",
        auth_data=pb.to_struct(auth_data or {"token": "tok-1234567890ab"}),
        metadata=pb.to_struct(metadata or {}),
    )


@pytest.mark.parametrize(("field", "limit"), [("metadata", 16 * 1024), ("auth_data", 64 * 1024)])
async def test_create_credential_refuses_metadata_or_auth_data_past_the_gateways_size(
    tools, monkeypatch, field, limit
):
    _no_database(tools, monkeypatch)
    key = "token" if field == "auth_data" else "note"
    for size, char in ((limit + 2, "é"), (limit + 1, "x"), (1_000_000, "x")):
        value = _json_of_size(key, size, char)
        details = await _refused(tools.stub.CreateCredential, _credential(**{field: value}))
        _too_large(details, field, limit, size)


async def test_metadata_and_auth_data_at_the_limit_are_stored(tools):
    metadata = _json_of_size("note", 16 * 1024, "é")
    created = await tools.stub.CreateCredential(
        _credential(auth_data=_json_of_size("token", 64 * 1024), metadata=metadata)
    )
    assert pb.from_struct(created.credential.metadata) == metadata
    listed = await tools.stub.ListCredentials(tools_pb2.ListCredentialsRequest(organization_id=ORG))
    assert listed.total == 1


async def test_create_mcp_server_refuses_headers_past_16_kib_before_any_network(tools, monkeypatch):
    _no_database(tools, monkeypatch)
    _no_network(tools, monkeypatch)
    headers = _json_of_size("Authorization", 16 * 1024 + 1)
    details = await _refused(
        tools.stub.CreateMcpServer,
        tools_pb2.CreateMcpServerRequest(
            organization_id=ORG,
            server_url="https://mcp.example.com/mcp",
            headers=pb.to_struct(headers),
        ),
    )
    _too_large(details, "headers", 16 * 1024, 16 * 1024 + 1)


# ---- 8. a search names at most 100 knowledge bases (the gateway's MAX_SEARCH_BASES) ----------


@pytest.mark.parametrize("count", [101, 10_000])
async def test_search_knowledge_refuses_more_than_100_knowledge_base_ids_without_a_query(
    tools, monkeypatch, count
):
    _no_database(tools, monkeypatch)
    ids = [GOOD_ID] * count  # counted as sent, duplicates too, as the gateway counts them
    details = await _refused(
        tools.stub.SearchKnowledge,
        tools_pb2.SearchKnowledgeRequest(
            organization_id=ORG, query="refund", knowledge_base_ids=ids
        ),
    )
    assert details.reason == "TOO_MANY_KNOWLEDGE_BASE_IDS"
    assert (
        details.message
        == f"knowledge_base_ids must name at most 100 knowledge bases (it names {count})"
    )
    assert details.metadata == {"field": "knowledge_base_ids", "limit": "100"}


async def test_search_knowledge_takes_100_knowledge_base_ids(tools):
    base = (
        await tools.stub.CreateKnowledgeBase(
            tools_pb2.CreateKnowledgeBaseRequest(organization_id=ORG, name="Docs")
        )
    ).knowledge_base
    await tools.stub.AddDocument(
        tools_pb2.AddDocumentRequest(
            organization_id=ORG,
            knowledge_base_id=base.knowledge_base_id,
            name="r.txt",
            text="Refunds in 30 days.",
        )
    )
    ids = [base.knowledge_base_id] + [GOOD_ID] * 99
    response = await tools.stub.SearchKnowledge(
        tools_pb2.SearchKnowledgeRequest(
            organization_id=ORG, query="refund", knowledge_base_ids=ids
        )
    )
    assert [r.document_name for r in response.results] == ["r.txt"]


@pytest.mark.parametrize("headers", [{"Bad Header": "v"}, {"X-A": "a\r\nB: c"}, {"X-A": "café"}])
async def test_create_mcp_server_refuses_headers_http_cannot_carry_before_any_network(
    tools, monkeypatch, headers
):
    _no_database(tools, monkeypatch)
    _no_network(tools, monkeypatch)
    details = await _refused(
        tools.stub.CreateMcpServer,
        tools_pb2.CreateMcpServerRequest(
            organization_id=ORG,
            server_url="https://mcp.example.com/mcp",
            headers=pb.to_struct(headers),
        ),
    )
    assert details.reason == "INVALID_HEADERS" and "RFC 9110" in details.message
