"""The knowledge routes of issue 31 over raw HTTP and the official SDK: one knowledge base, its
embedding model, listing and deleting documents and knowledge bases, search types, hybrid
search and retrieve-context (the context's assembly and token budget).

Each runs on the backend under test (SQLite, or PostgreSQL with LOOPLINE_TEST_BACKEND=postgres)
with the real local embedding model; tests that need semantic scores wait for the embeddings.
"""

from __future__ import annotations

import datetime
import re

import grpc
import httpx
import pytest
from modulex import Modulex
from modulex._exceptions import NotFoundError

from loopline.tools.v1 import tools_pb2, tools_pb2_grpc
from services.gateway.routes import knowledge_search
from services.gateway.routes.knowledge import CHUNKING_CONFIG
from services.gateway.routes.knowledge_search import (
    assemble_context,
    count_tokens,
    first_words,
)
from services.tools import chunking, knowledge
from tests.gateway.test_knowledge_http import keyword, settled

REFUNDS = (
    "# Refunds\n\nCustomers can ask for a refund within 30 days of purchase. The money goes back"
    " to the original card within five business days."
)
SHIPPING = "# Shipping\n\nOrders ship within two business days from the Lyon warehouse."
HOLIDAYS = "# Holidays\n\nThe office is closed on public holidays; staff book leave in the portal."
LOCAL = {"provider": "local", "model": "all-MiniLM-L6-v2", "dimensions": 384}


async def _base(client: httpx.AsyncClient, name: str = "Docs", **fields: object) -> dict:
    response = await client.post("/knowledge-bases", json={"name": name, **fields})
    assert response.status_code == 201, response.text
    return response.json()


async def _upload(client: httpx.AsyncClient, kb_id: str, name: str, text: str) -> dict:
    response = await client.post(
        f"/knowledge-bases/{kb_id}/documents", files={"file": (name, text.encode(), "text/plain")}
    )
    assert response.status_code == 201, response.text
    return response.json()


async def _filled(client: httpx.AsyncClient) -> tuple[dict, dict[str, dict]]:
    """A knowledge base with the three documents, embedded."""
    kb = await _base(client)
    documents = {
        name: await _upload(client, kb["id"], name, text)
        for name, text in (("refunds.md", REFUNDS), ("shipping.md", SHIPPING), ("hr.md", HOLIDAYS))
    }
    assert {d["status"] for d in await settled(client, kb["id"])} == {"completed"}
    return kb, documents


def _outsider_client(services, member: dict[str, str], org_id: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=services.base_url, headers=services.headers(member["api_key"], org_id), timeout=30
    )


# ---- one knowledge base, and its embedding model ---------------------------------------------


async def test_a_knowledge_base_is_served_alone_with_its_embedding_and_chunking(services):
    async with services.client() as client:
        kb = await _base(client, description="handbook")
        assert kb["embedding_config"] == LOCAL and kb["credential_id"] is None
        assert kb["chunking_config"] == CHUNKING_CONFIG
        await _upload(client, kb["id"], "refunds.md", REFUNDS)
        got = await client.get(f"/knowledge-bases/{kb['id']}")
        assert got.status_code == 200, got.text
        one = got.json()
        assert one["id"] == kb["id"] and one["document_count"] == 1 and one["total_chunks"] >= 1
        assert one == next(b for b in (await client.get("/knowledge-bases")).json())
        for missing in ("nope", "1d5e0f5c-0b7e-4e8e-9b0e-3f1a2b3c4d5e"):
            response = await client.get(f"/knowledge-bases/{missing}")
            assert response.status_code == 404
            assert response.json() == {"detail": "Knowledge base not found"}


def test_the_chunking_shown_is_the_tools_services():
    assert CHUNKING_CONFIG == {
        "strategy": "structure",
        "max_chars": chunking.CHUNK_CHARS,
        "overlap_chars": chunking.OVERLAP_CHARS,
    }


