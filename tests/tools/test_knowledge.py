"""Knowledge bases and search_knowledge: FTS5 BM25 ranking, organization scoping.

The store tests at the end (`store` fixture) run on the backend under test: SQLite, or a
fresh PostgreSQL database with LOOPLINE_TEST_BACKEND=postgres.
"""

from __future__ import annotations

import asyncio
import codecs
import random
import re
import time

import grpc
import pytest
from sqlalchemy import event, text

from loopline.tools.v1 import tools_pb2
from services.common import db
from services.common.errors import status_details
from services.tools import knowledge
from services.tools.knowledge import KnowledgeStore, chunk_text
from tests.conftest import postgres_databases, release_databases, selected_backend
from tests.tools.fake_embedder import HashingEmbedder

REFUNDS = """# Refund policy

Customers can ask for a refund within 30 days of purchase. Refunds go back to the original card.

# Shipping

Orders ship within two business days from the Lyon warehouse."""

HOLIDAYS = "The office is closed on public holidays. Staff take leave through the HR portal."


async def _base(tools_service, org="org-a", name="Support"):
    response = await tools_service.stub.CreateKnowledgeBase(
        tools_pb2.CreateKnowledgeBaseRequest(organization_id=org, name=name)
    )
    return response.knowledge_base.knowledge_base_id


async def _doc(tools_service, kb, name, text, org="org-a"):
    response = await tools_service.stub.AddDocument(
        tools_pb2.AddDocumentRequest(
            organization_id=org,
            knowledge_base_id=kb,
            name=name,
            content_type="text/markdown",
            text=text,
        )
    )
    return response.document


async def test_search_without_knowledge_bases_is_a_failed_result(tools_service):
    error = await tools_service.failed("search_knowledge", {"query": "refund"})
    assert "no knowledge bases" in error


async def test_search_knowledge_ranks_the_matching_chunk_first(tools_service):
    kb = await _base(tools_service)
    document = await _doc(tools_service, kb, "policies.md", REFUNDS)
    await _doc(tools_service, kb, "hr.txt", HOLIDAYS)
    # keyword-searchable at once; "ready" once its embeddings are written in the background
    assert document.status == "processing" and document.chunk_count == 1

    response = await tools_service.tool(
        "search_knowledge", {"query": "how do I get a refund?", "top_k": 3}
    )
    assert response.success, response.error
    assert response.millicredits == 100
    from services.common import pb

    output = pb.output_of(response)
    assert output["query"] == "how do I get a refund?"
    assert output["count"] == len(output["results"]) >= 1
    best = output["results"][0]
    assert best["document_name"] == "policies.md"
    assert best["document_id"] == document.document_id
    assert best["knowledge_base_id"] == kb
    assert "refund within 30 days" in best["content"]
    assert best["score"] > 0
    assert set(best) == {
        "knowledge_base_id",
        "document_id",
        "document_name",
        "chunk_id",
        "chunk_index",
        "content",
        "score",
        "semantic_score",
        "keyword_score",
    }
    scores = [r["score"] for r in output["results"]]
    assert scores == sorted(scores, reverse=True)


async def test_no_organization_sees_another_organizations_documents(tools_service):
    kb = await _base(tools_service, org="org-a")
    await _doc(tools_service, kb, "policies.md", REFUNDS)
    await _base(tools_service, org="org-b")
    theirs = await tools_service.ok("search_knowledge", {"query": "refund"}, org="org-b")
    assert theirs["results"] == []
    pointed = await tools_service.failed(
        "search_knowledge", {"query": "refund", "knowledge_base_ids": [kb]}, org="org-b"
    )
    assert (
        pointed
        == f"Knowledge base(s) not found: {kb!r}. Leave out knowledge_base_ids to search them all."
    )  # another org's: unknown
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _doc(tools_service, kb, "intruder.txt", "refund refund", org="org-b")
    assert status_details(caught.value).code == grpc.StatusCode.NOT_FOUND


async def test_search_can_be_limited_to_some_knowledge_bases(tools_service):
    support = await _base(tools_service, name="Support")
    hr = await _base(tools_service, name="HR")
    await _doc(tools_service, support, "policies.md", REFUNDS)
    await _doc(
        tools_service,
        hr,
        "hr.txt",
        HOLIDAYS + " Refund of travel expenses goes through the HR portal.",
    )
    only_hr = await tools_service.ok(
        "search_knowledge", {"query": "refund", "knowledge_base_ids": [hr]}
    )
    assert {r["knowledge_base_id"] for r in only_hr["results"]} == {hr}
    # an unknown id is named, not quietly dropped (POST /knowledge-bases/search answers 404 for it)
    unknown = await tools_service.failed(
        "search_knowledge", {"query": "refund", "knowledge_base_ids": ["not-a-kb", hr]}
    )
    assert unknown == (
        "Knowledge base(s) not found: 'not-a-kb'. Leave out knowledge_base_ids to search them all."
    )
    both = await tools_service.ok("search_knowledge", {"query": "refund"})
    assert {r["knowledge_base_id"] for r in both["results"]} == {support, hr}
    listed = await tools_service.stub.ListKnowledgeBases(
        tools_pb2.ListKnowledgeBasesRequest(organization_id="org-a")
    )
    assert {(b.name, b.document_count) for b in listed.knowledge_bases} == {
        ("Support", 1),
        ("HR", 1),
    }


