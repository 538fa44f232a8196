"""Chunk embeddings beside the chunks, compared by cosine similarity: one interface, two engines.

- SQLite: a float32 BLOB per chunk in `knowledge_vectors`, compared by sqlite-vec's
  `vec_distance_cosine` (loaded on every connection: `services.common.sqlite_driver`).
- PostgreSQL: a pgvector `vector` column compared with `<=>` (cosine distance).

Both scan the vectors of the knowledge bases searched (exact nearest neighbours, no
approximate index): results never depend on how an index was tuned, and the scope filter is
applied before ranking, so a small knowledge base among large ones still gets its own top k.
"""

from __future__ import annotations

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
    """A vector as sqlite-vec reads it: float32 values, native byte order."""
    import numpy  # here: a tools service that never embeds does not load it

    return numpy.asarray(vector, dtype=numpy.float32).tobytes()


def _pg_literal(vector: np.ndarray) -> str:
    """A vector as pgvector's text form, `[x,y,...]`."""
    return "[" + ",".join(f"{x:.7g}" for x in vector.tolist()) + "]"


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
        distance = self._distance(query, params)
        return await self._rows(
            f"SELECT chunk_id, 1 - {distance} FROM knowledge_vectors"
            f" WHERE knowledge_base_id IN {scope} AND model = :m ORDER BY {distance} LIMIT :k",
            params,
        )

    async def similarities(
        self, chunk_ids: Sequence[int], model: str, query: np.ndarray
    ) -> dict[int, float]:
        """The cosine similarity to `query` of each of `chunk_ids` that has a `model` vector."""
        if not chunk_ids:
            return {}
        params: dict[str, Any] = {"m": model}
        ids = _in([int(c) for c in chunk_ids], "c", params)
        distance = self._distance(query, params)
        sql = f"SELECT chunk_id, 1 - {distance} FROM knowledge_vectors WHERE chunk_id IN {ids}"
        return dict(await self._rows(f"{sql} AND model = :m", params))

    def _distance(self, query: np.ndarray, params: dict[str, Any]) -> str:
        """The SQL cosine distance of `embedding` to `query` (bound in `params` as `q`)."""
        if self._dialect == "postgresql":
            params["q"] = _pg_literal(query)
            return "(embedding <=> CAST(:q AS vector))"
        params["q"] = _float32(query)
        return "vec_distance_cosine(embedding, :q)"

    async def _rows(self, sql: str, params: dict[str, Any]) -> list[tuple[int, float]]:
        async with self._sessions() as session:
            rows = (await session.execute(text(sql), params)).all()
        return [(int(r[0]), float(r[1])) for r in rows]