async def test_an_openai_embedding_config_names_its_credential(services):
    async with services.client() as client:
        created = await client.post(
            "/credentials",
            json={"integration_name": "openai", "auth_data": {"api_key": "sk-test-1234567890"}},
        )
        assert created.status_code == 201, created.text
        credential = created.json()["credential_id"]
        config = {"provider": "openai", "model": "text-embedding-3-small", "dimensions": 512}
        kb = await _base(client, embedding_config={**config, "credential_id": credential})
        assert kb["embedding_config"] == config and kb["credential_id"] == credential
        listed = (await client.get("/knowledge-bases")).json()
        assert [(b["embedding_config"], b["credential_id"]) for b in listed] == [
            (config, credential)
        ]
        for same in (None, {}, {"provider": "local"}, {"provider": None}):
            local = await _base(client, name="Local", embedding_config=same)
            assert local["embedding_config"] == LOCAL and local["credential_id"] is None, same
        cases = [
            ({"provider": "cohere"}, 400, "embedding_config.provider must be local or openai"),
            ({"provider": "local", "model": "x"}, 400, "the local provider"),
            ({"provider": "openai", "model": "m"}, 400, "embedding_config.credential_id"),
            ({"provider": "openai", "credential_id": credential}, 400, "embedding_config.model"),
            (
                {"provider": "openai", "model": "m", "credential_id": credential, "dimensions": 0},
                400,
                "embedding_config.dimensions must be an integer between 1 and 16000",
            ),
            ({"provider": "openai", "size": 3}, 400, "unknown field(s): size"),
            ("openai", 400, "embedding_config must be an object"),
            (
                {"provider": "openai", "model": "m", "credential_id": "1" * 36},
                404,
                "Credential not found",
            ),
        ]
        for value, status, words in cases:
            response = await client.post(
                "/knowledge-bases", json={"name": "Bad", "embedding_config": value}
            )
            assert response.status_code == status, (value, response.text)
            assert words in response.json()["detail"], (value, response.text)
        refused = await client.post(
            "/knowledge-bases", json={"name": "Bad", "chunking_config": {"max_chars": 5}}
        )
        assert refused.status_code == 400 and "cut by headings" in refused.json()["detail"]
        assert len((await client.get("/knowledge-bases")).json()) == 5  # nothing else stored
    # another organization's openai credential is not found
    outsider = await services.member("owner", org_id="org_other_embed")
    async with _outsider_client(services, outsider, "org_other_embed") as other:
        response = await other.post(
            "/knowledge-bases",
            json={
                "name": "Theirs",
                "embedding_config": {
                    "provider": "openai",
                    "model": "m",
                    "credential_id": credential,
                },
            },
        )
        assert response.status_code == 404 and "Credential not found" in response.json()["detail"]


# ---- documents: list and delete ------------------------------------------------------------


async def test_documents_are_listed_newest_first_and_filtered_by_status(services):
    async with services.client() as client:
        kb = await _base(client)
        names = [f"note{i}.txt" for i in range(4)]
        for name in names:
            await _upload(client, kb["id"], name, f"Note about {name}.")
        url = f"/knowledge-bases/{kb['id']}/documents"
        listed = await settled(client, kb["id"])
        assert [d["filename"] for d in listed] == names[::-1]
        assert all(d["status"] == "completed" and d["error_message"] is None for d in listed)
        page = (await client.get(url, params={"limit": 2, "offset": 1})).json()
        assert [d["filename"] for d in page] == names[2:0:-1]
        completed = (await client.get(url, params={"status": "completed", "offset": 3})).json()
        assert [d["filename"] for d in completed] == names[:1]
        assert (await client.get(url, params={"status": "failed"})).json() == []
        for params, words in (
            ({"status": "ready"}, "status must be one of pending, processing, completed, failed"),
            ({"limit": 0}, "limit"),
            ({"limit": 501}, "limit"),
            ({"offset": -1}, "offset"),
        ):
            response = await client.get(url, params=params)
            assert response.status_code == 400 and words in response.json()["detail"], params
        assert (await client.get("/knowledge-bases/nope/documents")).status_code == 404


