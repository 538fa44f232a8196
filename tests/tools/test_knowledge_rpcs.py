"""The knowledge RPCs of the tools service (knowledge_rpcs.py) and the search_knowledge tool's
modes: listing and deleting documents and knowledge bases, the embedding model of a knowledge
base, search modes, weights and min_score, each request checked before the store is asked.

The server is the real one (SQLite, the local embedding model); a test that needs semantic
scores waits for its documents to be embedded (`_ready`).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from loopline.tools.v1 import tools_pb2
from services.common import pb
from tests.tools.refusals import GOOD_ID, no_database, refused

ORG, OTHER = "org-a", "org-b"

REFUNDS = """# Refund policy

Customers can ask for a refund within 30 days of purchase. Refunds go back to the original card."""
SHIPPING = "Orders ship within two business days from the Lyon warehouse."
HOLIDAYS = "The office is closed on public holidays. Staff take leave through the HR portal."


async def _base(tools, org=ORG, name="Support", **kwargs):
    response = await tools.stub.CreateKnowledgeBase(
        tools_pb2.CreateKnowledgeBaseRequest(organization_id=org, name=name, **kwargs)
    )
    return response.knowledge_base


async def _doc(tools, kb, name, text, org=ORG):
    response = await tools.stub.AddDocument(
        tools_pb2.AddDocumentRequest(
            organization_id=org, knowledge_base_id=kb, name=name, text=text
        )
    )
    return response.document


async def _documents(tools, kb, org=ORG, **kwargs):
    response = await tools.stub.ListDocuments(
        tools_pb2.ListDocumentsRequest(organization_id=org, knowledge_base_id=kb, **kwargs)
    )
    return list(response.documents)


async def _ready(tools, kb, org=ORG, timeout=120.0):
    """The knowledge base's documents once none is "processing" (embedded or failed)."""
    deadline = time.monotonic() + timeout
    while True:
        documents = await _documents(tools, kb, org)
        if all(d.status != "processing" for d in documents):
            return documents
        assert time.monotonic() < deadline, [(d.name, d.status) for d in documents]
        await asyncio.sleep(0.1)


async def _search(tools, query, org=ORG, **kwargs):
    response = await tools.stub.SearchKnowledge(
        tools_pb2.SearchKnowledgeRequest(organization_id=org, query=query, **kwargs)
    )
    return list(response.results)


# ---- documents: list and delete --------------------------------------------------------------


async def test_list_documents_pages_newest_first_and_is_scoped_to_the_organization(
    tools_service,
):
    kb = (await _base(tools_service)).knowledge_base_id
    added = [await _doc(tools_service, kb, f"doc{i}.txt", f"text number {i}") for i in range(5)]
    listed = await _documents(tools_service, kb)
    assert [d.document_id for d in listed] == [d.document_id for d in reversed(added)]
    assert listed[0].name == "doc4.txt" and listed[0].chunk_count == 1
    page = await _documents(tools_service, kb, limit=2, offset=1)
    assert [d.name for d in page] == ["doc3.txt", "doc2.txt"]
    assert await _documents(tools_service, kb, offset=5) == []
    # another organization's knowledge base, or one that does not exist: NOT_FOUND
    for org, base in ((OTHER, kb), (ORG, GOOD_ID), (ORG, "not-an-id")):
        details = await refused(
            tools_service.stub.ListDocuments,
            tools_pb2.ListDocumentsRequest(organization_id=org, knowledge_base_id=base),
            grpc.StatusCode.NOT_FOUND,
        )
        assert details.reason == "KNOWLEDGE_BASE_NOT_FOUND"


@pytest.mark.parametrize(
    "fields, reason",
    [
        ({"limit": 501}, "INVALID_LIMIT"),
        ({"limit": -1}, "INVALID_LIMIT"),
        ({"offset": -1}, "INVALID_OFFSET"),
    ],
)
async def test_list_documents_refuses_a_page_out_of_range_before_any_query(
    tools_service, monkeypatch, fields, reason
):
    no_database(tools_service, monkeypatch)
    details = await refused(
        tools_service.stub.ListDocuments,
        tools_pb2.ListDocumentsRequest(organization_id=ORG, knowledge_base_id=GOOD_ID, **fields),
    )
    assert details.reason == reason
    assert details.metadata["field"] == next(iter(fields))


