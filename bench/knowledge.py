"""The knowledge workload: indexing throughput with the local model, and search latency per mode
over large knowledge bases.

Indexing: `documents` markdown documents of ~5 KB (paragraphs of this repository's docs/)
added with AddDocument over gRPC, then ListDocuments until every one is "ready": the tools
service chunked them and embedded every chunk with its local model. Documents and chunks per
second, end to end.

Search: one knowledge base filled to each size in turn, written straight into the tools
database as the store writes it (document rows, chunk rows of ~900 characters of words drawn
from docs/, their FTS5 rows on SQLite, and a random unit vector per chunk through the store's
VectorIndex): embedding 100,000 chunks with the model would take hours, and the cost of the
exact vector scan does not depend on the vectors' values. Then `searches` SearchKnowledge calls
per mode (three words from the same vocabulary, top_k 5) over gRPC; a semantic or hybrid search
includes embedding the query with the local model.

grpc and the generated stubs are imported inside the functions (see bench/tools.py).
"""

from __future__ import annotations

import asyncio
import random
import re
import time
import uuid
from collections import Counter
from typing import Any, cast

import numpy as np

from bench.deploy import ROOT, Deployment
from bench.stats import rounded, summary

DOCUMENT_BYTES = 5 * 1024
CHUNK_CHARS = 900
CHUNKS_PER_DOCUMENT = 1000  # synthetic documents of the search sizes
MODES = ("keyword", "semantic", "hybrid")
READY_TIMEOUT_S = 1800.0
WARMUP, MIN_SEARCHES = 2, 3  # unmeasured searches first; measured ones whatever the time cap


def _paragraphs() -> list[str]:
    """The prose paragraphs of docs/*.md (tables and code left out)."""
    paragraphs = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        for block in re.split(r"\n\s*\n", path.read_text()):
            block = block.strip()
            if len(block) > 200 and not block.startswith(("|", "```", "#")):
                paragraphs.append(block)
    return paragraphs


def _documents(count: int, rng: random.Random) -> list[str]:
    """`count` markdown documents of about DOCUMENT_BYTES: a title, sections, paragraphs."""
    paragraphs = _paragraphs()
    documents = []
    for n in range(count):
        parts = [f"# Bench document {n}"]
        while sum(len(p) + 2 for p in parts) < DOCUMENT_BYTES:
            if len(parts) % 4 == 1:
                parts.append(f"## Section {len(parts)}")
            parts.append(rng.choice(paragraphs))
        documents.append("\n\n".join(parts))
    return documents


async def _indexing(stub: Any, org: str, count: int) -> dict[str, Any]:
    """Add `count` documents, wait until all are ready; the throughput figures."""
    from loopline.tools.v1 import tools_pb2

    documents = _documents(count, random.Random(7))
    base = (
        await stub.CreateKnowledgeBase(
            tools_pb2.CreateKnowledgeBaseRequest(organization_id=org, name="bench indexing"),
            timeout=30,
        )
    ).knowledge_base
    started = time.perf_counter()
    for n, text in enumerate(documents):
        await stub.AddDocument(
            tools_pb2.AddDocumentRequest(
                organization_id=org,
                knowledge_base_id=base.knowledge_base_id,
                name=f"doc{n}.md",
                content_type="text/markdown",
                text=text,
            ),
            timeout=60,
        )
    added = time.perf_counter() - started
    while True:
        listed = (
            await stub.ListDocuments(
                tools_pb2.ListDocumentsRequest(
                    organization_id=org, knowledge_base_id=base.knowledge_base_id, limit=500
                ),
                timeout=30,
            )
        ).documents
        statuses = [d.status for d in listed]
        if len(listed) >= count and all(s != "processing" for s in statuses):
            break
        if time.perf_counter() - started > READY_TIMEOUT_S:
            raise RuntimeError(f"documents not ready after {READY_TIMEOUT_S:g} s")
        await asyncio.sleep(0.05)
    elapsed = time.perf_counter() - started
    if any(s != "ready" for s in statuses):
        raise RuntimeError(f"documents not indexed: {sorted(set(statuses))}")
    chunks = sum(d.chunk_count for d in listed)
    size = sum(len(t.encode()) for t in documents)
    return {
        "documents": count,
        "chunks": chunks,
        "kib": rounded(size / 1024, 1),
        "add_s": rounded(added),
        "ready_s": rounded(elapsed),
        "documents_per_s": rounded(count / elapsed),
        "chunks_per_s": rounded(chunks / elapsed),
        "kib_per_s": rounded(size / 1024 / elapsed),
    }