async def test_a_documents_status_says_when_its_indexing_ended(services):
    async with services.client() as client:
        kb, documents = await _filled(client)
        url = f"/knowledge-bases/{kb['id']}/documents/{documents['refunds.md']['id']}/status"
        status = (await client.get(url)).json()
    assert status["status"] == "completed"
    assert status["message"] == "Indexed into 1 chunk"  # a short document, one chunk
    started = datetime.datetime.fromisoformat(status["processing_started_at"])
    completed = datetime.datetime.fromisoformat(status["processing_completed_at"])
    assert started < completed <= datetime.datetime.now(datetime.UTC)


async def test_a_deleted_document_leaves_the_listing_and_the_search(services):
    async with services.client() as client:
        kb = await _base(client)
        gone = await _upload(client, kb["id"], "refunds.md", REFUNDS)
        kept = await _upload(client, kb["id"], "shipping.md", SHIPPING)
        url = f"/knowledge-bases/{kb['id']}/documents/{gone['id']}"
        refused = await client.request("DELETE", url, json={"reason": "x"})
        assert refused.status_code == 400  # no body taken
        deleted = await client.delete(url, params={"delete_file": "true"})
        assert deleted.status_code == 204 and deleted.content == b""
        assert [d["id"] for d in await settled(client, kb["id"])] == [kept["id"]]
        found = await client.post(f"/knowledge-bases/{kb['id']}/search", json=keyword("refund"))
        assert found.json()["total_matches"] == 0
        assert (await client.get(url)).status_code == 404
        assert (await client.delete(url)).status_code == 404
        assert (await client.get(f"/knowledge-bases/{kb['id']}")).json()["document_count"] == 1


async def test_a_deleted_knowledge_base_takes_its_documents_out_of_every_search(services):
    async with services.client() as client:
        doomed, kept = await _base(client, "Doomed"), await _base(client, "Kept")
        document = await _upload(client, doomed["id"], "refunds.md", REFUNDS)
        await _upload(client, kept["id"], "shipping.md", SHIPPING + " Refunds ship back too.")
        both = {"knowledge_base_ids": [doomed["id"], kept["id"]]}
        before = await client.post("/knowledge-bases/search", json=keyword("refund", **both))
        assert document["id"] in {m["document_id"] for m in before.json()["matches"]}
    # a second organization can neither see nor delete it
    outsider = await services.member("owner", org_id="org_other_delete")
    async with _outsider_client(services, outsider, "org_other_delete") as other:
        for method, path in (
            ("GET", f"/knowledge-bases/{doomed['id']}"),
            ("GET", f"/knowledge-bases/{doomed['id']}/documents"),
            ("DELETE", f"/knowledge-bases/{doomed['id']}"),
            ("DELETE", f"/knowledge-bases/{doomed['id']}/documents/{document['id']}"),
            ("POST", f"/knowledge-bases/{doomed['id']}/hybrid-search"),
            ("POST", f"/knowledge-bases/{doomed['id']}/retrieve-context"),
        ):
            body = {"query": "refund"} if method == "POST" else None
            response = await other.request(method, path, json=body)
            assert response.status_code == 404, (method, path, response.text)
    async with services.client() as client:
        assert (await client.get(f"/knowledge-bases/{doomed['id']}")).status_code == 200
        deleted = await client.delete(
            f"/knowledge-bases/{doomed['id']}", params={"delete_files": "true"}
        )
        assert deleted.status_code == 204 and deleted.content == b""
        assert [b["id"] for b in (await client.get("/knowledge-bases")).json()] == [kept["id"]]
        for method, path, body in (
            ("GET", f"/knowledge-bases/{doomed['id']}", None),
            ("GET", f"/knowledge-bases/{doomed['id']}/documents", None),
            ("GET", f"/knowledge-bases/{doomed['id']}/documents/{document['id']}", None),
            ("POST", f"/knowledge-bases/{doomed['id']}/search", keyword("refund")),
            ("POST", "/knowledge-bases/search", keyword("refund", **both)),
            ("DELETE", f"/knowledge-bases/{doomed['id']}", None),
        ):
            response = await client.request(method, path, json=body)
            assert response.status_code == 404, (method, path, response.text)
        after = await client.post(
            "/knowledge-bases/search", json=keyword("refund", knowledge_base_ids=[kept["id"]])
        )
        assert document["id"] not in {m["document_id"] for m in after.json()["matches"]}
    # and an organization-wide search of the tools service (what the assistant's tool does)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{services.tools.port}") as channel:
        stub = tools_pb2_grpc.ToolsServiceStub(channel)
        for mode in (tools_pb2.SEARCH_MODE_KEYWORD, tools_pb2.SEARCH_MODE_HYBRID):
            response = await stub.SearchKnowledge(
                tools_pb2.SearchKnowledgeRequest(
                    organization_id=services.org_id, query="refund", mode=mode, top_k=50
                )
            )
            assert response.results, mode  # the kept base still answers
            assert {r.knowledge_base_id for r in response.results} == {kept["id"]}, mode


