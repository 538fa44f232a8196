"""Embed the chunks of new documents in the background, so an upload answers at once.

A document is added with status "processing": its chunks are keyword-searchable at once, and
this indexer embeds them in batches of BATCH (the model runs in a worker thread, so the event
loop keeps serving), writes the vectors, and marks the document "ready" once all its chunks
have one. Each round takes one batch of every pending document in turn, so a small upload is
not queued behind a large one. A model that refuses a document for good (a key refused) marks
it "failed" with a message built from known causes; one that cannot answer now (down, rate
limited) is asked again after RETRY_S, the document staying "processing" with the reason in its
error_message. The work list is the database itself (documents still "processing", looked at
again every POLL_S), so a restart resumes where the last process stopped, and replicas running
the same indexer only repeat work (a vector already written is kept).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy import DateTime, bindparam, text
from sqlalchemy.ext.asyncio import async_sessionmaker

from services.tools.models import utcnow
from services.tools.vectors import VectorIndex

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

BATCH = 16  # chunks embedded per model call (a few seconds of CPU for the local model)
RETRY_S = 5.0  # wait after a failure before trying again
POLL_S = 30.0  # look for work other processes left (a re-embed command, a stopped replica)
LOCAL_PROVIDER, LOCAL_MODEL, LOCAL_DIMENSIONS = "local", "all-MiniLM-L6-v2", 384


class Embedder(Protocol):
    """What the indexer and the search need of an embedding model."""

    provider: str
    model: str
    dimensions: int

    async def embed(self, texts: list[str]) -> np.ndarray: ...


class EmbeddingUnavailable(Exception):
    """The model cannot embed; `str()` is safe to show (built from known causes). `permanent`:
    asking again will not help (a key refused); otherwise it may (down, rate limited)."""

    def __init__(self, message: str, permanent: bool = True) -> None:
        super().__init__(message)
        self.permanent = permanent


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

_PENDING_DOCUMENTS = (
    "SELECT d.id FROM knowledge_documents d WHERE d.status = 'processing'{scope}"
    " ORDER BY d.created_at, d.id"
)
_PENDING = text(
    "SELECT c.id, c.content, c.document_id, b.id, b.org_id, b.embedding_provider,"
    " b.embedding_model, b.embedding_dimensions, b.embedding_credential_id"
    " FROM knowledge_chunks c JOIN knowledge_bases b ON b.id = c.knowledge_base_id"
    " WHERE c.document_id = :d AND NOT EXISTS (SELECT 1 FROM knowledge_vectors v"
    "  WHERE v.chunk_id = c.id AND v.model = b.embedding_model)"
    " ORDER BY c.id LIMIT :n"
)
# A processing document whose every chunk has a vector of its base's model is ready.
_SETTLE = text(
    "UPDATE knowledge_documents SET status = 'ready', error_message = NULL, indexed_at = :now"
    " WHERE status = 'processing'"
    " AND NOT EXISTS (SELECT 1 FROM knowledge_chunks c"
    "  JOIN knowledge_bases b ON b.id = c.knowledge_base_id"
    "  WHERE c.document_id = knowledge_documents.id AND NOT EXISTS (SELECT 1"
    "   FROM knowledge_vectors v WHERE v.chunk_id = c.id AND v.model = b.embedding_model))"
).bindparams(bindparam("now", type_=DateTime(timezone=True)))


class Indexer:
    """The background task that embeds pending chunks; `kick()` after adding a document.

    `base_ids`: only these knowledge bases' documents (the re-embed command's own indexer)."""

    def __init__(
        self,
        sessions: async_sessionmaker,
        vectors: VectorIndex,
        embedder_for: EmbedderFor,
        base_ids: Sequence[str] = (),
    ) -> None:
        self._sessions = sessions
        self._vectors = vectors
        self._embedder_for = embedder_for
        self._params: dict[str, Any] = {f"kb{i}": b for i, b in enumerate(base_ids)}
        scope = f" AND d.knowledge_base_id IN ({', '.join(':' + k for k in self._params)})"
        self._documents = text(_PENDING_DOCUMENTS.format(scope=scope if base_ids else ""))
        self._retry_at: dict[str, float] = {}  # document id -> when to ask its model again
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
            try:
                await asyncio.wait_for(self._wake.wait(), POLL_S)
            except TimeoutError:
                pass
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
        """One round: a batch of every pending document whose model is not waited for; False
        when nothing is pending. Sleeps until the first retry when only those wait."""
        async with self._sessions() as session:
            documents = list((await session.scalars(self._documents, self._params)).all())
        now = time.monotonic()
        ready = [d for d in documents if self._retry_at.get(d, 0.0) <= now]
        if documents and not ready:
            await asyncio.sleep(max(0.0, min(self._retry_at[d] for d in documents) - now))
            return True
        self._retry_at = {d: t for d, t in self._retry_at.items() if d in documents}
        for document_id in ready:
            await self._embed_batch(document_id)
        async with self._sessions() as session, session.begin():
            await session.execute(_SETTLE, {"now": utcnow()})
        return bool(documents)

    async def _embed_batch(self, document_id: str) -> None:
        """Embed and write the next BATCH chunks of one document lacking a vector."""
        async with self._sessions() as session:
            rows = (await session.execute(_PENDING, {"d": document_id, "n": BATCH})).all()
        if not rows:
            return
        org_id, spec = (
            rows[0][4],
            EmbeddingSpec(rows[0][5], rows[0][6], rows[0][7], rows[0][8] or ""),
        )
        try:
            embedder = await self._embedder_for(org_id, spec)
            vectors = await embedder.embed([r[1] for r in rows])
        except EmbeddingUnavailable as exc:
            await self._failed(document_id, str(exc), exc.permanent)
            return
        self._retry_at.pop(document_id, None)
        written = [(r[0], document_id, v) for r, v in zip(rows, vectors, strict=True)]
        async with self._sessions() as session, session.begin():
            ids = ", ".join(str(int(r[0])) for r in rows)
            # vectors of another model (before a re-embed) give way; chunk ids are this document's
            await session.execute(
                text(
                    f"DELETE FROM knowledge_vectors WHERE chunk_id IN ({ids}) AND model <> :m"
                    " AND chunk_id IN (SELECT id FROM knowledge_chunks WHERE document_id = :d)"
                ),
                {"m": spec.model, "d": document_id},
            )
            await self._vectors.write(session, spec.model, written)

    async def _failed(self, document_id: str, message: str, permanent: bool) -> None:
        """Mark the document failed (`permanent`), or note why it waits and retry later."""
        if not permanent:
            self._retry_at[document_id] = time.monotonic() + RETRY_S
        async with self._sessions() as session, session.begin():
            await session.execute(
                text(
                    "UPDATE knowledge_documents SET status = :s, error_message = :m"
                    " WHERE id = :d AND status = 'processing'"
                ),
                {
                    "s": "failed" if permanent else "processing",
                    "m": message[:500],
                    "d": document_id,
                },
            )
        log.warning(
            "knowledge document not embedded" + ("" if permanent else "; retrying"),
            extra={"fields": {"document_id": document_id, "reason": message[:200]}},
        )