async def test_search_rpc_and_fts_syntax_in_queries_is_inert(tools_service):
    kb = await _base(tools_service)
    await _doc(tools_service, kb, "policies.md", REFUNDS)
    response = await tools_service.stub.SearchKnowledge(
        tools_pb2.SearchKnowledgeRequest(
            organization_id="org-a", query='refund" OR NEAR(* -', top_k=2
        )
    )
    assert [r.document_name for r in response.results] == ["policies.md"]


def _messy_text(rnd: random.Random, length: int) -> str:
    """Words, long words, every kind of whitespace (Unicode spaces too) and blank lines."""
    parts = [
        "word",
        "x" * rnd.randint(1, 1500),
        "é",
        "日本",
        " ",
        "  ",
        "\t",
        "\n",
        "\n\n",
        "\n \n",
        "\u00a0",
        "\u2003",
        "\u3000",
        "\r\n",
        "a_b",
        "42",
        ".",
        "-",
    ]
    out: list[str] = []
    while sum(map(len, out)) < length:
        out.append(rnd.choice(parts))
    return "".join(out)


def test_count_tokens_counts_what_findall_finds(monkeypatch):
    rnd = random.Random(7)
    for window in (1, 5, 64 * 1024):
        monkeypatch.setattr(knowledge, "TOKEN_WINDOW", window)
        for _ in range(100):
            content = _messy_text(rnd, rnd.randint(0, 3000))
            assert knowledge.count_tokens(content) == len(re.findall(r"\w+", content))


@pytest.fixture
async def store(tmp_path):
    """(KnowledgeStore, engine) on a fresh, migrated tools database of the backend under test."""
    urls = None
    if selected_backend() == "postgres":
        urls = await postgres_databases()
        url = urls["tools"]
    else:
        url = f"sqlite+aiosqlite:///{tmp_path / 'tools.db'}"
        await db.migrate_async("tools", url)
    engine = db.make_engine(url)
    knowledge_store = KnowledgeStore(engine, db.sessionmaker(engine), HashingEmbedder())
    yield knowledge_store, engine
    await knowledge_store.close()
    await engine.dispose()
    if urls is not None:
        release_databases(list(urls.values()))


def _random_words(megabytes: float, seed: int = 1) -> str:
    """About `megabytes` MiB of random words in lines of 12, no blank line: one long paragraph."""
    rnd = random.Random(seed)
    vocabulary = [
        "".join(rnd.choices("abcdefghijklmnopqrstuvwxyz", k=rnd.randint(2, 10)))
        for _ in range(5000)
    ]
    lines = [
        " ".join(rnd.choices(vocabulary, k=12)) for _ in range(int(megabytes * 1024 * 1024 / 80))
    ]
    return "\n".join(lines)


async def test_adding_a_large_document_never_holds_the_event_loop(store):
    knowledge_store, _ = store
    base, _ = await knowledge_store.create_base("org-a", "Big")
    content = _random_words(6) + "\nzanzibarquartz appears once"
    largest_gap, stop = 0.0, asyncio.Event()

    async def ticker() -> None:
        nonlocal largest_gap
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            largest_gap, last = max(largest_gap, now - last), now

    ticking = asyncio.create_task(ticker())
    await asyncio.sleep(0.02)
    try:
        document = await knowledge_store.add_document("org-a", base.id, "big.txt", content)
    finally:
        stop.set()
        await ticking
    # Chunking, counting and ~8,000 ORM objects done on the loop would hold it for seconds.
    assert largest_gap < 0.5, f"the event loop was held for {largest_gap:.2f} s"
    assert document.chunk_count == len(chunk_text(content)) > 5000
    assert document.token_count == len(re.findall(r"\w+", content))
    assert document.file_size_bytes == len(content.encode())
    hits = await knowledge_store.search("org-a", "zanzibarquartz", [base.id], 5, mode="keyword")
    assert [(h.document_id, h.chunk_index) for h in hits] == [
        (document.id, document.chunk_count - 1)
    ]