# ---- search types, hybrid search -------------------------------------------------------------


async def test_search_takes_a_search_type_and_scores_from_0_to_1(services):
    async with services.client() as client:
        kb, documents = await _filled(client)
        url = f"/knowledge-bases/{kb['id']}/search"
        semantic = (await client.post(url, json={"query": "getting my money back"})).json()
        assert semantic["matches"][0]["document_id"] == documents["refunds.md"]["id"]
        assert semantic["total_matches"] >= 2  # chunks close in meaning, without a shared word
        for m in semantic["matches"]:
            assert m["score"] == pytest.approx(m["semantic_score"]) and 0 <= m["score"] <= 1
        words = (await client.post(url, json=keyword("warehouse"))).json()
        assert [m["document_filename"] for m in words["matches"]] == ["shipping.md"]
        assert words["matches"][0]["score"] == pytest.approx(words["matches"][0]["keyword_score"])
        hybrid = (await client.post(url, json={"query": "refund", "search_type": "hybrid"})).json()
        assert hybrid["matches"][0]["document_filename"] == "refunds.md"
        floor = (await client.post(url, json={"query": "refund", "min_score": 0.99})).json()
        assert floor["total_matches"] == 0
        multi = await client.post(
            "/knowledge-bases/search",
            json={"knowledge_base_ids": [kb["id"]], "query": "warehouse", "search_type": "keyword"},
        )
        assert [m["document_filename"] for m in multi.json()["matches"]] == ["shipping.md"]
        for body in (
            {"query": "x", "search_type": "fuzzy"},
            {"query": "x", "search_type": 1},
            {"query": "x", "min_score": 1.5},
            {"query": "x", "min_score": -0.1},
        ):
            response = await client.post(url, json=body)
            assert response.status_code == 400, body


