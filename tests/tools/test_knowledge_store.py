"""The knowledge store with embeddings: background indexing, the three search modes and their
scores, deletion, failures and restarts, on the backend under test (SQLite, or PostgreSQL
with pgvector when LOOPLINE_TEST_BACKEND=postgres)."""

from __future__ import annotations

import asyncio
import math
import time

import grpc
import pytest
from sqlalchemy import text

from services.common import db
from services.common.errors import RpcError
from services.tools import knowledge_indexer
from services.tools.embedder_source import local_only
from services.tools.knowledge import KnowledgeStore
from tests.conftest import postgres_databases, release_databases, selected_backend
from tests.tools.fake_embedder import HashingEmbedder

REFUNDS = (
    "Customers can ask for a refund within 30 days of purchase; the money goes back to the card."
)
SHIPPING = "Orders leave the Lyon warehouse within two business days by tracked parcel."
HOLIDAYS = "The office is closed on public holidays. Staff take leave through the HR portal."


@pytest.fixture
async def database(tmp_path):
    """The URL of a fresh, migrated tools database of the backend under test."""
    if selected_backend() == "postgres":
        urls = await postgres_databases()
        yield urls["tools"]
        release_databases(list(urls.values()))
    else:
        url = f"sqlite+aiosqlite:///{tmp_path / 'tools.db'}"
        await db.migrate_async("tools", url)
        yield url


@pytest.fixture
async def open_store(database):
    """`open_store(embedder_for)` -> a KnowledgeStore on `database`, closed afterwards."""
    opened = []

    async def open_(embedder_for=local_only) -> KnowledgeStore:
        engine = db.make_engine(database)
        store = KnowledgeStore(engine, db.sessionmaker(engine), embedder_for)
        opened.append((store, engine))
        return store

    yield open_
    for store, engine in opened:
        await store.close()
        await engine.dispose()


async def _filled(store: KnowledgeStore, org: str = "org-a") -> str:
    base, _ = await store.create_base(org, "Support")
    for name, content in (("refunds.md", REFUNDS), ("shipping.md", SHIPPING), ("hr.md", HOLIDAYS)):
        await store.add_document(org, base.id, name, content)
    await store.indexer.wait_idle()
    return base.id


async def _vector_count(store: KnowledgeStore) -> int:
    async with store.indexer._sessions() as session:
        return int((await session.execute(text("SELECT count(*) FROM knowledge_vectors"))).scalar())


async def test_documents_are_embedded_in_the_background_then_ready(open_store):
    store = await open_store()
    base, _ = await store.create_base("org-a", "Support")
    document = await store.add_document("org-a", base.id, "refunds.md", REFUNDS)
    assert document.status == "processing"
    # keyword search finds it before any embedding is written
    hits = await store.search("org-a", "refund", [base.id], 3, mode="keyword")
    assert [h.document_name for h in hits] == ["refunds.md"]
    await store.indexer.wait_idle()
    assert (await store.get_document("org-a", base.id, document.id)).status == "ready"
    assert await _vector_count(store) == document.chunk_count


async def test_semantic_search_finds_a_paraphrase_that_keywords_miss(open_store):
    store = await open_store()
    base_id = await _filled(store)
    question = "Can I get my cash returned after buying something?"
    assert await store.search("org-a", question, [base_id], 3, mode="keyword") == []
    semantic = await store.search("org-a", question, [base_id], 3, mode="semantic")
    assert semantic[0].document_name == "refunds.md"
    assert semantic[0].semantic_score > semantic[1].semantic_score
    hybrid = await store.search("org-a", question, [base_id], 3)
    assert hybrid[0].document_name == "refunds.md"


