"""The tools service checks its requests itself (a caller may reach it over gRPC, past the
gateway): bounded names, documented ranges, well-formed input_json, ids that can be ours, known
profiles. Each refusal is INVALID_ARGUMENT with an ErrorInfo (domain tools.loopline.dev) naming
the field, except an id that cannot be ours, which is NOT_FOUND like any unknown id."""

from __future__ import annotations

import orjson
import pytest

from loopline.tools.v1 import tools_pb2
from services.common import pb
from services.gateway.routes.fields import (
    MAX_SEARCH_BASES,
    MAX_TEXT_CHARS,
    OBJECT_LIMITS,
    STRING_LIMITS,
)
from services.tools.request_checks import COUNT_LIMITS, JSON_LIMITS, TEXT_LIMITS
from tests.tools.refusals import GOOD_ID, no_database, no_network, refused, too_long

ORG = "org-a"


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


async def test_create_credential_refuses_a_display_name_past_200_characters(tools_service):
    def request(display_name):
        return tools_pb2.CreateCredentialRequest(
            organization_id=ORG,
            integration_name="http",
            auth_type="bearer",
            auth_data=pb.to_struct({"token": "tok-1234567890ab"}),
            display_name=display_name,
        )

    too_long(
        await refused(tools_service.stub.CreateCredential, request("x" * 5000)),
        "display_name",
        200,
        5000,
    )
    too_long(
        await refused(tools_service.stub.CreateCredential, request("é" * 201)),
        "display_name",
        200,
        201,
    )
    created = await tools_service.stub.CreateCredential(
        request("é" * 200)
    )  # characters, not bytes, as the gateway counts
    assert created.credential.display_name == "é" * 200
    listed = await tools_service.stub.ListCredentials(
        tools_pb2.ListCredentialsRequest(organization_id=ORG)
    )
    assert listed.total == 1  # nothing stored by the refused calls