async def test_hybrid_search_weighs_both_scores(services):
    async with services.client() as client:
        kb, documents = await _filled(client)
        url = f"/knowledge-bases/{kb['id']}/hybrid-search"
        response = await client.post(
            url, json={"query": "refund card", "semantic_weight": 0.5, "keyword_weight": 0.5}
        )
        assert response.status_code == 200, response.text
        found = response.json()
        assert found["search_type"] == "hybrid" and found["knowledge_base_id"] == kb["id"]
        assert found["weights"] == {"semantic": 0.5, "keyword": 0.5} and found["top_k"] == 5
        assert found["total_matches"] == len(found["matches"]) >= 2
        best = found["matches"][0]
        assert best["document_id"] == documents["refunds.md"]["id"] and best["keyword_score"] > 0
        for m in found["matches"]:
            mean = (m["semantic_score"] + m["keyword_score"]) / 2
            assert m["score"] == pytest.approx(mean, abs=1e-3)
        scores = [m["score"] for m in found["matches"]]
        assert scores == sorted(scores, reverse=True)
        default = (await client.post(url, json={"query": "refund", "top_k": 1})).json()
        assert default["weights"] == {"semantic": 0.7, "keyword": 0.3}
        assert len(default["matches"]) == 1
        for body, words in (
            ({"query": "x", "semantic_weight": 0, "keyword_weight": 0}, "not both be 0"),
            ({"query": "x", "semantic_weight": 1.5}, "semantic_weight must be a number between"),
            ({"query": "x", "keyword_weight": "high"}, "keyword_weight must be a number"),
            ({"query": "x", "filters": {"a": 1}}, "filters are not supported"),
            ({"query": "x", "top_k": 51}, "top_k must be an integer between 1 and 50"),
            ({"query": "x", "alpha": 1}, "Unknown field(s): alpha"),
            ({}, "query is required"),
        ):
            response = await client.post(url, json=body)
            assert response.status_code == 400 and words in response.json()["detail"], body


# ---- retrieve-context ------------------------------------------------------------------------


async def test_retrieve_context_assembles_the_best_chunks_within_the_budget(services):
    async with services.client() as client:
        kb, documents = await _filled(client)
        url = f"/knowledge-bases/{kb['id']}/retrieve-context"
        response = await client.post(url, json={"query": "refund money back", "min_score": 0})
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["query"] == "refund money back"
        sources = answer["sources"]
        assert [s["document_filename"] for s in sources][0] == "refunds.md" and len(sources) >= 2
        assert sources[0]["document_id"] == documents["refunds.md"]["id"]
        blocks = answer["context"].split("\n\n[")
        assert len(blocks) == len(sources)
        assert [int(b.split("]", 1)[0].lstrip("[")) for b in blocks] == list(
            range(1, len(sources) + 1)
        )
        header = re.match(
            r"\[1\] refunds\.md \(chunk 0, score (0\.\d\d|1\.00)\)\n", answer["context"]
        )
        assert header, answer["context"][:80]
        assert float(header.group(1)) == pytest.approx(sources[0]["score"], abs=0.006)
        assert "refund within 30 days" in answer["context"]
        assert (
            answer["token_count"]
            == count_tokens(answer["context"])
            == knowledge.count_tokens(answer["context"])
        )
        # a budget for one chunk keeps the best whole chunk only
        one_chunk = knowledge.count_tokens(answer["context"].split("\n\n[2]")[0])
        tight = (
            await client.post(
                url, json={"query": "refund money back", "min_score": 0, "max_tokens": one_chunk}
            )
        ).json()
        assert len(tight["sources"]) == 1 and tight["token_count"] == one_chunk
        # a first chunk larger than the budget is cut at a word, never given whole
        cut = (
            await client.post(
                url, json={"query": "refund money back", "min_score": 0, "max_tokens": 15}
            )
        ).json()
        assert cut["token_count"] <= 15 and cut["context"].endswith("…")
        assert cut["context"].startswith("[1] refunds.md (chunk 0, score ")
        assert len(cut["sources"]) == 1 and "five business days" not in cut["context"]
        nothing = (await client.post(url, json={"query": "refund", "min_score": 0.99})).json()
        assert nothing == {"context": "", "query": "refund", "sources": [], "token_count": 0}
        for body, words in (
            ({"query": "x", "max_tokens": 0}, "max_tokens must be an integer between 1 and 32000"),
            ({"query": "x", "max_tokens": 32001}, "max_tokens"),
            ({"query": "x", "top_k": 0}, "top_k"),
            ({"query": "x", "min_score": 2}, "min_score must be a number between 0 and 1"),
            ({"query": "x", "filters": {}}, "Unknown field(s): filters"),
        ):
            response = await client.post(url, json=body)
            assert response.status_code == 400 and words in response.json()["detail"], body


