"""An id that cannot be one of ours (wrong shape, NUL, too long) is NOT_FOUND like any unknown
id, answered without a database query; an OAuth2 state that cannot be ours is INVALID_ARGUMENT."""

from __future__ import annotations

import grpc
import pytest

from loopline.tools.v1 import tools_pb2
from tests.tools.refusals import no_database, refused

ORG = "org-a"

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


def _credential_calls(tools_service, credential_id):
    stub = tools_service.stub
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
    tools_service, monkeypatch, bad_id
):
    no_database(tools_service, monkeypatch)
    for call, request in _credential_calls(tools_service, bad_id):
        details = await refused(call, request, grpc.StatusCode.NOT_FOUND)
        assert details.reason == "CREDENTIAL_NOT_FOUND", (call, details)


@pytest.mark.parametrize("bad_id", NOT_OURS)
async def test_knowledge_ids_that_cannot_be_ours_are_not_found_without_a_query(
    tools_service, monkeypatch, bad_id
):
    good = "1d5e0f5c-0b7e-4e8e-9b0e-3f1a2b3c4d5e"
    no_database(tools_service, monkeypatch)
    stub = tools_service.stub
    for kb, doc in ((bad_id, good), (good, bad_id)):
        details = await refused(
            stub.GetDocument,
            tools_pb2.GetDocumentRequest(
                organization_id=ORG, knowledge_base_id=kb, document_id=doc
            ),
            grpc.StatusCode.NOT_FOUND,
        )
        assert details.reason == "DOCUMENT_NOT_FOUND"
    details = await refused(
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


async def test_a_search_filter_keeps_the_ids_that_can_be_ours(tools_service):
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
    response = await tools_service.stub.SearchKnowledge(
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
        details = await refused(
            tools.stub.CompleteOAuth2, tools_pb2.CompleteOAuth2Request(state=state, code="code-1")
        )
        assert details.reason == "OAUTH2_STATE_INVALID"


async def test_ids_with_nul_are_not_found_on_postgresql(start_tools, pg_database):
    tools = await start_tools(tools_database_url=pg_database)
    for call, request in _credential_calls(tools, "\x00"):
        details = await refused(call, request, grpc.StatusCode.NOT_FOUND)
        assert details.reason == "CREDENTIAL_NOT_FOUND"
    details = await refused(
        tools.stub.GetDocument,
        tools_pb2.GetDocumentRequest(
            organization_id=ORG, knowledge_base_id="\x00", document_id="\x00"
        ),
        grpc.StatusCode.NOT_FOUND,
    )
    assert details.reason == "DOCUMENT_NOT_FOUND"
    details = await refused(
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