async def test_a_deleted_document_is_gone_from_listing_search_and_lookup(tools_service):
    kb = (await _base(tools_service)).knowledge_base_id
    refunds = await _doc(tools_service, kb, "refunds.md", REFUNDS)
    shipping = await _doc(tools_service, kb, "shipping.txt", SHIPPING)
    await _ready(tools_service, kb)  # its vectors are written: they must go too
    found = await _search(tools_service, "refund", mode=tools_pb2.SEARCH_MODE_KEYWORD)
    assert [r.document_id for r in found] == [refunds.document_id]
    semantic = await _search(tools_service, "refund", mode=tools_pb2.SEARCH_MODE_SEMANTIC)
    assert semantic[0].document_id == refunds.document_id
    # another organization cannot delete it, nor can the id of another knowledge base reach it
    other_kb = (await _base(tools_service, name="Other")).knowledge_base_id
    for org, base in ((OTHER, kb), (ORG, other_kb)):
        details = await refused(
            tools_service.stub.DeleteDocument,
            tools_pb2.DeleteDocumentRequest(
                organization_id=org, knowledge_base_id=base, document_id=refunds.document_id
            ),
            grpc.StatusCode.NOT_FOUND,
        )
        assert details.reason == "DOCUMENT_NOT_FOUND"
    await tools_service.stub.DeleteDocument(
        tools_pb2.DeleteDocumentRequest(
            organization_id=ORG, knowledge_base_id=kb, document_id=refunds.document_id
        )
    )
    assert [d.document_id for d in await _documents(tools_service, kb)] == [shipping.document_id]
    assert await _search(tools_service, "refund", mode=tools_pb2.SEARCH_MODE_KEYWORD) == []
    for mode in (tools_pb2.SEARCH_MODE_SEMANTIC, tools_pb2.SEARCH_MODE_HYBRID):
        # what is left may be somewhat close in meaning, the deleted document is not there
        found = await _search(tools_service, "refund", mode=mode, top_k=50)
        assert {r.document_id for r in found} <= {shipping.document_id}, mode
    assert [r.document_id for r in await _search(tools_service, "warehouse")] == [
        shipping.document_id
    ]
    for call, request in (
        (
            tools_service.stub.GetDocument,
            tools_pb2.GetDocumentRequest(
                organization_id=ORG, knowledge_base_id=kb, document_id=refunds.document_id
            ),
        ),
        (
            tools_service.stub.DeleteDocument,
            tools_pb2.DeleteDocumentRequest(
                organization_id=ORG, knowledge_base_id=kb, document_id=refunds.document_id
            ),
        ),
    ):
        details = await refused(call, request, grpc.StatusCode.NOT_FOUND)
        assert details.reason == "DOCUMENT_NOT_FOUND"
    listed = await tools_service.stub.ListKnowledgeBases(
        tools_pb2.ListKnowledgeBasesRequest(organization_id=ORG)
    )
    totals = {b.knowledge_base_id: b.document_count for b in listed.knowledge_bases}
    assert totals == {kb: 1, other_kb: 0}


