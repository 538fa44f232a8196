"""Knowledge bases: documents cut into chunks, indexed for keywords and meaning, and searched.

A document is cut by its structure (chunking.py) and its chunks are written with their
full-text index (SQLite FTS5, or PostgreSQL text search) in one transaction, so keyword search
finds them as soon as the upload answers; the indexer (knowledge_indexer.py) then embeds them
in the background. Search (knowledge_search.py) ranks by keywords, meaning, or both. Every
query is scoped by organization: no organization ever sees another's documents.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import cast

import grpc
from sqlalchemy import Table, func, insert, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from services.common.errors import TOOLS_DOMAIN, RpcError
from services.common.ids import is_row_id
from services.tools.chunking import CHUNK_CHARS, OVERLAP_CHARS, chunk_text
from services.tools.embedder_source import local_only
from services.tools.knowledge_indexer import (
    EmbedderFor,
    EmbeddingSpec,
    Indexer,
)
from services.tools.knowledge_search import MODES, KnowledgeSearch, SearchHit
from services.tools.models import KnowledgeBase, KnowledgeChunk, KnowledgeDocument, new_id, utcnow
from services.tools.vectors import VectorIndex

__all__ = [
    "CHUNK_CHARS",
    "OVERLAP_CHARS",
    "EmbeddingSpec",
    "KnowledgeStore",
    "SearchHit",
    "chunk_text",
]
PROVIDERS = ("local", "openai")

log = logging.getLogger(__name__)

TOKEN_WINDOW = 64 * 1024  # characters counted per regular expression call (count_tokens)
INSERT_PAGE = 1000  # chunk rows per executemany (add_document)
MAX_LIST = 500  # documents per page of list_documents
_TOKEN = re.compile(r"\w+", re.UNICODE)
_NON_WORD = re.compile(r"\W", re.UNICODE)


def count_tokens(content: str) -> int:
    """The number of word tokens of `content` (what `_TOKEN.findall(content)` finds).

    Counted a window of about TOKEN_WINDOW characters at a time (each window ends before
    a non-word character, so no token is split): one regular expression call over a
    whole multi-MiB text would hold the GIL, and so the event loop, for a second.
    """
    count, start, length = 0, 0, len(content)
    while start < length:
        boundary = _NON_WORD.search(content, min(start + TOKEN_WINDOW, length))
        end = boundary.start() if boundary else length
        count += len(_TOKEN.findall(content, start, end))
        start = end + 1 if boundary else length
    return count


def _prepare(content: str) -> tuple[list[str], int, int]:
    """(chunks, token count, UTF-8 size) of a document's text: the CPU-heavy part of
    add_document."""
    return chunk_text(content), count_tokens(content), len(content.encode())


def _base_not_found(knowledge_base_id: str) -> RpcError:
    return RpcError(
        grpc.StatusCode.NOT_FOUND,
        "KNOWLEDGE_BASE_NOT_FOUND",
        "Knowledge base not found",
        domain=TOOLS_DOMAIN,
        metadata={"knowledge_base_id": knowledge_base_id},
    )


class KnowledgeStore:
    """Knowledge bases, documents, chunks and their embeddings in the tools database.

    Args:
        engine: the service's engine (its dialect picks FTS5 or PostgreSQL text search, and
            numpy or pgvector).
        sessions: the service's session factory.
        embedder_for: `(organization_id, spec) -> Embedder`: embedder_source.Embedders in the
            service; by default the local model only.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        sessions: async_sessionmaker,
        embedder_for: EmbedderFor = local_only,
    ) -> None:
        self._dialect = engine.dialect.name
        self._sessions = sessions
        self.vectors = VectorIndex(engine, sessions)
        self._embedder_for = embedder_for
        self.indexer = Indexer(sessions, self.vectors, embedder_for)
        self._search = KnowledgeSearch(self._dialect, sessions, self.vectors, embedder_for)

    def indexer_for(self, base_ids: list[str]) -> Indexer:
        """An indexer of these knowledge bases' documents only (the re-embed command's)."""
        return Indexer(self._sessions, self.vectors, self._embedder_for, base_ids)

    async def close(self) -> None:
        """Stop the indexer (what it had not written, the next start picks up)."""
        await self.indexer.stop()

    async def create_base(
        self,
        org_id: str,
        name: str,
        description: str = "",
        created_by: str = "",
        embedding: EmbeddingSpec | None = None,
    ) -> tuple[KnowledgeBase, int]:
        """Create a knowledge base (`created_by`: the creating user's id, or ""; `embedding`:
        its model, the local one by default); returns it and its document count (0).

        Raises RpcError INVALID_ARGUMENT when `org_id` or `name` is empty, or reason
        INVALID_EMBEDDING_CONFIG for an unknown provider or an "openai" one without a model
        and a credential (the servicer checks the credential is the organization's).
        """
        spec = embedding or EmbeddingSpec()
        if (
            spec.provider not in PROVIDERS
            or (spec.provider == "openai" and not (spec.model.strip() and spec.credential_id))
            or len(spec.model) > 200
            or not 0 <= spec.dimensions <= 16_000
        ):
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "INVALID_EMBEDDING_CONFIG",
                "embedding provider must be 'local' or 'openai'; 'openai' needs a model (at most"
                " 200 characters) and a credential_id",
                domain=TOOLS_DOMAIN,
            )
        if spec.provider == "local":
            spec = EmbeddingSpec()
        if not org_id or not name.strip():
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "INVALID_KNOWLEDGE_BASE",
                "organization_id and name are required",
                domain=TOOLS_DOMAIN,
            )
        row = KnowledgeBase(
            id=new_id(),
            org_id=org_id,
            name=name.strip(),
            description=description,
            created_by=created_by or None,
            created_at=utcnow(),
            embedding_provider=spec.provider,
            embedding_model=spec.model.strip(),
            embedding_dimensions=spec.dimensions,
            embedding_credential_id=spec.credential_id or None,
        )
        async with self._sessions() as session, session.begin():
            session.add(row)
        return row, 0

    async def list_bases(self, org_id: str) -> list[tuple[KnowledgeBase, int]]:
        """The organization's knowledge bases, newest first, each with its document count."""
        return [(base, totals[0]) for base, totals in await self.list_bases_with_totals(org_id)]

    async def get_base(
        self, org_id: str, knowledge_base_id: str
    ) -> tuple[KnowledgeBase, tuple[int, int, int]]:
        """One of the organization's knowledge bases with (documents, chunks, tokens).

        Raises RpcError NOT_FOUND when it is absent or another organization's."""
        if is_row_id(knowledge_base_id):
            found = await self.list_bases_with_totals(org_id, knowledge_base_id)
            if found:
                return found[0]
        raise _base_not_found(knowledge_base_id)

    async def list_bases_with_totals(
        self, org_id: str, knowledge_base_id: str | None = None
    ) -> list[tuple[KnowledgeBase, tuple[int, int, int]]]:
        """The organization's knowledge bases (or only `knowledge_base_id`), newest first, each
        with (documents, chunks, tokens)."""
        scope = [KnowledgeBase.org_id == org_id]
        if knowledge_base_id is not None:
            scope.append(KnowledgeBase.id == knowledge_base_id)
        async with self._sessions() as session:
            counts = (
                select(
                    KnowledgeDocument.knowledge_base_id,
                    func.count().label("n"),
                    func.sum(KnowledgeDocument.chunk_count).label("chunks"),
                    func.sum(KnowledgeDocument.token_count).label("tokens"),
                )
                .group_by(KnowledgeDocument.knowledge_base_id)
                .subquery()
            )
            rows = await session.execute(
                select(
                    KnowledgeBase,
                    func.coalesce(counts.c.n, 0),
                    func.coalesce(counts.c.chunks, 0),
                    func.coalesce(counts.c.tokens, 0),
                )
                .outerjoin(counts, counts.c.knowledge_base_id == KnowledgeBase.id)
                .where(*scope)
                .order_by(KnowledgeBase.created_at.desc(), KnowledgeBase.id)
            )
            return [
                (base, (int(n), int(chunks), int(tokens))) for base, n, chunks, tokens in rows.all()
            ]

    async def get_document(
        self, org_id: str, knowledge_base_id: str, document_id: str
    ) -> KnowledgeDocument:
        """One document of one of the organization's knowledge bases.

        Raises RpcError NOT_FOUND when it is absent, in another knowledge base, or another
        organization's, and without a query when either id cannot be ours (`is_row_id`)."""
        document = None
        if is_row_id(document_id) and is_row_id(knowledge_base_id):
            async with self._sessions() as session:
                document = await session.get(KnowledgeDocument, document_id)
        if (
            document is None
            or document.org_id != org_id
            or document.knowledge_base_id != knowledge_base_id
        ):
            raise RpcError(
                grpc.StatusCode.NOT_FOUND,
                "DOCUMENT_NOT_FOUND",
                "Document not found",
                domain=TOOLS_DOMAIN,
                metadata={"document_id": document_id},
            )
        return document

    async def base_ids(self, org_id: str) -> list[str]:
        """Ids of the organization's knowledge bases."""
        async with self._sessions() as session:
            return list(
                (
                    await session.scalars(
                        select(KnowledgeBase.id).where(KnowledgeBase.org_id == org_id)
                    )
                ).all()
            )

    async def add_document(
        self,
        org_id: str,
        knowledge_base_id: str,
        name: str,
        content: str,
        content_type: str = "text/plain",
        file_size_bytes: int | None = None,
    ) -> KnowledgeDocument:
        """Add a text document: chunk it and index every chunk, in one transaction.

        `file_size_bytes` is the uploaded file's size (default: the UTF-8 size of `content`);
        the document's token_count is the number of word tokens of `content`.

        The event loop is never held for long, whatever the size of `content`: chunking and
        counting run in a worker thread, the chunks are written with Core executemany INSERTs
        of INSERT_PAGE rows (no ORM objects) and, on SQLite, the FTS5 index is filled with one
        INSERT ... SELECT of the document's chunks. A failure at any step leaves nothing behind.

        Raises RpcError NOT_FOUND when the knowledge base is absent or another
        organization's (before any work when its id cannot be ours, `is_row_id`), INVALID_ARGUMENT
        when the name or the text is empty.
        """
        if not is_row_id(knowledge_base_id):
            raise _base_not_found(knowledge_base_id)
        if not name.strip() or not content or content.isspace():
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "INVALID_DOCUMENT",
                "a document needs a name and non-empty text",
                domain=TOOLS_DOMAIN,
            )
        chunks, token_count, utf8_size = await asyncio.to_thread(_prepare, content)
        document = KnowledgeDocument(
            id=new_id(),
            knowledge_base_id=knowledge_base_id,
            org_id=org_id,
            name=name,
            content_type=content_type or "text/plain",
            status="processing",
            chunk_count=len(chunks),
            file_size_bytes=utf8_size if file_size_bytes is None else file_size_bytes,
            token_count=token_count,
            created_at=utcnow(),
        )
        async with self._sessions() as session, session.begin():
            base = await session.get(KnowledgeBase, knowledge_base_id)
            if base is None or base.org_id != org_id:
                raise _base_not_found(knowledge_base_id)
            session.add(document)
            await session.flush()  # the document row first: chunks reference it
            await self._insert_chunks(session, document, chunks)
        self.indexer.kick()
        log.info(
            "document indexed",
            extra={
                "fields": {
                    "document_id": document.id,
                    "knowledge_base_id": knowledge_base_id,
                    "chunks": len(chunks),
                }
            },
        )
        return document

    async def _insert_chunks(
        self, session: AsyncSession, document: KnowledgeDocument, chunks: list[str]
    ) -> None:
        """Write the document's chunks (and, on SQLite, their FTS5 rows) in `session`."""
        # Core executemany in pages: ids are assigned in chunk_index order, as the ORM did, and
        # the loop is free between pages (binding the parameters of one page takes milliseconds).
        for first in range(0, len(chunks), INSERT_PAGE):
            await session.execute(
                insert(cast(Table, KnowledgeChunk.__table__)),
                [
                    {
                        "document_id": document.id,
                        "knowledge_base_id": document.knowledge_base_id,
                        "org_id": document.org_id,
                        "chunk_index": i,
                        "content": c,
                    }
                    for i, c in enumerate(chunks[first : first + INSERT_PAGE], start=first)
                ],
            )
        if self._dialect == "sqlite":
            # rowid = knowledge_chunks.id, the same rows and text the search joins on (models.py)
            await session.execute(
                text(
                    "INSERT INTO knowledge_chunks_fts(rowid, content) "
                    "SELECT id, content FROM knowledge_chunks WHERE document_id = :doc ORDER BY id"
                ),
                {"doc": document.id},
            )

    async def list_documents(
        self, org_id: str, knowledge_base_id: str, limit: int = 100, offset: int = 0
    ) -> list[KnowledgeDocument]:
        """A page of the knowledge base's documents, newest first.

        Raises RpcError NOT_FOUND when the knowledge base is absent or another organization's."""
        async with self._sessions() as session:
            base = (
                await session.get(KnowledgeBase, knowledge_base_id)
                if is_row_id(knowledge_base_id)
                else None
            )
            if base is None or base.org_id != org_id:
                raise _base_not_found(knowledge_base_id)
            rows = await session.scalars(
                select(KnowledgeDocument)
                .where(KnowledgeDocument.knowledge_base_id == knowledge_base_id)
                .order_by(KnowledgeDocument.created_at.desc(), KnowledgeDocument.id)
                .limit(max(1, min(limit, MAX_LIST)))
                .offset(max(0, offset))
            )
            return list(rows.all())

    async def delete_document(self, org_id: str, knowledge_base_id: str, document_id: str) -> None:
        """Delete a document with its chunks, their full-text rows and their vectors.

        Raises RpcError NOT_FOUND like get_document."""
        document = await self.get_document(org_id, knowledge_base_id, document_id)
        await self._delete("document_id", document.id)

    async def delete_base(self, org_id: str, knowledge_base_id: str) -> None:
        """Delete a knowledge base with its documents, chunks and vectors. A search that already
        answered keeps its results (they were copied into the turn).

        Raises RpcError NOT_FOUND when it is absent or another organization's."""
        base, _ = await self.get_base(org_id, knowledge_base_id)
        await self._delete("knowledge_base_id", base.id)
        async with self._sessions() as session, session.begin():
            await session.execute(
                text("DELETE FROM knowledge_bases WHERE id = :id AND org_id = :org"),
                {"id": base.id, "org": org_id},
            )

    async def _delete(self, column: str, value: str) -> None:
        """Delete the chunks (and their FTS5 rows and vectors) and documents where `column`
        (document_id or knowledge_base_id) is `value`, in one transaction."""
        where = f"{column} = :v"
        async with self._sessions() as session, session.begin():
            if self._dialect == "sqlite":
                await session.execute(
                    text(
                        "DELETE FROM knowledge_chunks_fts WHERE rowid IN"
                        f" (SELECT id FROM knowledge_chunks WHERE {where})"
                    ),
                    {"v": value},
                )
            await session.execute(
                text(
                    "DELETE FROM knowledge_vectors WHERE chunk_id IN"
                    f" (SELECT id FROM knowledge_chunks WHERE {where})"
                ),
                {"v": value},
            )
            await session.execute(text(f"DELETE FROM knowledge_chunks WHERE {where}"), {"v": value})
            key = "id" if column == "document_id" else column
            await session.execute(
                text(f"DELETE FROM knowledge_documents WHERE {key} = :v"), {"v": value}
            )

    async def search(
        self,
        org_id: str,
        query: str,
        knowledge_base_ids: list[str] | None,
        top_k: int,
        mode: str = "hybrid",
        semantic_weight: float = 0.7,
        keyword_weight: float = 0.3,
        min_score: float = 0.0,
    ) -> list[SearchHit]:
        """The `top_k` chunks best matching `query`, best first (knowledge_search.py says how
        each `mode` scores, from 0 to 1), each scoring at least `min_score`.

        Only the organization's chunks are searched; ids in `knowledge_base_ids` that are
        not the organization's, or cannot be ours (`is_row_id`), match nothing. An empty query
        (no words), or ids none of which can be ours, returns [] without a query.
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        if knowledge_base_ids:
            knowledge_base_ids = [kb for kb in knowledge_base_ids if is_row_id(kb)]
            if not knowledge_base_ids:
                return []
        scope = [KnowledgeBase.org_id == org_id]
        if knowledge_base_ids:
            scope.append(KnowledgeBase.id.in_(knowledge_base_ids))
        async with self._sessions() as session:
            bases = {
                b.id: EmbeddingSpec.of(b)
                for b in (await session.scalars(select(KnowledgeBase).where(*scope))).all()
            }
        return await self._search.search(
            org_id, query, bases, top_k, mode, (semantic_weight, keyword_weight), min_score
        )