async def test_scores_are_between_0_and_1_and_keyword_score_counts_the_words(open_store):
    store = await open_store()
    base_id = await _filled(store)
    for mode in ("keyword", "semantic", "hybrid"):
        hits = await store.search("org-a", "Lyon warehouse parcels", [base_id], 5, mode=mode)
        assert hits, mode
        assert all(0.0 <= h.score <= 1.0 for h in hits)
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    best = (await store.search("org-a", "Lyon warehouse parcels", [base_id], 1, mode="keyword"))[0]
    assert best.document_name == "shipping.md"
    assert best.keyword_score == 1.0  # "parcels" counts as the chunk's "parcel"
    # each word weighs by its rarity (IDF over the 3 chunks): "lyon" is in 1, "submarine" in none
    lyon, submarine = math.log(1 + 2.5 / 1.5), math.log(1 + 3.5 / 0.5)
    part = await store.search("org-a", "Lyon submarine", [base_id], 1, mode="keyword")
    assert part[0].keyword_score == pytest.approx(lyon / (lyon + submarine))
    hybrid = (await store.search("org-a", "Lyon warehouse parcels", [base_id], 1))[0]
    assert hybrid.score == pytest.approx(0.7 * hybrid.semantic_score + 0.3 * hybrid.keyword_score)
    weighted = await store.search(
        "org-a", "Lyon warehouse parcels", [base_id], 1, semantic_weight=0.0, keyword_weight=1.0
    )
    assert weighted[0].score == pytest.approx(1.0)


async def test_min_score_leaves_out_weaker_results(open_store):
    store = await open_store()
    base_id = await _filled(store)
    every = await store.search("org-a", "refund to the card", [base_id], 5, mode="semantic")
    cut = (every[0].score + every[-1].score) / 2
    kept = await store.search(
        "org-a", "refund to the card", [base_id], 5, mode="semantic", min_score=cut
    )
    assert kept and all(h.score >= cut for h in kept) and len(kept) < len(every)


async def test_no_organization_finds_another_organizations_chunks_by_meaning(open_store):
    store = await open_store()
    base_id = await _filled(store, org="org-a")
    await store.create_base("org-b", "Theirs")
    for mode in ("semantic", "hybrid", "keyword"):
        assert await store.search("org-b", "refund", None, 5, mode=mode) == []
        assert await store.search("org-b", "refund", [base_id], 5, mode=mode) == []


async def test_deleting_a_document_takes_its_chunks_and_vectors(open_store):
    store = await open_store()
    base_id = await _filled(store)
    refunds = next(
        d for d in await store.list_documents("org-a", base_id) if d.name == "refunds.md"
    )
    with pytest.raises(RpcError) as refused:
        await store.delete_document("org-b", base_id, refunds.id)
    assert refused.value.code == grpc.StatusCode.NOT_FOUND
    await store.delete_document("org-a", base_id, refunds.id)
    for mode in ("semantic", "hybrid", "keyword"):
        hits = await store.search("org-a", "refund within 30 days", [base_id], 5, mode=mode)
        assert "refunds.md" not in {h.document_name for h in hits}
    assert [d.name for d in await store.list_documents("org-a", base_id)] == [
        "hr.md",
        "shipping.md",
    ]
    assert await _vector_count(store) == 2


async def test_deleting_a_knowledge_base_takes_everything_it_held(open_store):
    store = await open_store()
    base_id = await _filled(store)
    kept, _ = await store.create_base("org-a", "Other")
    await store.add_document("org-a", kept.id, "refunds.md", REFUNDS)
    await store.indexer.wait_idle()
    with pytest.raises(RpcError):
        await store.delete_base("org-b", base_id)
    await store.delete_base("org-a", base_id)
    with pytest.raises(RpcError) as gone:
        await store.get_base("org-a", base_id)
    assert gone.value.code == grpc.StatusCode.NOT_FOUND
    hits = await store.search("org-a", "refund", None, 5)
    assert {h.knowledge_base_id for h in hits} == {kept.id}
    assert await _vector_count(store) == 1


async def test_a_model_that_refuses_fails_the_document_with_a_known_reason(open_store):
    store = await open_store(HashingEmbedder(fail="the embeddings API refused the key (401)"))
    base, _ = await store.create_base("org-a", "Support")
    document = await store.add_document("org-a", base.id, "refunds.md", REFUNDS)
    await store.indexer.wait_idle()
    failed = await store.get_document("org-a", base.id, document.id)
    assert (failed.status, failed.error_message) == (
        "failed",
        "the embeddings API refused the key (401)",
    )
    # keyword ranking still serves hybrid search; a semantic search says why it cannot
    hits = await store.search("org-a", "refund", [base.id], 3)
    assert [h.document_name for h in hits] == ["refunds.md"] and hits[0].semantic_score == 0
    with pytest.raises(RpcError) as unavailable:
        await store.search("org-a", "refund", [base.id], 3, mode="semantic")
    assert unavailable.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "refused the key (401)" in unavailable.value.message


