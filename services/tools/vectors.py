"""Chunk embeddings beside the chunks, compared by cosine similarity: one interface, two engines.

- SQLite: a float32 BLOB per chunk in `knowledge_vectors`, read at search time by sqlite-vec's
  `vec_distance_cosine` through a small pool of read-only `sqlean` connections (the standard
  library's sqlite3 cannot load extensions); the searches run in worker threads.
- PostgreSQL: a pgvector `vector` column compared with `<=>` (cosine distance).

Both scan the vectors of the knowledge bases searched (exact nearest neighbours, no
approximate index): results never depend on how an index was tuned, and the scope filter is
applied before ranking, so a small knowledge base among large ones still gets its own top k.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

if TYPE_CHECKING:
    import numpy as np

SQLITE_READERS = 4  # read-only sqlean connections kept for vector searches


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


class _SqliteReaders:
    """Read-only sqlean connections to one SQLite file with sqlite-vec loaded, lent to one
    worker thread at a time."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._idle: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._opened: list[Any] = []

    def _open(self) -> Any:
        import sqlean  # type: ignore[import-untyped]
        import sqlite_vec  # type: ignore[import-untyped]

        connection = sqlean.connect(
            f"file:{self._path}?mode=ro", uri=True, timeout=30, check_same_thread=False
        )
        connection.enable_load_extension(True)
        sqlite_vec.load(connection)
        connection.enable_load_extension(False)
        self._opened.append(connection)
        return connection

    @contextmanager
    def lend(self) -> Iterator[Any]:
        try:
            connection = self._idle.get_nowait()
        except queue.Empty:
            connection = self._open()
        try:
            yield connection
        finally:
            if len(self._opened) <= SQLITE_READERS:
                self._idle.put(connection)
            else:
                self._opened.remove(connection)
                connection.close()

    def close(self) -> None:
        for connection in self._opened:
            connection.close()
        self._opened.clear()


class VectorIndex:
    """Write chunk embeddings and rank chunks by cosine similarity to a query embedding.

    Args:
        engine: the tools service's engine (its dialect picks the engine; on SQLite its file).
        sessions: the service's session factory.
    """

    def __init__(self, engine: AsyncEngine, sessions: async_sessionmaker) -> None:
        self._dialect = engine.dialect.name
        self._sessions = sessions
        self._readers: _SqliteReaders | None = None
        if self._dialect == "sqlite":
            database = make_url(str(engine.url)).database
            if not database or database == ":memory:":
                raise ValueError("knowledge search on SQLite needs a database file")
            self._readers = _SqliteReaders(database)

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
        params["q"] = _float32(query)
        sql = (
            "SELECT chunk_id, 1 - vec_distance_cosine(embedding, :q) AS s FROM knowledge_vectors"
            f" WHERE knowledge_base_id IN {scope} AND model = :m ORDER BY s DESC LIMIT :k"
        )
        return await asyncio.to_thread(self._sqlite_rows, sql, params)

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
        params["q"] = _float32(query)
        sql = (
            "SELECT chunk_id, 1 - vec_distance_cosine(embedding, :q) FROM knowledge_vectors"
            f" WHERE chunk_id IN {ids} AND model = :m"
        )
        return dict(await asyncio.to_thread(self._sqlite_rows, sql, params))

    async def _pg_rows(self, sql: str, params: dict[str, Any]) -> list[tuple[int, float]]:
        async with self._sessions() as session:
            rows = (await session.execute(text(sql), params)).all()
        return [(int(r[0]), float(r[1])) for r in rows]

    def _sqlite_rows(self, sql: str, params: dict[str, Any]) -> list[tuple[int, float]]:
        assert self._readers is not None
        with self._readers.lend() as connection:
            rows = connection.execute(sql, params).fetchall()
        return [(int(r[0]), float(r[1])) for r in rows]

    def close(self) -> None:
        """Close the SQLite read connections (none on PostgreSQL)."""
        if self._readers is not None:
            self._readers.close()