def _result(name: str, index: int, score: float, content: str) -> tools_pb2.KnowledgeSearchResult:
    return tools_pb2.KnowledgeSearchResult(
        chunk_id=f"{name}-{index}",
        document_id=name,
        document_name=name,
        chunk_index=index,
        content=content,
        score=score,
    )


def test_the_context_adds_whole_chunks_best_first_while_they_fit():
    matches = [
        _result("a.md", 0, 0.9, "alpha beta gamma"),
        _result("b.md", 2, 0.8, "delta epsilon zeta eta theta"),
        _result("c.md", 1, 0.7, "iota"),
    ]
    text, sources = assemble_context(matches, 1000)
    assert text == (
        "[1] a.md (chunk 0, score 0.90)\nalpha beta gamma\n\n"
        "[2] b.md (chunk 2, score 0.80)\ndelta epsilon zeta eta theta\n\n"
        "[3] c.md (chunk 1, score 0.70)\niota"
    )
    assert [s["chunk_id"] for s in sources] == ["a.md-0", "b.md-2", "c.md-1"]
    first = count_tokens("[1] a.md (chunk 0, score 0.90)\nalpha beta gamma")
    text, sources = assemble_context(matches, first + 5)  # the second does not fit: it ends there
    assert text == "[1] a.md (chunk 0, score 0.90)\nalpha beta gamma" and len(sources) == 1
    assert assemble_context([], 100) == ("", [])


def test_a_first_chunk_over_the_budget_is_cut_at_a_word_boundary():
    header_tokens = count_tokens("[1] a.md (chunk 0, score 0.90)")  # 8
    content = "The refund doesn't arrive; it's sent back e.g. within days. Then more words here."
    text, sources = assemble_context([_result("a.md", 0, 0.9, content)], header_tokens + 3)
    assert text == "[1] a.md (chunk 0, score 0.90)\nThe refund…"  # not "doesn" of "doesn't"
    assert count_tokens(text) <= header_tokens + 3 and len(sources) == 1
    text, _ = assemble_context([_result("a.md", 0, 0.9, content)], header_tokens + 4)
    assert text == "[1] a.md (chunk 0, score 0.90)\nThe refund doesn't…"
    # a budget smaller than the header keeps words of the chunk only
    text, _ = assemble_context([_result("a.md", 0, 0.9, content)], 3)
    assert text == "The refund…"
    assert first_words("within days. Then more", 2) == "within days.…"
    assert first_words("a b c", 3) == "a b c" and first_words("a b c.", 3) == "a b c."
    assert first_words("x" * 50 + " y", 1) == "x" * 50 + "…"


@pytest.mark.parametrize(
    "text",
    ["", "plain words here", "don't stop_me now 42.5 é日本 café\n\n[1] a.md (chunk 3)", "-- .. !!"],
)
def test_the_gateway_counts_tokens_as_the_tools_service(text):
    assert count_tokens(text) == knowledge.count_tokens(text)
    assert knowledge_search._TOKEN.pattern == knowledge._TOKEN.pattern


# ---- the SDK ---------------------------------------------------------------------------------