async def test_a_deleted_knowledge_base_takes_its_documents_out_of_search(tools_service):
    support = (await _base(tools_service)).knowledge_base_id
    hr = (await _base(tools_service, name="HR")).knowledge_base_id
    await _doc(tools_service, support, "refunds.md", REFUNDS)
    kept = await _doc(tools_service, hr, "hr.txt", HOLIDAYS + " Refund of travel expenses.")
    theirs = (await _base(tools_service, org=OTHER, name="Theirs")).knowledge_base_id
    await _doc(tools_service, theirs, "refunds.md", REFUNDS, org=OTHER)
    # not by another organization
    details = await refused(
        tools_service.stub.DeleteKnowledgeBase,
        tools_pb2.DeleteKnowledgeBaseRequest(organization_id=OTHER, knowledge_base_id=support),
        grpc.StatusCode.NOT_FOUND,
    )
    assert details.reason == "KNOWLEDGE_BASE_NOT_FOUND"
    await tools_service.stub.DeleteKnowledgeBase(
        tools_pb2.DeleteKnowledgeBaseRequest(organization_id=ORG, knowledge_base_id=support)
    )
    listed = await tools_service.stub.ListKnowledgeBases(
        tools_pb2.ListKnowledgeBasesRequest(organization_id=ORG)
    )
    assert [b.knowledge_base_id for b in listed.knowledge_bases] == [hr]
    for mode in (tools_pb2.SEARCH_MODE_KEYWORD, tools_pb2.SEARCH_MODE_HYBRID):
        found = await _search(tools_service, "refund", mode=mode)
        assert [r.document_id for r in found] == [kept.document_id], mode
    # the other organization's copy is untouched
    assert len(await _search(tools_service, "refund", org=OTHER)) == 1
    for call, request in (
        (
            tools_service.stub.DeleteKnowledgeBase,
            tools_pb2.DeleteKnowledgeBaseRequest(organization_id=ORG, knowledge_base_id=support),
        ),
        (
            tools_service.stub.ListDocuments,
            tools_pb2.ListDocumentsRequest(organization_id=ORG, knowledge_base_id=support),
        ),
    ):
        details = await refused(call, request, grpc.StatusCode.NOT_FOUND)
        assert details.reason == "KNOWLEDGE_BASE_NOT_FOUND"


# ---- the embedding model of a knowledge base -----------------------------------------------


async def test_a_knowledge_base_says_its_embedding_model(tools_service):
    local = await _base(tools_service)
    assert (
        local.embedding.provider,
        local.embedding.model,
        local.embedding.dimensions,
        local.embedding.credential_id,
    ) == ("local", "all-MiniLM-L6-v2", 384, "")
    explicit = await _base(
        tools_service, name="Local", embedding=tools_pb2.EmbeddingConfig(provider="local")
    )
    empty = await _base(tools_service, name="Empty", embedding=tools_pb2.EmbeddingConfig())
    assert explicit.embedding == empty.embedding == local.embedding
    key = await tools_service.create_credential("openai", {"api_key": "sk-test-1234567890"})
    remote = await _base(
        tools_service,
        name="Remote",
        embedding=tools_pb2.EmbeddingConfig(
            provider="openai",
            model="text-embedding-3-small",
            dimensions=512,
            credential_id=key.credential_id,
        ),
    )
    assert (
        remote.embedding.provider,
        remote.embedding.model,
        remote.embedding.dimensions,
        remote.embedding.credential_id,
    ) == ("openai", "text-embedding-3-small", 512, key.credential_id)
    listed = await tools_service.stub.ListKnowledgeBases(
        tools_pb2.ListKnowledgeBasesRequest(organization_id=ORG)
    )
    by_id = {b.knowledge_base_id: b.embedding for b in listed.knowledge_bases}
    assert by_id[remote.knowledge_base_id] == remote.embedding
    assert by_id[local.knowledge_base_id] == local.embedding