class _Filler:
    """Writes synthetic documents, chunks, FTS5 rows and vectors into the tools database the
    way the store does (knowledge.py `_insert_chunks`, vectors.py `VectorIndex.write`)."""

    def __init__(self, url: str, org: str, base_id: str, rng: random.Random) -> None:
        from services.common import db
        from services.tools.vectors import VectorIndex

        self.engine = db.make_engine(url)
        self.sessions = db.sessionmaker(self.engine)
        self.vectors = VectorIndex(self.engine, self.sessions)
        self.org, self.base_id, self.rng = org, base_id, rng
        self.np_rng = np.random.default_rng(11)
        self.words = [w for p in _paragraphs() for w in re.findall(r"[A-Za-z]{3,}", p)]
        self.chunks = 0

    def text(self) -> str:
        words: list[str] = []
        while sum(len(w) + 1 for w in words) < CHUNK_CHARS:
            words.extend(self.rng.choices(self.words, k=20))
        return " ".join(words)

    async def fill_to(self, total: int) -> float:
        """Add documents of CHUNKS_PER_DOCUMENT chunks until the base holds `total`; seconds."""
        started = time.perf_counter()
        while self.chunks < total:
            await self._document(min(CHUNKS_PER_DOCUMENT, total - self.chunks))
        return time.perf_counter() - started

    async def _document(self, count: int) -> None:
        from sqlalchemy import Table, insert, text

        from services.tools.knowledge_indexer import LOCAL_MODEL
        from services.tools.models import KnowledgeChunk, KnowledgeDocument, new_id, utcnow

        texts = [self.text() for _ in range(count)]
        document = new_id()
        vectors = self.np_rng.standard_normal((count, 384)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        async with self.sessions() as session, session.begin():
            await session.execute(
                insert(cast(Table, KnowledgeDocument.__table__)),
                [
                    {
                        "id": document,
                        "knowledge_base_id": self.base_id,
                        "org_id": self.org,
                        "name": f"synthetic{self.chunks}.txt",
                        "content_type": "text/plain",
                        "status": "ready",
                        "chunk_count": count,
                        "file_size_bytes": sum(len(t) for t in texts),
                        "token_count": sum(len(t.split()) for t in texts),
                        "created_at": utcnow(),
                    }
                ],
            )
            await session.execute(
                insert(cast(Table, KnowledgeChunk.__table__)),
                [
                    {
                        "document_id": document,
                        "knowledge_base_id": self.base_id,
                        "org_id": self.org,
                        "chunk_index": i,
                        "content": t,
                    }
                    for i, t in enumerate(texts)
                ],
            )
            if self.engine.dialect.name == "sqlite":
                await session.execute(
                    text(
                        "INSERT INTO knowledge_chunks_fts(rowid, content) SELECT id, content"
                        " FROM knowledge_chunks WHERE document_id = :d ORDER BY id"
                    ),
                    {"d": document},
                )
            ids = (
                await session.scalars(
                    text("SELECT id FROM knowledge_chunks WHERE document_id = :d ORDER BY id"),
                    {"d": document},
                )
            ).all()
            rows = [(int(c), document, v) for c, v in zip(ids, vectors, strict=True)]
            await self.vectors.write(session, LOCAL_MODEL, rows)
        self.chunks += count

    async def close(self) -> None:
        await self.engine.dispose()


async def _searches(
    stub: Any, org: str, base_id: str, filler: _Filler, mode: str, searches: int, cap_s: float
) -> dict[str, Any]:
    """`searches` SearchKnowledge calls in `mode` after WARMUP unmeasured ones, or as many as
    `cap_s` seconds allow (at least MIN_SEARCHES): the latency and mean number of results of
    those that answered, and the gRPC status codes of those that failed (e.g. UNAVAILABLE: a
    statement past LOOPLINE_DB_TIMEOUT_S)."""
    import grpc

    from loopline.tools.v1 import tools_pb2

    enum = {
        "keyword": tools_pb2.SEARCH_MODE_KEYWORD,
        "semantic": tools_pb2.SEARCH_MODE_SEMANTIC,
        "hybrid": tools_pb2.SEARCH_MODE_HYBRID,
    }[mode]
    seconds, results, failures = [], 0, Counter[str]()
    deadline = time.perf_counter() + cap_s
    for i in range(searches + WARMUP):
        if i >= WARMUP + MIN_SEARCHES and time.perf_counter() > deadline:
            break
        query = " ".join(filler.rng.choices(filler.words, k=3))
        t0 = time.perf_counter()
        try:
            found = await stub.SearchKnowledge(
                tools_pb2.SearchKnowledgeRequest(
                    organization_id=org,
                    query=query,
                    knowledge_base_ids=[base_id],
                    top_k=5,
                    mode=enum,
                ),
                timeout=60,
            )
        except grpc.aio.AioRpcError as exc:
            if i >= WARMUP:
                failures[exc.code().name] += 1
            continue
        if i >= WARMUP:
            seconds.append(time.perf_counter() - t0)
            results += len(found.results)
    return {
        "searches": len(seconds),
        "failures": dict(failures),
        **summary(seconds),
        "mean_results": rounded(results / max(1, len(seconds))),
    }


def _tools_database_url(dep: Deployment) -> str:
    """The tools service's database: its PostgreSQL URL, or the SQLite file in the data dir."""
    return (
        dep.env.get("LOOPLINE_TOOLS_DATABASE_URL")
        or f"sqlite+aiosqlite:///{dep.env['LOOPLINE_DATA_DIR']}/tools.db"
    )


async def workload_knowledge(
    dep: Deployment, documents: int, sizes: list[int], searches: int, cap_s: float
) -> dict[str, Any]:
    """Indexing throughput over `documents` ~5 KB documents, then search latency per mode at
    each of `sizes` chunks in one knowledge base, `searches` per mode or `cap_s` seconds of
    them (see the module docstring)."""
    import grpc

    from loopline.tools.v1 import tools_pb2, tools_pb2_grpc

    org = f"org_bench_knowledge_{uuid.uuid4().hex[:8]}"
    channel = grpc.aio.insecure_channel(
        dep.grpc_addr["tools"], options=[("grpc.enable_http_proxy", 0)]
    )
    stub = tools_pb2_grpc.ToolsServiceStub(channel)
    results: dict[str, Any] = {"search": {}}
    filler = None
    try:
        results["indexing"] = await _indexing(stub, org, documents) if documents else None
        base_id = (
            await stub.CreateKnowledgeBase(
                tools_pb2.CreateKnowledgeBaseRequest(organization_id=org, name="bench search"),
                timeout=30,
            )
        ).knowledge_base.knowledge_base_id
        filler = _Filler(_tools_database_url(dep), org, base_id, random.Random(20261205))
        for size in sorted(sizes):
            fill_s = await filler.fill_to(size)
            print(f"[bench]   knowledge base filled to {size} chunks (+{fill_s:.1f} s)", flush=True)
            level: dict[str, Any] = {"fill_s": rounded(fill_s)}
            for mode in MODES:
                level[mode] = await _searches(stub, org, base_id, filler, mode, searches, cap_s)
            results["search"][str(size)] = level
        # the later workloads search a table of their own size again
        t0 = time.perf_counter()
        await stub.DeleteKnowledgeBase(
            tools_pb2.DeleteKnowledgeBaseRequest(organization_id=org, knowledge_base_id=base_id),
            timeout=600,
        )
        results["delete_s"] = rounded(time.perf_counter() - t0)
    finally:
        if filler is not None:
            await filler.close()
        await channel.close()
    return results