async def test_the_new_routes_through_the_sdk(services, tmp_path):
    client = Modulex(
        api_key=services.api_key, organization_id=services.org_id, base_url=services.base_url
    )
    try:
        kb = await client.knowledge.create("SDK base", embedding_config={"provider": "local"})
        assert kb.embedding_config == LOCAL and kb.credential_id is None
        assert (await client.knowledge.get(kb.id)).name == "SDK base"
        uploaded = []
        for name, text in (("refunds.md", REFUNDS), ("shipping.md", SHIPPING)):
            path = tmp_path / name
            path.write_text(text)
            uploaded.append(await client.knowledge.upload_document(kb.id, file_path=str(path)))
        async with services.client() as http:
            await settled(http, kb.id)
        documents = await client.knowledge.list_documents(kb.id)
        assert [d.id for d in documents] == [d.id for d in reversed(uploaded)]
        assert all(d.status == "completed" for d in documents)
        assert [d.id for d in await client.knowledge.list_documents(kb.id, limit=1)] == [
            uploaded[1].id
        ]
        hybrid = await client.knowledge.hybrid_search(kb.id, "refund to my card", top_k=2)
        assert hybrid.search_type == "hybrid" and hybrid.weights == {
            "semantic": 0.7,
            "keyword": 0.3,
        }
        top = hybrid.matches[0]
        assert top.document_id == uploaded[0].id
        assert top.semantic_score is not None and top.keyword_score is not None
        context = await client.knowledge.retrieve_context(kb.id, "refund to my card", min_score=0)
        assert context.query == "refund to my card"
        assert context.context and context.context.startswith("[1] refunds.md (chunk 0")
        await client.knowledge.delete_document(kb.id, uploaded[0].id)
        assert [d.id for d in await client.knowledge.list_documents(kb.id)] == [uploaded[1].id]
        with pytest.raises(NotFoundError):
            await client.knowledge.get_document(kb.id, uploaded[0].id)
        await client.knowledge.delete(kb.id)
        with pytest.raises(NotFoundError):
            await client.knowledge.get(kb.id)
        assert await client.knowledge.list() == []
    finally:
        await client.close()


async def test_a_member_cannot_use_the_new_routes(services):
    member = await services.member("member")
    async with services.client() as client:
        kb = await _base(client)
    async with httpx.AsyncClient(
        base_url=services.base_url, headers=services.headers(member["api_key"])
    ) as weak:
        for method, path in (
            ("GET", f"/knowledge-bases/{kb['id']}"),
            ("GET", f"/knowledge-bases/{kb['id']}/documents"),
            ("DELETE", f"/knowledge-bases/{kb['id']}"),
            ("DELETE", f"/knowledge-bases/{kb['id']}/documents/x"),
            ("POST", f"/knowledge-bases/{kb['id']}/hybrid-search"),
            ("POST", f"/knowledge-bases/{kb['id']}/retrieve-context"),
        ):
            body = {"query": "x"} if method == "POST" else None
            response = await weak.request(method, path, json=body)
            assert response.status_code == 403, (method, path, response.text)
    async with services.client() as client:
        assert (await client.get(f"/knowledge-bases/{kb['id']}")).status_code == 200


async def test_the_new_query_parameters_follow_the_query_rules_and_deletes_take_no_body(services):
    async with services.client() as client:
        kb = await _base(client)
        document = await _upload(client, kb["id"], "refunds.md", REFUNDS)
        documents = f"/knowledge-bases/{kb['id']}/documents"
        for name in ("limit", "offset"):
            response = await client.get(documents, params={name: "1_0"})
            assert response.status_code == 400 and response.json() == {
                "detail": f"{name}: Input should be a whole number in digits"
            }
        for path, name in (
            (f"/knowledge-bases/{kb['id']}", "delete_files"),
            (f"{documents}/{document['id']}", "delete_file"),
        ):
            response = await client.delete(path, params={name: "yes"})
            assert response.status_code == 400 and response.json() == {
                "detail": f"{name}: Input should be true or false"
            }
            response = await client.request("DELETE", path, content=b"not json")
            assert response.status_code == 400 and "not valid JSON" in response.json()["detail"]
        assert [d["id"] for d in (await client.get(documents)).json()] == [document["id"]]
        # `false` is accepted too: no uploaded file is kept apart from the index
        deleted = await client.delete(
            f"/knowledge-bases/{kb['id']}", params={"delete_files": "false"}
        )
        assert deleted.status_code == 204
        assert (await client.get(documents)).status_code == 404