async def test_a_document_is_stored_as_one_row_per_chunk_in_order_and_indexed(store):
    knowledge_store, engine = store
    base, _ = await knowledge_store.create_base("org-a", "Docs")
    content = "\n\n".join(
        f"Paragraph {i} about refunds and parcel {i}. " + "filler words here " * 40
        for i in range(2500)
    )
    document = await knowledge_store.add_document(
        "org-a", base.id, "long.md", content, "text/markdown"
    )
    chunks = chunk_text(content)
    assert len(chunks) > knowledge.INSERT_PAGE  # more than one executemany page
    async with engine.connect() as connection:
        rows = (
            await connection.execute(
                text(
                    "SELECT id, document_id, knowledge_base_id, org_id, chunk_index, content"
                    " FROM knowledge_chunks ORDER BY id"
                )
            )
        ).all()
        assert [r[1:] for r in rows] == [
            (document.id, base.id, "org-a", i, c) for i, c in enumerate(chunks)
        ]
        if engine.dialect.name == "sqlite":
            indexed = (
                await connection.execute(
                    text("SELECT rowid, content FROM knowledge_chunks_fts ORDER BY rowid")
                )
            ).all()
            assert [tuple(r) for r in indexed] == [(r[0], r[5]) for r in rows]
    hits = await knowledge_store.search("org-a", "parcel 2345", [base.id], 3)
    assert hits[0].chunk_index == next(i for i, c in enumerate(chunks) if "parcel 2345." in c)
    assert hits[0].score > 0


@pytest.mark.parametrize(
    "failing", ["INSERT INTO knowledge_chunks (", "INSERT INTO knowledge_chunks_fts"]
)
async def test_a_document_that_fails_to_index_leaves_nothing_behind(store, monkeypatch, failing):
    knowledge_store, engine = store
    if "fts" in failing and engine.dialect.name != "sqlite":
        pytest.skip("PostgreSQL indexes the chunks themselves (a GIN index), there is no FTS table")
    base, _ = await knowledge_store.create_base("org-a", "Docs")
    monkeypatch.setattr(knowledge, "INSERT_PAGE", 3)
    calls = []

    def fail_late(conn, cursor, statement, parameters, context, executemany):
        if statement.startswith(failing):
            calls.append(statement)
            if len(calls) == 2 or "fts" in failing:  # after a first page of chunks is in
                raise RuntimeError("disk on fire")

    event.listen(engine.sync_engine, "before_cursor_execute", fail_late)
    content = "\n\n".join(f"paragraph {i} " * 60 for i in range(10))
    with pytest.raises(Exception, match="disk on fire"):
        await knowledge_store.add_document("org-a", base.id, "doomed.txt", content)
    event.remove(engine.sync_engine, "before_cursor_execute", fail_late)
    async with engine.connect() as connection:
        for table in ("knowledge_documents", "knowledge_chunks") + (
            ("knowledge_chunks_fts",) if engine.dialect.name == "sqlite" else ()
        ):
            assert (
                await connection.execute(text(f"SELECT count(*) FROM {table}"))
            ).scalar_one() == 0, table
    assert await knowledge_store.search("org-a", "paragraph", None, 5) == []


@pytest.mark.parametrize(
    "data, kind, text",
    [
        (
            "café au lait\n".encode("utf-16"),
            "txt",
            "café au lait",
        ),  # with its BOM: was "\ufffd\ufffdc\x00a\x00..."
        (
            "name,drink\nZoë,café\n".encode("latin-1"),
            "csv",
            "Zoë,café",
        ),  # not UTF-8: was "Zo\ufffd,caf\ufffd"
        ("smart “quotes” – dash".encode("cp1252"), "txt", "smart “quotes” – dash"),
        ("plain UTF-8: café".encode(), "md", "plain UTF-8: café"),
        (codecs.BOM_UTF8 + b"with a BOM", "txt", "with a BOM"),
    ],
)
def test_an_uploaded_text_file_is_read_in_its_encoding(data, kind, text):
    """A UTF-16 file is indexed without its BOM or mojibake and a Latin-1 CSV keeps its accented
    letters, so "café" is found."""
    from services.tools.extract import extract_text

    extracted = extract_text(data, kind)
    assert text in extracted and "\ufffd" not in extracted and "\x00" not in extracted


@pytest.mark.parametrize("raw", [b'{"a": NaN}', b"[Infinity]", b'{"a": -Infinity}'])
def test_a_json_upload_with_nan_or_infinity_is_refused_as_not_json(raw):
    """NaN and Infinity are not JSON (RFC 8259), and the README says a JSON file that does not
    parse is 400: {"a": NaN} is refused, not indexed."""
    from services.tools.extract import ExtractionError, extract_text

    with pytest.raises(ExtractionError, match="not JSON"):
        extract_text(raw, "json")
