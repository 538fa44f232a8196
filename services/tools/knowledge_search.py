"""Rank an organization's chunks against a query: keyword, semantic, or both fused (hybrid).

Scores are between 0 and 1 and mean the same whatever the corpus, so `min_score` can be set
once:
- semantic_score: the cosine similarity of the query's and the chunk's embeddings (a negative
  one counts as 0). With the local model, about 0.5 and up is on topic, 0.7 and up close.
- keyword_score: the share of the query's words (common English words aside; words stemmed as
  the engines stem them, accents removed) that the chunk contains, each word weighted by its
  rarity in the knowledge bases searched (BM25's IDF, ln(1 + (N - n + 0.5) / (n + 0.5))): 1.0
  when it has them all.
- hybrid: (semantic_weight * semantic_score + keyword_weight * keyword_score) divided by the
  sum of the weights (0.7 and 0.3 by default), over the union of both rankings' candidates.

Candidates come from the engines (FTS5 BM25 or PostgreSQL `ts_rank_cd` for keywords, the
vector index for meaning), CANDIDATES or 4 x top_k from each; the scores above then order them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import grpc
import snowballstemmer  # type: ignore[import-untyped]
from sqlalchemy import text
from sqlalchemy.ext.asyncio import async_sessionmaker

from services.common.errors import TOOLS_DOMAIN, RpcError
from services.tools.knowledge_indexer import EmbedderFor, EmbeddingSpec, EmbeddingUnavailable
from services.tools.vectors import VectorIndex

log = logging.getLogger(__name__)

MODES = ("hybrid", "semantic", "keyword")
CANDIDATES = 50  # at least this many candidates from each ranking
MAX_TERMS = 32
DF_CAP = 1000  # a word's chunk count is counted up to this (rarer words are what weighs)
_TOKEN = re.compile(r"\w+", re.UNICODE)
STOP_WORDS = frozenset(
    "a an and are as at be but by can could do does did for from has have how i if in into is"
    " it its me my no not of on or our should so than that the their them then there these"
    " they this to was we what when where which who why will with would you your".split()
)


_STEMMER = snowballstemmer.stemmer("english")


@functools.lru_cache(maxsize=65536)
def _fold(word: str) -> str:
    """`word` as the full-text engines index it, near enough: lower case, accents removed,
    stemmed by the Snowball English stemmer ("encryption" and "encrypted" are both
    "encrypt"). Cached: a search folds the words of a few hundred chunks."""
    bare = unicodedata.normalize("NFKD", word.lower())
    bare = "".join(c for c in bare if not unicodedata.combining(c))
    return str(_STEMMER.stemWord(bare))


def query_terms(query: str) -> list[str]:
    """The query's words, lower case, deduplicated, at most MAX_TERMS: common words left out
    unless the query has nothing else."""
    words = list(dict.fromkeys(_TOKEN.findall(query.lower())))
    content = [w for w in words if w not in STOP_WORDS]
    return (content or words)[:MAX_TERMS]


def term_weights(frequencies: dict[str, int], chunks: int) -> dict[str, float]:
    """Each query word's weight from `frequencies` (chunks holding it, of `chunks`): BM25's
    IDF, always above 0, higher for rarer words; keyed by the folded word."""
    weights: dict[str, float] = {}
    for term, n in frequencies.items():
        weight = math.log(1 + (max(chunks, n) - n + 0.5) / (n + 0.5))
        weights[_fold(term)] = max(weights.get(_fold(term), 0.0), weight)
    return weights


def keyword_score(weights: dict[str, float], content: str) -> float:
    """The weighted share of the (folded) words of `weights` that `content` holds (0 to 1)."""
    total = sum(weights.values())
    if not total:
        return 0.0
    found = {_fold(w) for w in _TOKEN.findall(content)} & weights.keys()
    return sum(weights[w] for w in found) / total


@dataclass(frozen=True)
class SearchHit:
    """One ranked chunk with its scores (all 0 to 1)."""

    knowledge_base_id: str
    document_id: str
    document_name: str
    chunk_id: str
    chunk_index: int
    content: str
    score: float
    semantic_score: float = 0.0
    keyword_score: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """The shape search_knowledge returns for one result."""
        return {
            "knowledge_base_id": self.knowledge_base_id,
            "document_id": self.document_id,
            "document_name": self.document_name,
            "chunk_id": self.chunk_id,
            "chunk_index": self.chunk_index,
            "content": self.content,
            "score": round(self.score, 4),
            "semantic_score": round(self.semantic_score, 4),
            "keyword_score": round(self.keyword_score, 4),
        }


def _scored(
    rows: dict[int, Any],
    semantic: dict[int, float],
    word_weights: dict[str, float],
    mode: str,
    weights: tuple[float, float],
) -> list[SearchHit]:
    """Every candidate with its scores (in a worker thread: reading each candidate's words
    takes milliseconds for a few hundred chunks)."""
    total = weights[0] + weights[1]
    hits = []
    for chunk_id, row in rows.items():
        sem = max(0.0, min(1.0, semantic.get(chunk_id, 0.0)))
        kw = keyword_score(word_weights, row[5]) if mode != "semantic" else 0.0
        score = {"semantic": sem, "keyword": kw}.get(
            mode, (weights[0] * sem + weights[1] * kw) / total
        )
        hits.append(
            SearchHit(row[1], row[2], row[3], str(chunk_id), int(row[4]), row[5], score, sem, kw)
        )
    return hits


def _in(values: Iterable[Any], prefix: str, params: dict[str, Any]) -> str:
    keys = []
    for i, value in enumerate(values):
        params[f"{prefix}{i}"] = value
        keys.append(f":{prefix}{i}")
    return f"({', '.join(keys)})"


class KnowledgeSearch:
    """The three rankings over the tools database (see the module docstring)."""

    def __init__(
        self,
        dialect: str,
        sessions: async_sessionmaker,
        vectors: VectorIndex,
        embedder_for: EmbedderFor,
    ) -> None:
        self._dialect = dialect
        self._sessions = sessions
        self._vectors = vectors
        self._embedder_for = embedder_for

    async def search(
        self,
        org_id: str,
        query: str,
        bases: dict[str, EmbeddingSpec],
        top_k: int,
        mode: str = "hybrid",
        weights: tuple[float, float] = (0.7, 0.3),
        min_score: float = 0.0,
    ) -> list[SearchHit]:
        """The `top_k` best chunks of `bases` (the organization's, id -> spec) for `query`,
        best first, each scoring at least `min_score`."""
        terms = query_terms(query)
        if not terms or not bases:
            return []
        wanted = max(CANDIDATES, 4 * top_k)
        keyword_ids = (
            await self._keyword_candidates(terms, list(bases), wanted) if mode != "semantic" else []
        )
        semantic: dict[int, float] = {}
        queries: dict[EmbeddingSpec, Any] = {}
        if mode != "keyword":
            queries = await self._query_vectors(org_id, query, set(bases.values()), mode)
            for spec, vector in queries.items():
                ids = [b for b, s in bases.items() if s == spec]
                semantic.update(await self._vectors.nearest(ids, spec.model, vector, wanted))
        rows = await self._chunks(set(keyword_ids) | set(semantic))
        if mode == "hybrid":
            missing = [c for c in rows if c not in semantic]
            for spec, vector in queries.items():
                semantic.update(await self._vectors.similarities(missing, spec.model, vector))
        keyword_rank = {c: i for i, c in enumerate(keyword_ids)}
        word_weights = await self._term_weights(terms, list(bases)) if mode != "semantic" else {}
        hits = await asyncio.to_thread(_scored, rows, semantic, word_weights, mode, weights)
        hits = [h for h in hits if h.score >= min_score]
        hits.sort(
            key=lambda h: (-h.score, keyword_rank.get(int(h.chunk_id), wanted), int(h.chunk_id))
        )
        return hits[:top_k]

    async def _term_weights(self, terms: list[str], base_ids: list[str]) -> dict[str, float]:
        """term_weights of `terms` over the chunks of `base_ids` (one statement)."""
        params: dict[str, Any] = {"cap": DF_CAP}
        scope = _in(base_ids, "kb", params)
        counts = []
        for i, term in enumerate(terms):
            params[f"t{i}"] = (
                '"' + term.replace('"', '""') + '"' if self._dialect == "sqlite" else term
            )
            if self._dialect == "sqlite":
                matching = (
                    "SELECT 1 FROM knowledge_chunks_fts JOIN knowledge_chunks c ON"
                    f" c.id = knowledge_chunks_fts.rowid WHERE knowledge_chunks_fts MATCH :t{i}"
                )
            else:
                matching = (
                    "SELECT 1 FROM knowledge_chunks c"
                    f" WHERE c.content_tsv @@ plainto_tsquery('english', :t{i})"
                )
            counts.append(
                f"SELECT {i}, count(*) FROM ({matching} AND c.knowledge_base_id IN {scope}"
                " LIMIT :cap) AS m"
            )
        total = (
            "SELECT -1, coalesce(sum(chunk_count), 0) FROM knowledge_documents"
            f" WHERE knowledge_base_id IN {scope}"
        )
        async with self._sessions() as session:
            rows = (await session.execute(text(" UNION ALL ".join([total, *counts])), params)).all()
        found = {int(r[0]): int(r[1]) for r in rows}
        return term_weights({t: found.get(i, 0) for i, t in enumerate(terms)}, found.get(-1, 0))

    async def _query_vectors(
        self, org_id: str, query: str, specs: set[EmbeddingSpec], mode: str
    ) -> dict[EmbeddingSpec, Any]:
        """The query embedded by each model. The knowledge bases of a model that cannot answer
        are ranked by keywords alone in a hybrid search and left out of a semantic one, which
        fails (FAILED_PRECONDITION EMBEDDINGS_UNAVAILABLE, with the model's known reason) only
        when no model answers."""
        vectors: dict[EmbeddingSpec, Any] = {}
        reasons: list[str] = []
        for spec in specs:
            try:
                embedder = await self._embedder_for(org_id, spec)
                vectors[spec] = (await embedder.embed([query]))[0]
            except EmbeddingUnavailable as exc:
                reasons.append(f"{spec.model}: {exc}")
                log.warning(
                    "query not embedded; keyword ranking only",
                    extra={"fields": {"model": spec.model, "reason": str(exc)[:200]}},
                )
        if mode == "semantic" and not vectors:
            raise RpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "EMBEDDINGS_UNAVAILABLE",
                "The embedding model cannot embed the query, so a semantic search cannot rank"
                f" (keyword and hybrid search still can): {'; '.join(reasons)[:500]}",
                domain=TOOLS_DOMAIN,
            )
        return vectors

    async def _keyword_candidates(self, terms: list[str], base_ids: list[str], n: int) -> list[int]:
        """Chunk ids of `base_ids` matching any of `terms`, best first by the engine's rank."""
        params: dict[str, Any] = {"k": n}
        scope = _in(base_ids, "kb", params)
        if self._dialect == "sqlite":
            # Each term quoted (FTS5 syntax characters are inert inside quotes), any may match.
            params["match"] = " OR ".join('"' + t.replace('"', '""') + '"' for t in terms)
            sql = (
                "SELECT c.id FROM knowledge_chunks_fts JOIN knowledge_chunks c"
                " ON c.id = knowledge_chunks_fts.rowid WHERE knowledge_chunks_fts MATCH :match"
                f" AND c.knowledge_base_id IN {scope} ORDER BY bm25(knowledge_chunks_fts) LIMIT :k"
            )
        else:
            params["tsq"] = " | ".join(terms)
            sql = (
                "SELECT c.id FROM knowledge_chunks c WHERE c.content_tsv"
                " @@ to_tsquery('english', :tsq)"
                f" AND c.knowledge_base_id IN {scope} ORDER BY ts_rank_cd("
                "c.content_tsv, to_tsquery('english', :tsq)) DESC LIMIT :k"
            )
        async with self._sessions() as session:
            return [int(r[0]) for r in (await session.execute(text(sql), params)).all()]

    async def _chunks(self, chunk_ids: set[int]) -> dict[int, Any]:
        """id -> (id, knowledge_base_id, document_id, document name, chunk_index, content)."""
        if not chunk_ids:
            return {}
        params: dict[str, Any] = {}
        ids = _in(sorted(chunk_ids), "c", params)
        sql = (
            "SELECT c.id, c.knowledge_base_id, c.document_id, d.name, c.chunk_index, c.content"
            " FROM knowledge_chunks c JOIN knowledge_documents d ON d.id = c.document_id"
            f" WHERE c.id IN {ids}"
        )
        async with self._sessions() as session:
            return {int(r[0]): r for r in (await session.execute(text(sql), params)).all()}
