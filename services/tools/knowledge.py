"""Knowledge bases: documents cut into chunks and ranked with full-text search.

Documents are chunked and indexed; search ranks with
SQLite FTS5 BM25 on the embedded default (PostgreSQL full-text search, `ts_rank_cd`
over `to_tsvector('english', ...)`, when the database is PostgreSQL) and returns
chunks with document, score and content. Every query is scoped by organization: no
organization ever sees another's documents.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import Any, cast

import grpc
from sqlalchemy import Table, func, insert, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from services.common.errors import TOOLS_DOMAIN, RpcError
from services.common.ids import is_row_id
from services.tools.models import KnowledgeBase, KnowledgeChunk, KnowledgeDocument, new_id, utcnow

log = logging.getLogger(__name__)

CHUNK_CHARS = 1000
TOKEN_WINDOW = 64 * 1024  # characters counted per regular expression call (count_tokens)
INSERT_PAGE = 1000  # chunk rows per executemany (add_document)
_TOKEN = re.compile(r"\w+", re.UNICODE)
_NON_WORD = re.compile(r"\W", re.UNICODE)
_SPACES = re.compile(r"\s*", re.UNICODE)


def chunk_text(content: str, size: int = CHUNK_CHARS) -> list[str]:
    """Cut `content` into chunks of at most `size` characters, on paragraph, then word, boundaries.

    Consecutive short paragraphs share a chunk; a paragraph longer than `size` is cut
    between words (a single word longer than `size` is cut where it must be). Linear in
    the length of `content`: a long paragraph is walked with an offset, never re-sliced.
    """
    pieces: list[str] = []
    for paragraph in re.split(r"\n\s*\n", content):
        paragraph = paragraph.strip()
        if not paragraph:
            continue
        start, end = 0, len(paragraph)
        while end - start > size:
            cut = paragraph.rfind(" ", start, start + size)
            cut = cut if cut - start > size // 2 else start + size
            pieces.append(paragraph[start:cut].strip())
            spaces = _SPACES.match(paragraph, cut)
            assert spaces is not None  # r"\s*" matches at any position
            start = spaces.end()  # what str.strip() drops (same whitespace)
        if start < end:
            pieces.append(paragraph[start:])
    chunks: list[str] = []
    for piece in pieces:
        if chunks and len(chunks[-1]) + 2 + len(piece) <= size:
            chunks[-1] = f"{chunks[-1]}\n\n{piece}"
        else:
            chunks.append(piece)
    return chunks


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


def query_terms(query: str) -> list[str]:
    """The word tokens of a query (lower case, deduplicated, at most 32)."""
    seen: list[str] = []
    for token in _TOKEN.findall(query.lower()):
        if token not in seen:
            seen.append(token)
    return seen[:32]


def _base_not_found(knowledge_base_id: str) -> RpcError:
    return RpcError(
        grpc.StatusCode.NOT_FOUND,
        "KNOWLEDGE_BASE_NOT_FOUND",
        "Knowledge base not found",
        domain=TOOLS_DOMAIN,
        metadata={"knowledge_base_id": knowledge_base_id},
    )


@dataclass(frozen=True)
class SearchHit:
    """One ranked chunk; `score` is higher for better matches (negated BM25 on SQLite)."""

    knowledge_base_id: str
    document_id: str
    document_name: str
    chunk_id: str
    chunk_index: int
    content: str
    score: float

    def to_json(self) -> dict[str, Any]:
        """The shape search_knowledge returns for one result."""
        return {
            "knowledge_base_id": self.knowledge_base_id,
            "document_id": self.document_id,
            "document_name": self.document_name,
            "chunk_id": self.chunk_id,
            "chunk_index": self.chunk_index,
            "content": self.content,
            "score": round(self.score, 6),
        }


class KnowledgeStore:
    """Knowledge bases, documents and chunks in the tools database.

    Args:
        engine: the service's engine (its dialect picks FTS5 or PostgreSQL full-text search).
        sessions: the service's session factory.
    """

    def __init__(self, engine: AsyncEngine, sessions: async_sessionmaker) -> None:
        self._dialect = engine.dialect.name
        self._sessions = sessions

    async def create_base(
        self, org_id: str, name: str, description: str = "", created_by: str = ""
    ) -> tuple[KnowledgeBase, int]:
        """Create a knowledge base (`created_by`: the creating user's id, or ""); returns it and its
        document count (0).

        Raises RpcError INVALID_ARGUMENT when `org_id` or `name` is empty.
        """
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
        )
        async with self._sessions() as session, session.begin():
            session.add(row)
        return row, 0

    async def list_bases(self, org_id: str) -> list[tuple[KnowledgeBase, int]]:
        """The organization's knowledge bases, newest first, each with its document count."""
        return [(base, totals[0]) for base, totals in await self.list_bases_with_totals(org_id)]

    async def list_bases_with_totals(
        self, org_id: str
    ) -> list[tuple[KnowledgeBase, tuple[int, int, int]]]:
        """The organization's knowledge bases, newest first, each with (documents, chunks,
        tokens)."""
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
                .where(KnowledgeBase.org_id == org_id)
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
            status="ready",
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

    async def search(
        self, org_id: str, query: str, knowledge_base_ids: list[str] | None, top_k: int
    ) -> list[SearchHit]:
        """The `top_k` chunks best matching `query` (any of its words), best first.

        Only the organization's chunks are searched; ids in `knowledge_base_ids` that are
        not the organization's, or cannot be ours (`is_row_id`), match nothing. An empty query
        (no words), or ids none of which can be ours, returns [] without a query.
        """
        terms = query_terms(query)
        if knowledge_base_ids:
            knowledge_base_ids = [kb for kb in knowledge_base_ids if is_row_id(kb)]
            if not knowledge_base_ids:
                return []
        if not terms:
            return []
        scope = "c.org_id = :org"
        params: dict[str, Any] = {"org": org_id, "k": top_k}
        if knowledge_base_ids:
            names = []
            for i, kb in enumerate(knowledge_base_ids):
                params[f"kb{i}"] = kb
                names.append(f":kb{i}")
            scope += f" AND c.knowledge_base_id IN ({', '.join(names)})"
        if self._dialect == "sqlite":
            # Each term quoted (FTS5 syntax characters are inert inside quotes), any term may match.
            params["match"] = " OR ".join('"' + t.replace('"', '""') + '"' for t in terms)
            sql = (
                "SELECT c.id, c.knowledge_base_id, c.document_id, d.name, c.chunk_index, "
                "c.content, "
                "bm25(knowledge_chunks_fts) AS rank FROM knowledge_chunks_fts "
                "JOIN knowledge_chunks c ON c.id = knowledge_chunks_fts.rowid "
                "JOIN knowledge_documents d ON d.id = c.document_id "
                f"WHERE knowledge_chunks_fts MATCH :match AND {scope} ORDER BY rank LIMIT :k"
            )
        else:
            params["tsq"] = " | ".join(terms)
            sql = (
                "SELECT c.id, c.knowledge_base_id, c.document_id, d.name, c.chunk_index, "
                "c.content, "
                "-ts_rank_cd(to_tsvector('english', c.content), to_tsquery('english', :tsq)) AS "
                "rank "
                "FROM knowledge_chunks c JOIN knowledge_documents d ON d.id = c.document_id "
                "WHERE to_tsvector('english', c.content) @@ to_tsquery('english', :tsq) AND "
                f"{scope} "
                "ORDER BY rank LIMIT :k"
            )
        async with self._sessions() as session:
            rows = (await session.execute(text(sql), params)).all()
        return [
            SearchHit(
                knowledge_base_id=r[1],
                document_id=r[2],
                document_name=r[3],
                chunk_id=str(r[0]),
                chunk_index=int(r[4]),
                content=r[5],
                score=-float(r[6]),
            )
            for r in rows
        ]