async def test_create_knowledge_base_refuses_a_long_name_or_description(tools_service):
    call = tools_service.stub.CreateKnowledgeBase
    too_long(
        await refused(
            call, tools_pb2.CreateKnowledgeBaseRequest(organization_id=ORG, name="x" * 100_000)
        ),
        "name",
        200,
        100_000,
    )
    too_long(
        await refused(
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
    listed = await tools_service.stub.ListKnowledgeBases(
        tools_pb2.ListKnowledgeBasesRequest(organization_id=ORG)
    )
    assert len(listed.knowledge_bases) == 1


async def test_mcp_server_and_oauth2_display_names_are_bounded_too(tools_service):
    details = await refused(
        tools_service.stub.CreateMcpServer,
        tools_pb2.CreateMcpServerRequest(
            organization_id=ORG, server_url="https://mcp.example.com/mcp", display_name="m" * 201
        ),
    )
    too_long(details, "display_name", 200, 201)
    details = await refused(
        tools_service.stub.InitiateOAuth2,
        tools_pb2.InitiateOAuth2Request(
            organization_id=ORG,
            integration_name="github",
            redirect_uri="https://app.example.com/cb",
            display_name="o" * 201,
        ),
    )
    too_long(details, "display_name", 200, 201)


async def test_add_document_refuses_a_name_past_500_characters(tools_service):
    base = (
        await tools_service.stub.CreateKnowledgeBase(
            tools_pb2.CreateKnowledgeBaseRequest(organization_id=ORG, name="Docs")
        )
    ).knowledge_base
    details = await refused(
        tools_service.stub.AddDocument,
        tools_pb2.AddDocumentRequest(
            organization_id=ORG,
            knowledge_base_id=base.knowledge_base_id,
            name="a" * 501 + ".txt",
            text="hello",
        ),
    )
    too_long(details, "name", 500, 505)
    added = await tools_service.stub.AddDocument(
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
async def test_search_knowledge_refuses_top_k_outside_1_to_50(tools_service, top_k):
    details = await refused(
        tools_service.stub.SearchKnowledge,
        tools_pb2.SearchKnowledgeRequest(organization_id=ORG, query="refund", top_k=top_k),
    )
    assert details.reason == "INVALID_TOP_K"
    assert details.message == f"top_k must be between 1 and 50 (0 means 5), not {top_k}"
    assert details.metadata == {"field": "top_k"}


async def test_search_knowledge_takes_top_k_1_to_50_and_0_as_5(tools_service):
    base = (
        await tools_service.stub.CreateKnowledgeBase(
            tools_pb2.CreateKnowledgeBaseRequest(organization_id=ORG, name="Docs")
        )
    ).knowledge_base
    text = "\n\n".join(
        f"Refund rule {i}: " + "refund " * 150 for i in range(60)
    )  # 60 chunks that all match
    await tools_service.stub.AddDocument(
        tools_pb2.AddDocumentRequest(
            organization_id=ORG, knowledge_base_id=base.knowledge_base_id, name="r.txt", text=text
        )
    )
    for top_k, expected in ((0, 5), (1, 1), (50, 50)):
        response = await tools_service.stub.SearchKnowledge(
            tools_pb2.SearchKnowledgeRequest(organization_id=ORG, query="refund", top_k=top_k)
        )
        assert len(response.results) == expected


# ---- 3. ListCredentials limit: 1 to 500, 0 means 100; offset >= 0 (tools.proto) -------------


@pytest.mark.parametrize("limit", [501, -1, 2**31 - 1, -(2**31)])
async def test_list_credentials_refuses_a_limit_outside_1_to_500(tools_service, limit):
    details = await refused(
        tools_service.stub.ListCredentials,
        tools_pb2.ListCredentialsRequest(organization_id=ORG, limit=limit),
    )
    assert details.reason == "INVALID_LIMIT"
    assert details.message == f"limit must be between 1 and 500 (0 means 100), not {limit}"
    assert details.metadata == {"field": "limit"}


@pytest.mark.parametrize("offset", [-1, -(2**31)])
async def test_list_credentials_refuses_a_negative_offset(tools_service, offset):
    details = await refused(
        tools_service.stub.ListCredentials,
        tools_pb2.ListCredentialsRequest(organization_id=ORG, offset=offset),
    )
    assert details.reason == "INVALID_OFFSET"
    assert details.message == f"offset must be >= 0, not {offset}"
    assert details.metadata == {"field": "offset"}


async def test_list_credentials_pages_with_limit_1_to_500_and_0_as_100(tools_service):
    for i in range(3):
        await tools_service.create_credential(
            "http", {"token": f"tok-1234567890a{i}"}, auth_type="bearer"
        )

    async def page(limit, offset=0):
        response = await tools_service.stub.ListCredentials(
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
async def test_execute_tool_refuses_input_json_that_is_not_a_json_object(
    tools_service, input_json, why
):
    details = await refused(tools_service.stub.ExecuteTool, _execute(input_json))
    assert details.reason == "INVALID_INPUT_JSON"
    assert details.message == f"input_json must be a JSON object (UTF-8 JSON text): {why}"
    assert details.metadata == {"field": "input_json"}


async def test_execute_tool_takes_input_json_when_it_is_an_object_and_input_when_it_is_unset(
    tools_service,
):
    await tools_service.stub.CreateKnowledgeBase(
        tools_pb2.CreateKnowledgeBaseRequest(organization_id=ORG, name="Docs")
    )
    response = await tools_service.stub.ExecuteTool(_execute(b'{"query": "refund"}'))
    assert response.success, response.error
    assert pb.output_of(response)["query"] == "refund"
    response = await tools_service.stub.ExecuteTool(
        _execute(b"")
    )  # unset: `input` ({} here) is the input
    assert not response.success and "'query' is required" in response.error


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
    tools_service, monkeypatch, field, limit
):
    no_database(tools_service, monkeypatch)
    key = "token" if field == "auth_data" else "note"
    for size, char in ((limit + 2, "é"), (limit + 1, "x"), (1_000_000, "x")):
        value = _json_of_size(key, size, char)
        details = await refused(tools_service.stub.CreateCredential, _credential(**{field: value}))
        _too_large(details, field, limit, size)


async def test_metadata_and_auth_data_at_the_limit_are_stored(tools_service):
    metadata = _json_of_size("note", 16 * 1024, "é")
    created = await tools_service.stub.CreateCredential(
        _credential(auth_data=_json_of_size("token", 64 * 1024), metadata=metadata)
    )
    assert pb.from_struct(created.credential.metadata) == metadata
    listed = await tools_service.stub.ListCredentials(
        tools_pb2.ListCredentialsRequest(organization_id=ORG)
    )
    assert listed.total == 1


async def test_create_mcp_server_refuses_headers_past_16_kib_before_any_network(
    tools_service, monkeypatch
):
    no_database(tools_service, monkeypatch)
    no_network(tools_service, monkeypatch)
    headers = _json_of_size("Authorization", 16 * 1024 + 1)
    details = await refused(
        tools_service.stub.CreateMcpServer,
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
    tools_service, monkeypatch, count
):
    no_database(tools_service, monkeypatch)
    ids = [GOOD_ID] * count  # counted as sent, duplicates too, as the gateway counts them
    details = await refused(
        tools_service.stub.SearchKnowledge,
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


async def test_search_knowledge_takes_100_knowledge_base_ids(tools_service):
    base = (
        await tools_service.stub.CreateKnowledgeBase(
            tools_pb2.CreateKnowledgeBaseRequest(organization_id=ORG, name="Docs")
        )
    ).knowledge_base
    await tools_service.stub.AddDocument(
        tools_pb2.AddDocumentRequest(
            organization_id=ORG,
            knowledge_base_id=base.knowledge_base_id,
            name="r.txt",
            text="Refunds in 30 days.",
        )
    )
    ids = [base.knowledge_base_id] + [GOOD_ID] * 99
    response = await tools_service.stub.SearchKnowledge(
        tools_pb2.SearchKnowledgeRequest(
            organization_id=ORG, query="refund", knowledge_base_ids=ids
        )
    )
    assert [r.document_name for r in response.results] == ["r.txt"]


@pytest.mark.parametrize("headers", [{"Bad Header": "v"}, {"X-A": "a\r\nB: c"}, {"X-A": "café"}])
async def test_create_mcp_server_refuses_headers_http_cannot_carry_before_any_network(
    tools_service, monkeypatch, headers
):
    no_database(tools_service, monkeypatch)
    no_network(tools_service, monkeypatch)
    details = await refused(
        tools_service.stub.CreateMcpServer,
        tools_pb2.CreateMcpServerRequest(
            organization_id=ORG,
            server_url="https://mcp.example.com/mcp",
            headers=pb.to_struct(headers),
        ),
    )
    assert details.reason == "INVALID_HEADERS" and "RFC 9110" in details.message