@pytest.mark.parametrize(
    "config, code, reason",
    [
        ({"provider": "cohere", "model": "m"}, "INVALID_ARGUMENT", "INVALID_EMBEDDING_CONFIG"),
        ({"provider": "openai", "credential_id": "KEY"}, "INVALID_ARGUMENT",
         "INVALID_EMBEDDING_CONFIG"),
        ({"provider": "openai", "model": "m"}, "INVALID_ARGUMENT", "INVALID_EMBEDDING_CONFIG"),
        ({"provider": "openai", "model": "m" * 201, "credential_id": "KEY"}, "INVALID_ARGUMENT",
         "FIELD_TOO_LONG"),
        ({"provider": "openai", "model": "m", "credential_id": "KEY", "dimensions": -1},
         "INVALID_ARGUMENT", "INVALID_EMBEDDING_CONFIG"),
        # a credential of another organization, of another integration, or none at all
        ({"provider": "openai", "model": "m", "credential_id": "THEIRS"}, "NOT_FOUND",
         "CREDENTIAL_NOT_FOUND"),
        ({"provider": "openai", "model": "m", "credential_id": "HTTP"}, "NOT_FOUND",
         "CREDENTIAL_NOT_FOUND"),
        ({"provider": "openai", "model": "m", "credential_id": GOOD_ID}, "NOT_FOUND",
         "CREDENTIAL_NOT_FOUND"),
    ],
)  # fmt: skip
async def test_a_bad_embedding_config_is_refused_and_nothing_is_stored(
    tools_service, config, code, reason
):
    ids = {
        "KEY": (await tools_service.create_credential("openai", {"api_key": "sk-1234567890"})),
        "THEIRS": await tools_service.create_credential(
            "openai", {"api_key": "sk-0987654321"}, org=OTHER
        ),
        "HTTP": await tools_service.create_credential(
            "http", {"token": "tok-1234567890"}, auth_type="bearer"
        ),
    }
    config = dict(config)
    if config.get("credential_id") in ids:
        config["credential_id"] = ids[config["credential_id"]].credential_id
    details = await refused(
        tools_service.stub.CreateKnowledgeBase,
        tools_pb2.CreateKnowledgeBaseRequest(
            organization_id=ORG, name="Docs", embedding=tools_pb2.EmbeddingConfig(**config)
        ),
        getattr(grpc.StatusCode, code),
    )
    assert details.reason == reason, details
    listed = await tools_service.stub.ListKnowledgeBases(
        tools_pb2.ListKnowledgeBasesRequest(organization_id=ORG)
    )
    assert list(listed.knowledge_bases) == []


async def test_a_document_whose_model_cannot_embed_it_fails_with_a_known_cause(tools_service):
    key = await tools_service.create_credential("openai", {"api_key": "sk-test-1234567890"})
    kb = (
        await _base(
            tools_service,
            embedding=tools_pb2.EmbeddingConfig(
                provider="openai", model="text-embedding-3-small", credential_id=key.credential_id
            ),
        )
    ).knowledge_base_id
    await tools_service.stub.DeleteCredential(
        tools_pb2.DeleteCredentialRequest(organization_id=ORG, credential_id=key.credential_id)
    )
    document = await _doc(tools_service, kb, "refunds.md", REFUNDS)
    [failed] = await _ready(tools_service, kb)
    assert failed.document_id == document.document_id and failed.status == "failed"
    assert key.credential_id in failed.error_message and "openai" in failed.error_message
    got = await tools_service.stub.GetDocument(
        tools_pb2.GetDocumentRequest(
            organization_id=ORG, knowledge_base_id=kb, document_id=document.document_id
        )
    )
    assert got.document.error_message == failed.error_message
    # keyword search still finds it
    found = await _search(tools_service, "refund", mode=tools_pb2.SEARCH_MODE_KEYWORD)
    assert [r.document_id for r in found] == [document.document_id]


# ---- search: modes, weights, min_score -------------------------------------------------------


async def test_search_modes_rank_by_their_score_and_report_both(tools_service):
    kb = (await _base(tools_service)).knowledge_base_id
    refunds = await _doc(tools_service, kb, "refunds.md", REFUNDS)
    await _doc(tools_service, kb, "shipping.txt", SHIPPING)
    await _doc(tools_service, kb, "hr.txt", HOLIDAYS)
    assert {d.status for d in await _ready(tools_service, kb)} == {"ready"}
    query = "refund money back"
    keyword = await _search(tools_service, query, mode=tools_pb2.SEARCH_MODE_KEYWORD)
    assert [r.document_id for r in keyword] == [refunds.document_id]  # the only one with a word
    assert keyword[0].score == pytest.approx(keyword[0].keyword_score) and keyword[0].score > 0
    semantic = await _search(tools_service, query, mode=tools_pb2.SEARCH_MODE_SEMANTIC, top_k=3)
    assert len(semantic) == 3 and semantic[0].document_id == refunds.document_id
    for r in semantic:
        assert r.score == pytest.approx(r.semantic_score) and 0 <= r.score <= 1
    hybrid = await _search(tools_service, query)  # unset: hybrid, 0.7 and 0.3
    best = hybrid[0]
    assert best.document_id == refunds.document_id
    assert best.score == pytest.approx(0.7 * best.semantic_score + 0.3 * best.keyword_score, 1e-3)
    keyword_only = await _search(tools_service, query, semantic_weight=0.0, keyword_weight=1.0)
    assert [r.document_id for r in keyword_only][:1] == [refunds.document_id]
    assert keyword_only[0].score == pytest.approx(keyword_only[0].keyword_score, 1e-3)
    scores = [r.score for r in hybrid]
    assert scores == sorted(scores, reverse=True)
    # min_score leaves out what scores less (scores are rounded to 4 places: a midpoint)
    assert len(hybrid) >= 2 and hybrid[0].score - hybrid[1].score > 0.01
    floor = (hybrid[0].score + hybrid[1].score) / 2
    assert [r.chunk_id for r in await _search(tools_service, query, min_score=floor)] == [
        best.chunk_id
    ]