async def test_a_restarted_store_embeds_what_the_last_one_left(open_store, monkeypatch):
    first = await open_store(HashingEmbedder())
    base, _ = await first.create_base("org-a", "Support")
    await first.indexer.stop()  # the process stops before its indexer ran
    monkeypatch.setattr(first.indexer, "kick", lambda: None)
    document = await first.add_document("org-a", base.id, "refunds.md", REFUNDS)
    assert await _vector_count(first) == 0
    second = await open_store(HashingEmbedder())
    second.indexer.kick()  # what the server does at start
    await second.indexer.wait_idle()
    assert (await second.get_document("org-a", base.id, document.id)).status == "ready"
    assert await _vector_count(second) == document.chunk_count


async def test_a_document_deleted_while_it_is_embedded_leaves_nothing(open_store, monkeypatch):
    embedder = HashingEmbedder()
    store = await open_store(embedder)
    base, _ = await store.create_base("org-a", "Support")
    release = asyncio.Event()
    real_embed = embedder.embed

    async def slow_embed(texts: list[str]):
        await release.wait()
        return await real_embed(texts)

    monkeypatch.setattr(embedder, "embed", slow_embed)
    document = await store.add_document("org-a", base.id, "refunds.md", REFUNDS)
    await asyncio.sleep(0.05)  # the indexer is waiting on the model
    await store.delete_document("org-a", base.id, document.id)
    release.set()
    await store.indexer.wait_idle()
    assert await _vector_count(store) == 0


async def test_batches_of_many_chunks_are_all_embedded(open_store, monkeypatch):
    monkeypatch.setattr(knowledge_indexer, "BATCH", 3)
    store = await open_store(HashingEmbedder())
    base, _ = await store.create_base("org-a", "Support")
    content = "\n\n".join(
        f"## Part {i}\n\n" + f"Paragraph {i} about parcels. " * 40 for i in range(12)
    )
    document = await store.add_document("org-a", base.id, "long.md", content)
    await store.indexer.wait_idle()
    assert document.chunk_count > 3
    assert await _vector_count(store) == document.chunk_count
    assert (await store.get_document("org-a", base.id, document.id)).status == "ready"


async def test_reembed_replaces_the_vectors_of_a_changed_model(open_store):
    from services.tools.knowledge_indexer import EmbeddingSpec
    from services.tools.reembed import reembed

    embedder = HashingEmbedder()
    store = await open_store(embedder)
    base_id = await _filled(store)
    sessions = store.indexer._sessions
    calls = embedder.calls
    assert await reembed(store, sessions, [base_id]) == {
        "knowledge_bases": 1,
        "documents": 0,
        "failed": [],
    }
    assert embedder.calls == calls  # nothing was stale
    answer = await reembed(store, sessions, [], everything=True)
    assert answer == {"knowledge_bases": 1, "documents": 3, "failed": []}
    assert await _vector_count(store) == 3
    other = EmbeddingSpec("local", "all-MiniLM-L6-v2-next", 64, "")
    assert (await reembed(store, sessions, [base_id], spec=other))["documents"] == 3
    async with sessions() as session:
        models = (await session.execute(text("SELECT DISTINCT model FROM knowledge_vectors"))).all()
    assert [m[0] for m in models] == ["all-MiniLM-L6-v2-next"]
    assert await reembed(store, sessions, ["nope"]) == {"error": "no knowledge base nope"}


def test_the_reembed_command_embeds_documents_left_unembedded(tmp_path, monkeypatch):
    import json

    from services.tools.__main__ import main

    url = f"sqlite+aiosqlite:///{tmp_path / 'tools.db'}"

    async def fill() -> str:
        await db.migrate_async("tools", url)
        engine = db.make_engine(url)
        store = KnowledgeStore(engine, db.sessionmaker(engine), HashingEmbedder(fail="down"))
        base, _ = await store.create_base("org-a", "Support")
        await store.add_document("org-a", base.id, "refunds.md", REFUNDS)
        await store.indexer.wait_idle()
        await store.close()
        await engine.dispose()
        return base.id

    base_id = asyncio.run(fill())
    monkeypatch.setenv("LOOPLINE_TOOLS_DATABASE_URL", url)
    printed: list[str] = []
    monkeypatch.setattr("builtins.print", lambda text: printed.append(text))
    assert main(["reembed", "--knowledge-base", base_id]) == 0
    assert json.loads(printed[-1]) == {"knowledge_bases": 1, "documents": 1, "failed": []}


