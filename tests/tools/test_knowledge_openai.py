"""A knowledge base embedded by an OpenAI-compatible API with the organization's key, through
the tools service: indexing and queries call the API at LOOPLINE_EMBEDDING_OPENAI_BASE_URL with
the credential's key, and a refused key fails the document with a known reason."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from loopline.tools.v1 import tools_pb2
from tests.tools.test_embeddings import fake_api  # noqa: F401 - the fixture

KEY = "sk-org-embeddings-0123456789"


async def _ready(tools, kb: str, document_id: str) -> tools_pb2.Document:
    for _ in range(200):
        document = (
            await tools.stub.GetDocument(
                tools_pb2.GetDocumentRequest(
                    organization_id="org-a", knowledge_base_id=kb, document_id=document_id
                )
            )
        ).document
        if document.status != "processing":
            return document
        await asyncio.sleep(0.05)
    raise AssertionError("the document was never embedded")


async def _openai_base(tools, credential_id: str) -> str:
    response = await tools.stub.CreateKnowledgeBase(
        tools_pb2.CreateKnowledgeBaseRequest(
            organization_id="org-a",
            name="Remote",
            embedding=tools_pb2.EmbeddingConfig(
                provider="openai", model="text-embedding-3-small", credential_id=credential_id
            ),
        )
    )
    return response.knowledge_base.knowledge_base_id


async def test_an_openai_knowledge_base_is_embedded_and_searched_with_the_orgs_key(
    start_tools,
    fake_api,  # noqa: F811
):
    url, handler = fake_api
    tools = await start_tools(embedding_openai_base_url=url)
    credential = await tools.create_credential("openai", {"api_key": KEY})
    kb = await _openai_base(tools, credential.credential_id)
    added = await tools.stub.AddDocument(
        tools_pb2.AddDocumentRequest(
            organization_id="org-a", knowledge_base_id=kb, name="a.md", text="Refunds in 30 days."
        )
    )
    assert (await _ready(tools, kb, added.document.document_id)).status == "ready"
    assert handler.seen[0]["model"] == "text-embedding-3-small"
    assert handler.seen[0]["authorization"] == f"Bearer {KEY}"
    found = await tools.stub.SearchKnowledge(
        tools_pb2.SearchKnowledgeRequest(
            organization_id="org-a", query="refunds", mode=tools_pb2.SEARCH_MODE_SEMANTIC
        )
    )
    assert [r.document_name for r in found.results] == ["a.md"]
    assert 0 < found.results[0].semantic_score <= 1
    assert handler.seen[-1]["input"] == ["refunds"]  # the query, embedded by the same API


async def test_a_refused_key_fails_the_document_and_semantic_search_says_why(
    start_tools,
    fake_api,  # noqa: F811
):
    url, handler = fake_api
    tools = await start_tools(embedding_openai_base_url=url)
    credential = await tools.create_credential("openai", {"api_key": KEY})
    kb = await _openai_base(tools, credential.credential_id)
    handler.mode = "401"
    added = await tools.stub.AddDocument(
        tools_pb2.AddDocumentRequest(
            organization_id="org-a", knowledge_base_id=kb, name="a.md", text="Refunds in 30 days."
        )
    )
    failed = await _ready(tools, kb, added.document.document_id)
    assert failed.status == "failed"
    assert failed.error_message == "the embeddings API refused the key (401)"
    hybrid = await tools.stub.SearchKnowledge(
        tools_pb2.SearchKnowledgeRequest(organization_id="org-a", query="refunds")
    )
    assert [r.document_name for r in hybrid.results] == ["a.md"]  # keywords still rank it
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await tools.stub.SearchKnowledge(
            tools_pb2.SearchKnowledgeRequest(
                organization_id="org-a", query="refunds", mode=tools_pb2.SEARCH_MODE_SEMANTIC
            )
        )
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "refused the key (401)" in (refused.value.details() or "")
    assert KEY not in (refused.value.details() or "")
    # the assistant's tool says why, as a failed result (not an internal error)
    error = await tools.failed("search_knowledge", {"query": "refunds", "mode": "semantic"})
    assert "refused the key (401)" in error and KEY not in error