@pytest.mark.parametrize(
    "fields, reason, field",
    [
        ({"semantic_weight": 1.5}, "INVALID_WEIGHTS", "semantic_weight"),
        ({"semantic_weight": 0.5, "keyword_weight": -0.1}, "INVALID_WEIGHTS", "keyword_weight"),
        ({"semantic_weight": float("nan")}, "INVALID_WEIGHTS", "semantic_weight"),
        ({"min_score": 1.01}, "INVALID_MIN_SCORE", "min_score"),
        ({"min_score": -0.5}, "INVALID_MIN_SCORE", "min_score"),
        ({"min_score": float("nan")}, "INVALID_MIN_SCORE", "min_score"),
        ({"mode": 9}, "INVALID_MODE", "mode"),
    ],
)
async def test_search_refuses_weights_scores_and_modes_out_of_range_before_any_query(
    tools_service, monkeypatch, fields, reason, field
):
    no_database(tools_service, monkeypatch)
    details = await refused(
        tools_service.stub.SearchKnowledge,
        tools_pb2.SearchKnowledgeRequest(organization_id=ORG, query="refund", **fields),
    )
    assert details.reason == reason and details.metadata["field"] == field
    assert "between 0 and 1" in details.message or "SEARCH_MODE_HYBRID" in details.message


# ---- the search_knowledge tool ---------------------------------------------------------------


async def test_the_tool_takes_a_mode_and_a_min_score(tools_service):
    kb = (await _base(tools_service)).knowledge_base_id
    refunds = await _doc(tools_service, kb, "refunds.md", REFUNDS)
    await _doc(tools_service, kb, "hr.txt", HOLIDAYS)
    await _ready(tools_service, kb)
    keyword = await tools_service.ok("search_knowledge", {"query": "refund", "mode": "keyword"})
    assert [r["document_id"] for r in keyword["results"]] == [refunds.document_id]
    result = keyword["results"][0]
    assert result["score"] == result["keyword_score"] > 0
    semantic = await tools_service.ok(
        "search_knowledge", {"query": "getting my money back", "mode": "semantic", "top_k": 2}
    )
    assert semantic["results"][0]["document_id"] == refunds.document_id
    assert all(r["score"] == r["semantic_score"] for r in semantic["results"])
    nothing = await tools_service.ok("search_knowledge", {"query": "refund", "min_score": 1})
    assert nothing["results"] == [] and nothing["count"] == 0
    for bad, words in (
        ({"mode": "fuzzy"}, "input.mode"),
        ({"min_score": 1.5}, "input.min_score"),
        ({"min_score": -1}, "input.min_score"),
    ):
        error = await tools_service.failed("search_knowledge", {"query": "refund", **bad})
        assert error.startswith("Invalid input for search_knowledge:") and words in error, error


async def test_the_tools_definition_describes_meaning_and_words(tools_service):
    response = await tools_service.stub.ListTools(tools_pb2.ListToolsRequest())
    [tool] = [t for t in response.tools if t.name == "search_knowledge"]
    assert "full-text" not in tool.description.lower()
    schema = pb.from_struct(tool.input_schema)
    assert schema["properties"]["mode"]["enum"] == ["hybrid", "semantic", "keyword"]
    assert schema["properties"]["mode"]["default"] == "hybrid"
    assert (
        schema["properties"]["min_score"]["minimum"],
        schema["properties"]["min_score"]["maximum"],
    ) == (0, 1)
    assert schema["required"] == ["query"]