def test_an_interrupted_reembed_command_still_prints_one_json_document(tmp_path, monkeypatch):
    import json

    from services.tools import __main__ as command

    async def interrupted(settings, args):  # noqa: ANN001, ANN202
        raise KeyboardInterrupt

    monkeypatch.setattr(command, "reembed_command", interrupted)
    printed: list[str] = []
    monkeypatch.setattr("builtins.print", lambda text: printed.append(text))
    assert command.main(["reembed", "--all"]) == 130
    assert json.loads(printed[-1]) == {"error": command.REEMBED_INTERRUPTED}


async def test_the_event_loop_keeps_serving_while_the_local_model_embeds(open_store):
    store = await open_store()  # the real local model
    base, _ = await store.create_base("org-a", "Big")
    content = "\n\n".join(
        f"## Part {i}\n\n" + f"Parcels of part {i} leave the Lyon warehouse in two days. " * 14
        for i in range(40)
    )
    largest_gap, stop = 0.0, asyncio.Event()

    async def ticker() -> None:
        nonlocal largest_gap
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            largest_gap, last = max(largest_gap, now - last), now

    ticking = asyncio.create_task(ticker())
    document = await store.add_document("org-a", base.id, "big.md", content)
    assert document.chunk_count >= 40
    searched = await store.search("org-a", "Lyon parcels", [base.id], 3, mode="keyword")
    await store.indexer.wait_idle()
    stop.set()
    await ticking
    assert searched  # a search answered while the chunks were being embedded
    assert (await store.get_document("org-a", base.id, document.id)).status == "ready"
    # the model runs in a worker thread: the loop is never held for a batch (16 chunks, over a
    # second of CPU); a busy machine may still delay a tick by a few hundred ms
    assert largest_gap < 1.0, f"the event loop was held for {largest_gap:.2f} s"


class _Gated(HashingEmbedder):
    """A HashingEmbedder whose calls wait for `gate` (when set) and take `delay_s`."""

    def __init__(self, delay_s: float = 0.0) -> None:
        super().__init__()
        self.gate: asyncio.Event | None = None
        self.delay_s = delay_s

    async def embed(self, texts: list[str]):
        if self.gate is not None:
            await self.gate.wait()
        await asyncio.sleep(self.delay_s)
        return await super().embed(texts)


async def test_a_new_documents_chunks_never_get_a_deleted_documents_vectors(open_store):
    embedder = _Gated()
    store = await open_store(embedder)
    base, _ = await store.create_base("org-a", "Support")
    embedder.gate = asyncio.Event()
    old = await store.add_document("org-a", base.id, "old.md", REFUNDS)
    await asyncio.sleep(0.05)  # the indexer waits on the model with old.md's chunk
    await store.delete_document("org-a", base.id, old.id)
    new = await store.add_document("org-a", base.id, "new.md", HOLIDAYS)  # may reuse the id
    embedder.gate.set()
    await store.indexer.wait_idle()
    assert (await store.get_document("org-a", base.id, new.id)).status == "ready"
    async with store.indexer._sessions() as session:
        rows = (
            await session.execute(
                text(
                    "SELECT c.content, v.embedding FROM knowledge_vectors v"
                    " JOIN knowledge_chunks c ON c.id = v.chunk_id"
                )
            )
        ).all()
    assert len(rows) == 1
    expected = (await HashingEmbedder().embed([rows[0][0]]))[0]
    if isinstance(rows[0][1], bytes):  # SQLite: float32 BLOB
        import numpy as np

        assert np.allclose(np.frombuffer(rows[0][1], dtype=np.float32), expected)


async def test_a_small_upload_is_not_queued_behind_a_large_one(open_store, monkeypatch):
    monkeypatch.setattr(knowledge_indexer, "BATCH", 2)
    store = await open_store(_Gated(delay_s=0.05))
    base, _ = await store.create_base("org-a", "Support")
    content = "\n\n".join(f"## Part {i}\n\n" + f"Parcel {i} rules. " * 60 for i in range(30))
    large = await store.add_document("org-a", base.id, "large.md", content)
    small = await store.add_document("org-a", base.id, "small.md", REFUNDS)
    for _ in range(100):
        if (await store.get_document("org-a", base.id, small.id)).status == "ready":
            break
        await asyncio.sleep(0.05)
    assert (await store.get_document("org-a", base.id, small.id)).status == "ready"
    assert (await store.get_document("org-a", base.id, large.id)).status == "processing"


