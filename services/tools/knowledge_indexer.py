"""Embed the chunks of new documents in the background, so an upload answers at once.

A document is added with status "processing": its chunks are keyword-searchable at once, and
this indexer embeds them in batches of BATCH (the model runs in a worker thread, so the event
loop keeps serving), writes the vectors, and marks the document "ready" once all its chunks
have one. A document whose model refuses it is marked "failed" with a message built from known
causes. The work list is the database itself (documents still "processing"), so a restart
resumes where the last process stopped, and replicas running the same indexer only repeat
work (a vector already written is kept).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import async_sessionmaker

from services.tools.vectors import VectorIndex

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

BATCH = 16  # chunks embedded per model call (a few seconds of CPU for the local model)
RETRY_S = 5.0  # wait after an unexpected failure before trying again
LOCAL_PROVIDER, LOCAL_MODEL, LOCAL_DIMENSIONS = "local", "all-MiniLM-L6-v2", 384


class Embedder(Protocol):
    """What the indexer and the search need of an embedding model."""

    provider: str
    model: str
    dimensions: int

    async def embed(self, texts: list[str]) -> np.ndarray: ...


class EmbeddingUnavailable(Exception):
    """The model cannot embed now; `str()` is safe to show (built from known causes)."""


@dataclass(frozen=True)
class EmbeddingSpec:
    """A knowledge base's embedding model: the local one, or an OpenAI-compatible API used
    with the organization's credential."""

    provider: str = LOCAL_PROVIDER
    model: str = LOCAL_MODEL
    dimensions: int = LOCAL_DIMENSIONS
    credential_id: str = ""

    @classmethod
    def of(cls, base: Any) -> EmbeddingSpec:
        """The spec of a knowledge base row."""
        return cls(
            base.embedding_provider,
            base.embedding_model,
            base.embedding_dimensions,
            base.embedding_credential_id or "",
        )


EmbedderFor = Callable[[str, EmbeddingSpec], Awaitable[Embedder]]
"""`(organization_id, spec) -> Embedder`; raises EmbeddingUnavailable."""

_PENDING = text(
    "SELECT c.id, c.content, c.document_id, b.id, b.org_id, b.embedding_provider,"
    " b.embedding_model, b.embedding_dimensions, b.embedding_credential_id"
    " FROM knowledge_chunks c"
    " JOIN knowledge_documents d ON d.id = c.document_id"
    " JOIN knowledge_bases b ON b.id = c.knowledge_base_id"
    " WHERE d.status = 'processing' AND NOT EXISTS (SELECT 1 FROM knowledge_vectors v"
    "  WHERE v.chunk_id = c.id AND v.model = b.embedding_model)"
    " ORDER BY c.id LIMIT :n"
)
# A processing document whose every chunk has a vector of its base's model is ready.
_SETTLE = text(
    "UPDATE knowledge_documents SET status = 'ready' WHERE status = 'processing'"
    " AND NOT EXISTS (SELECT 1 FROM knowledge_chunks c"
    "  JOIN knowledge_bases b ON b.id = c.knowledge_base_id"
    "  WHERE c.document_id = knowledge_documents.id AND NOT EXISTS (SELECT 1"
    "   FROM knowledge_vectors v WHERE v.chunk_id = c.id AND v.model = b.embedding_model))"
)


class Indexer:
    """The background task that embeds pending chunks; `kick()` after adding a document."""

    def __init__(
        self, sessions: async_sessionmaker, vectors: VectorIndex, embedder_for: EmbedderFor
    ) -> None:
        self._sessions = sessions
        self._vectors = vectors
        self._embedder_for = embedder_for
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None

    def kick(self) -> None:
        """Look for pending chunks now (starts the task on first use)."""
        self._idle.clear()
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="knowledge-indexer")

    async def wait_idle(self) -> None:
        """Return once nothing is pending (tests, the re-embed command)."""
        await self._idle.wait()

    async def stop(self) -> None:
        """Cancel the task; what it had not written is picked up by the next start."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._idle.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                while await self.step():
                    pass
            except Exception:  # noqa: BLE001 - the indexer must outlive a bad batch
                log.exception("knowledge indexing failed; retrying")
                await asyncio.sleep(RETRY_S)
                self._wake.set()
                continue
            if not self._wake.is_set():
                self._idle.set()

    async def step(self) -> bool:
        """Embed one batch of pending chunks; False when none was pending."""
        async with self._sessions() as session:
            rows = (await session.execute(_PENDING, {"n": BATCH})).all()
        if not rows:
            async with self._sessions() as session, session.begin():
                await session.execute(_SETTLE)
            return False
        groups: dict[tuple[str, str, EmbeddingSpec], list[Any]] = {}
        for row in rows:
            spec = EmbeddingSpec(row[5], row[6], row[7], row[8] or "")
            groups.setdefault((row[3], row[4], spec), []).append(row)
        for (base_id, org_id, spec), group in groups.items():
            try:
                embedder = await self._embedder_for(org_id, spec)
                vectors = await embedder.embed([r[1] for r in group])
            except EmbeddingUnavailable as exc:
                await self._fail({r[2] for r in group}, str(exc))
                continue
            await self._write(
                base_id, spec.model, [(r[0], v) for r, v in zip(group, vectors, strict=True)]
            )
        async with self._sessions() as session, session.begin():
            await session.execute(_SETTLE)
        return True

    async def _write(self, base_id: str, model: str, rows: list[tuple[int, Any]]) -> None:
        """Replace the vectors of these chunks; chunks deleted meanwhile are skipped."""
        for attempt in range(2):
            try:
                async with self._sessions() as session, session.begin():
                    ids = ", ".join(str(int(c)) for c, _ in rows)
                    await session.execute(
                        text(f"DELETE FROM knowledge_vectors WHERE chunk_id IN ({ids})")
                    )
                    await self._vectors.write(session, base_id, model, rows)
                return
            except IntegrityError:
                if attempt:
                    raise
                async with self._sessions() as session:
                    ids = ", ".join(str(int(c)) for c, _ in rows)
                    alive = set(
                        (
                            await session.scalars(
                                text(f"SELECT id FROM knowledge_chunks WHERE id IN ({ids})")
                            )
                        ).all()
                    )
                rows = [(c, v) for c, v in rows if c in alive]
                if not rows:
                    return

    async def _fail(self, document_ids: set[str], message: str) -> None:
        async with self._sessions() as session, session.begin():
            for document_id in document_ids:
                await session.execute(
                    text(
                        "UPDATE knowledge_documents SET status = 'failed', error_message = :m"
                        " WHERE id = :d AND status = 'processing'"
                    ),
                    {"m": message[:500], "d": document_id},
                )
        log.warning(
            "knowledge documents not embedded",
            extra={"fields": {"documents": len(document_ids), "reason": message[:200]}},
        )
