"""Chunk embeddings beside the chunks, compared by cosine similarity: one interface, two engines.

- SQLite: a float32 BLOB per chunk in `knowledge_vectors`, read through the service's own
  connections and compared with numpy in a worker thread. (A second SQLite library in the
  process, such as sqlean to load sqlite-vec, is unsafe: POSIX locks are per process, so each
  library can drop the other's locks or remove the WAL index it has mapped.)
- PostgreSQL: a pgvector `vector` column compared with `<=>` (cosine distance).

Both scan the vectors of the knowledge bases searched (exact nearest neighbours, no
approximate index): results never depend on how an index was tuned, and the scope filter is
applied before ranking, so a small knowledge base among large ones still gets its own top k.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

if TYPE_CHECKING:
    import numpy as np


def _in(names: Sequence[Any], prefix: str, params: dict[str, Any]) -> str:
    """`(:prefix0, :prefix1, ...)` for `names`, each bound in `params`."""
    keys = []
    for i, value in enumerate(names):
        params[f"{prefix}{i}"] = value
        keys.append(f":{prefix}{i}")
    return f"({', '.join(keys)})"


def _float32(vector: np.ndarray) -> bytes:
    """A vector as stored on SQLite: float32 values, native byte order."""
    import numpy  # here: a tools service that never embeds does not load it

    return numpy.asarray(vector, dtype=numpy.float32).tobytes()


def _pg_literal(vector: np.ndarray) -> str:
    """A vector as pgvector's text form, `[x,y,...]`."""
    return "[" + ",".join(f"{x:.7g}" for x in vector.tolist()) + "]"


def _ranked(rows: list[Any], query: np.ndarray, k: int | None) -> list[tuple[int, float]]:
    """(chunk_id, cosine similarity) of `rows` (chunk_id, float32 BLOB) to `query`, the `k`
    most similar first (all, unordered, when `k` is None)."""
    import numpy

    if not rows:
        return []
    matrix = numpy.frombuffer(b"".join(r[1] for r in rows), dtype=numpy.float32)
    matrix = matrix.reshape(len(rows), -1)
    q = numpy.asarray(query, dtype=numpy.float32)
    norms = numpy.linalg.norm(matrix, axis=1) * float(numpy.linalg.norm(q))
    similarity = (matrix @ q) / numpy.where(norms == 0, 1, norms)
    order: list[int] = list(range(len(rows)))
    if k is not None:
        top = numpy.argpartition(-similarity, min(k, len(rows)) - 1)[:k]
        order = sorted(top.tolist(), key=lambda i: -similarity[i])
    return [(int(rows[i][0]), float(similarity[i])) for i in order]


class VectorIndex:
    """Write chunk embeddings and rank chunks by cosine similarity to a query embedding.

    Args:
        engine: the tools service's engine (its dialect picks the engine; on SQLite its file).
        sessions: the service's session factory.
    """

    def __init__(self, engine: AsyncEngine, sessions: async_sessionmaker) -> None:
        self._dialect = engine.dialect.name
        self._sessions = sessions

    async def write(
        self, session: AsyncSession, model: str, rows: list[tuple[int, str, Any]]
    ) -> None:
        """Store `(chunk_id, document_id, vector)` rows of `model` in `session`, each only while
        that chunk still belongs to that document (a deleted document's ids may be reused by a
        new one's chunks, which must never get its vectors); a chunk that already has a vector
        keeps it (another replica wrote the same)."""
        if not rows:
            return
        if self._dialect == "postgresql":
            value, conflict = "CAST(:e AS vector)", " ON CONFLICT (chunk_id) DO NOTHING"
            values = [{"c": c, "d": d, "m": model, "e": _pg_literal(v)} for c, d, v in rows]
        else:
            value, conflict = ":e", " ON CONFLICT (chunk_id) DO NOTHING"
            values = [{"c": c, "d": d, "m": model, "e": _float32(v)} for c, d, v in rows]
        await session.execute(
            text(
                "INSERT INTO knowledge_vectors (chunk_id, knowledge_base_id, model, embedding)"
                f" SELECT id, knowledge_base_id, :m, {value} FROM knowledge_chunks"
                f" WHERE id = :c AND document_id = :d{conflict}"
            ),
            values,
        )

    async def nearest(
        self, knowledge_base_ids: Sequence[str], model: str, query: np.ndarray, k: int
    ) -> list[tuple[int, float]]:
        """The `k` chunks of the knowledge bases whose `model` vectors are closest to `query`,
        as (chunk_id, cosine similarity), most similar first."""
        params: dict[str, Any] = {"m": model, "k": k}
        scope = _in(knowledge_base_ids, "kb", params)
        if self._dialect == "postgresql":
            params["q"] = _pg_literal(query)
            sql = (
                "SELECT chunk_id, 1 - (embedding <=> CAST(:q AS vector)) FROM knowledge_vectors"
                f" WHERE knowledge_base_id IN {scope} AND model = :m"
                " ORDER BY embedding <=> CAST(:q AS vector) LIMIT :k"
            )
            return await self._pg_rows(sql, params)
        sql = (
            "SELECT chunk_id, embedding FROM knowledge_vectors"
            f" WHERE knowledge_base_id IN {scope} AND model = :m"
        )
        return await asyncio.to_thread(_ranked, await self._blobs(sql, params), query, k)

    async def similarities(
        self, chunk_ids: Sequence[int], model: str, query: np.ndarray
    ) -> dict[int, float]:
        """The cosine similarity to `query` of each of `chunk_ids` that has a `model` vector."""
        if not chunk_ids:
            return {}
        params: dict[str, Any] = {"m": model}
        ids = _in([int(c) for c in chunk_ids], "c", params)
        if self._dialect == "postgresql":
            params["q"] = _pg_literal(query)
            sql = (
                "SELECT chunk_id, 1 - (embedding <=> CAST(:q AS vector)) FROM knowledge_vectors"
                f" WHERE chunk_id IN {ids} AND model = :m"
            )
            return dict(await self._pg_rows(sql, params))
        sql = (
            "SELECT chunk_id, embedding FROM knowledge_vectors"
            f" WHERE chunk_id IN {ids} AND model = :m"
        )
        return dict(await asyncio.to_thread(_ranked, await self._blobs(sql, params), query, None))

    async def _pg_rows(self, sql: str, params: dict[str, Any]) -> list[tuple[int, float]]:
        async with self._sessions() as session:
            rows = (await session.execute(text(sql), params)).all()
        return [(int(r[0]), float(r[1])) for r in rows]

    async def _blobs(self, sql: str, params: dict[str, Any]) -> list[Any]:
        params.pop("k", None)
        async with self._sessions() as session:
            return list((await session.execute(text(sql), params)).all())