async def test_a_model_that_cannot_answer_now_is_asked_again(open_store, monkeypatch):
    monkeypatch.setattr(knowledge_indexer, "RETRY_S", 0.05)
    back = asyncio.Event()

    class Flaky(HashingEmbedder):
        async def embed(self, texts: list[str]):
            self.calls += 1
            if not back.is_set():
                raise knowledge_indexer.EmbeddingUnavailable(
                    "the embeddings API answered HTTP 503", permanent=False
                )
            return await super().embed(texts)

    embedder = Flaky()
    store = await open_store(embedder)
    base, _ = await store.create_base("org-a", "Support")
    document = await store.add_document("org-a", base.id, "refunds.md", REFUNDS)
    for _ in range(200):  # asked again, and again
        if embedder.calls >= 3:
            break
        await asyncio.sleep(0.02)
    assert embedder.calls >= 3
    waiting = await store.get_document("org-a", base.id, document.id)
    assert (waiting.status, waiting.error_message) == (
        "processing",
        "the embeddings API answered HTTP 503",
    )
    back.set()
    await store.indexer.wait_idle()
    done = await store.get_document("org-a", base.id, document.id)
    assert (done.status, done.error_message) == ("ready", None)


async def test_a_semantic_search_leaves_out_only_the_bases_whose_model_fails(open_store):
    from services.tools.knowledge_indexer import EmbeddingSpec

    working, failing = (
        HashingEmbedder(),
        HashingEmbedder(fail="the embeddings API refused the key (401)"),
    )

    async def embedder_for(org_id: str, spec: EmbeddingSpec):
        return failing if spec.provider == "openai" else working

    store = await open_store(embedder_for)
    local, _ = await store.create_base("org-a", "Local")
    remote, _ = await store.create_base(
        "org-a", "Remote", embedding=EmbeddingSpec("openai", "m", 0, "credential-1")
    )
    await store.add_document("org-a", local.id, "refunds.md", REFUNDS)
    await store.add_document("org-a", remote.id, "shipping.md", SHIPPING)
    await store.indexer.wait_idle()
    hits = await store.search("org-a", "refund card", None, 5, mode="semantic")
    assert {h.knowledge_base_id for h in hits} == {local.id}
    with pytest.raises(RpcError) as refused:
        await store.search("org-a", "refund card", [remote.id], 5, mode="semantic")
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "refused the key (401)" in refused.value.message


async def test_keyword_scores_match_words_as_the_engines_stem_them(open_store):
    store = await open_store(HashingEmbedder())
    base, _ = await store.create_base("org-a", "Security")
    await store.add_document(
        "org-a", base.id, "security.md", "Secrets get encryption at rest. Le café du résumé."
    )
    # PostgreSQL's 'english' text search keeps accents (no unaccent): "cafe" does not find "café"
    queries = ["encrypted secret"] + (["cafe resume"] if selected_backend() == "sqlite" else [])
    for query in queries:
        hits = await store.search("org-a", query, [base.id], 1, mode="keyword")
        assert hits and hits[0].keyword_score == 1.0, query


async def test_reembed_refuses_a_credential_that_is_not_the_organizations(open_store):
    from services.tools.knowledge_indexer import EmbeddingSpec
    from services.tools.reembed import reembed

    class NoCredentials:
        async def get(self, org_id: str, credential_id: str):
            raise RpcError(grpc.StatusCode.NOT_FOUND, "CREDENTIAL_NOT_FOUND", "not found")

    store = await open_store(HashingEmbedder())
    base_id = await _filled(store)
    spec = EmbeddingSpec("openai", "text-embedding-3-small", 0, "nonexistent")
    answer = await reembed(
        store, store.indexer._sessions, [base_id], spec=spec, credentials=NoCredentials()
    )
    assert answer == {"error": "credential nonexistent is not an 'openai' credential of org-a"}
    assert await _vector_count(store) == 3  # nothing was dropped
    assert (await store.get_base("org-a", base_id))[0].embedding_provider == "local"
