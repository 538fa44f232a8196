"""Measure knowledge search on a labelled question set: recall@5 and MRR@10 for each mode.

The set (tests/tools/knowledge_eval/) is a frozen copy of ten of Loopline's docs and questions
in a user's words, each labelled with its document and a phrase of the passage that answers
it. A hit is relevant when it comes from that document and contains the phrase (whitespace
normalised; chunks overlap, so any chunk holding it counts). recall@5 is the share of
questions with a relevant hit in the top 5; MRR@10 the mean of 1/rank of the first relevant
hit in the top 10 (0 when none). Both the quality test and this script use it:

    .venv/bin/python -m services.tools.knowledge_eval [--verbose] [--postgres-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from services.common import db
from services.tools.knowledge import KnowledgeStore
from services.tools.knowledge_search import SearchHit

EVAL_DIR = Path(__file__).resolve().parents[2] / "tests" / "tools" / "knowledge_eval"
MODES = ("keyword", "semantic", "hybrid")
RECALL_K, MRR_K = 5, 10
ORG = "org-knowledge-eval"
INDEX_TIMEOUT_S = 600.0
_SPACES = re.compile(r"\s+")


@dataclass(frozen=True)
class Question:
    """A question, the document that answers it and a phrase of the answering passage."""

    question: str
    document: str
    answer: str
    kind: str = "paraphrase"


@dataclass
class ModeResult:
    """Each question's rank of its first relevant hit (None: not in the top MRR_K)."""

    mode: str
    ranks: list[int | None] = field(default_factory=list)
    search_s: list[float] = field(default_factory=list)

    @property
    def recall(self) -> float:
        return sum(1 for r in self.ranks if r is not None and r <= RECALL_K) / len(self.ranks)

    @property
    def mrr(self) -> float:
        return sum(1 / r for r in self.ranks if r is not None) / len(self.ranks)


@dataclass
class Evaluation:
    """The questions, one ModeResult per mode, and what indexing the corpus took."""

    questions: list[Question]
    results: dict[str, ModeResult]
    documents: int
    chunks: int
    index_s: float


def normalise(text: str) -> str:
    return _SPACES.sub(" ", text).strip()


def load_questions(path: Path = EVAL_DIR / "questions.json") -> list[Question]:
    return [Question(**item) for item in json.loads(path.read_text())]


def load_corpus(folder: Path = EVAL_DIR / "corpus") -> dict[str, str]:
    """{file name: text} of the corpus's markdown documents."""
    return {p.name: p.read_text() for p in sorted(folder.glob("*.md"))}


def first_relevant(hits: list[SearchHit], question: Question) -> int | None:
    """The 1-based rank of the first hit of `hits` relevant to `question`, None when none is."""
    phrase = normalise(question.answer)
    for rank, hit in enumerate(hits, start=1):
        if hit.document_name == question.document and phrase in normalise(hit.content):
            return rank
    return None


async def index_corpus(store: KnowledgeStore, corpus: dict[str, str]) -> tuple[str, int]:
    """A new knowledge base holding `corpus`, once every document is "ready" (embedded):
    its id and chunk count. Raises RuntimeError when a document ends otherwise."""
    base, _ = await store.create_base(ORG, "knowledge eval")
    for name, content in corpus.items():
        await store.add_document(ORG, base.id, name, content, "text/markdown")
    await asyncio.wait_for(store.indexer.wait_idle(), INDEX_TIMEOUT_S)
    documents = await store.list_documents(ORG, base.id, limit=len(corpus))
    unready = sorted(f"{d.name}: {d.status}" for d in documents if d.status != "ready")
    if unready or len(documents) != len(corpus):
        raise RuntimeError(f"documents not indexed: {unready or len(documents)}")
    return base.id, sum(d.chunk_count for d in documents)


async def evaluate(
    store: KnowledgeStore,
    questions: list[Question],
    corpus: dict[str, str],
    modes: tuple[str, ...] = MODES,
) -> Evaluation:
    """Index `corpus` into `store`, then ask every question in every mode."""
    started = time.perf_counter()
    base_id, chunks = await index_corpus(store, corpus)
    index_s = time.perf_counter() - started
    results = {}
    for mode in modes:
        result = results[mode] = ModeResult(mode)
        for q in questions:
            t0 = time.perf_counter()
            hits = await store.search(ORG, q.question, [base_id], MRR_K, mode=mode)
            result.search_s.append(time.perf_counter() - t0)
            result.ranks.append(first_relevant(hits, q))
    return Evaluation(questions, results, len(corpus), chunks, index_s)


async def evaluate_database(url: str, modes: tuple[str, ...] = MODES) -> Evaluation:
    """`evaluate` the shipped set on a migrated, empty tools database at `url`."""
    engine = db.make_engine(url)
    store = KnowledgeStore(engine, db.sessionmaker(engine))
    try:
        return await evaluate(store, load_questions(), load_corpus(), modes)
    finally:
        await store.close()
        await engine.dispose()


def report(evaluation: Evaluation, verbose: bool = False) -> str:
    """The table of recall@5 and MRR@10 per mode (and per kind of question), and with
    `verbose` each question a mode did not find in its top 5."""
    questions = evaluation.questions
    kinds = sorted({q.kind for q in questions})
    lines = [
        f"{len(questions)} questions, {evaluation.documents} documents, {evaluation.chunks}"
        f" chunks, indexed in {evaluation.index_s:.1f} s",
        f"{'mode':<9} {'recall@5':>8} {'MRR@10':>7} {'p50 ms':>7}  "
        + "  ".join(f"r@5 {k} ({sum(q.kind == k for q in questions)})" for k in kinds),
    ]
    for mode, result in evaluation.results.items():
        per_kind = []
        for kind in kinds:
            ranks = [r for r, q in zip(result.ranks, questions, strict=True) if q.kind == kind]
            found = sum(1 for r in ranks if r is not None and r <= RECALL_K)
            per_kind.append(f"{found / len(ranks):>{len(kind) + 9}.2f}")
        p50 = sorted(result.search_s)[len(result.search_s) // 2] * 1000
        lines.append(
            f"{mode:<9} {result.recall:>8.3f} {result.mrr:>7.3f} {p50:>7.1f}  "
            + "  ".join(per_kind)
        )
    if verbose:
        for mode, result in evaluation.results.items():
            lines.append(f"\nnot in the top {RECALL_K}, {mode}:")
            for rank, q in zip(result.ranks, questions, strict=True):
                if rank is None or rank > RECALL_K:
                    where = f"rank {rank}" if rank else f"not in top {MRR_K}"
                    lines.append(f"  [{where}] ({q.kind}, {q.document}) {q.question}")
    return "\n".join(lines)


async def _run(args: argparse.Namespace) -> Evaluation:
    """Evaluate on a fresh SQLite file, or a throwaway database of `args.postgres_url`."""
    if not args.postgres_url:
        with tempfile.TemporaryDirectory() as folder:
            url = f"sqlite+aiosqlite:///{folder}/tools.db"
            await db.migrate_async("tools", url)
            return await evaluate_database(url)
    import asyncpg  # noqa: PLC0415 - PostgreSQL only

    server = args.postgres_url.replace("postgresql+asyncpg://", "postgresql://", 1)
    name = f"loopline_knowledge_eval_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(server)
    await admin.execute(f'CREATE DATABASE "{name}"')
    try:
        base = server.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://", 1)
        url = f"{base}/{name}"
        await db.migrate_async("tools", url)
        return await evaluate_database(url)
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m services.tools.knowledge_eval", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--verbose", action="store_true", help="list each mode's misses")
    parser.add_argument(
        "--postgres-url",
        default="",
        help="evaluate on a throwaway database of this PostgreSQL server"
        " (e.g. postgresql://postgres@127.0.0.1:5432/test); default: a temporary SQLite file",
    )
    args = parser.parse_args(argv)
    print(report(asyncio.run(_run(args)), args.verbose))
    return 0


if __name__ == "__main__":
    sys.exit(main())
