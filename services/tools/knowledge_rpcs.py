"""The knowledge RPCs of the tools servicer: knowledge bases, their documents and search.

`KnowledgeRpcs` is a base of `servicer.ToolsServicer`, which sets `knowledge` (the executor's
KnowledgeStore). Each RPC checks its request's fields here, with the gateway's limits
(request_checks.py), before the store is asked; the store raises the NOT_FOUND and
INVALID_ARGUMENT of what only it can know (ids, embedding providers, credentials).
"""

from __future__ import annotations

import asyncio

import grpc

from loopline.tools.v1 import tools_pb2, tools_pb2_grpc
from services.common import ids, pb
from services.common.errors import TOOLS_DOMAIN, RpcError, rpc_handler
from services.tools.credentials import CredentialStore
from services.tools.extract import (
    MEDIA_TYPES,
    ExtractionError,
    UnsupportedFileType,
    extract_text,
    file_type,
)
from services.tools.knowledge import EmbeddingSpec, KnowledgeStore
from services.tools.models import KnowledgeBase, KnowledgeDocument
from services.tools.request_checks import (
    TEXT_LIMITS,
    check_count,
    check_length,
    check_lengths,
    invalid,
    page_size,
)

# RpcError -> its rich status (as servicer.py's `unary`).
unary = rpc_handler(
    internal_domain=TOOLS_DOMAIN,
    check=ids.request_organization_check(TOOLS_DOMAIN, "ORGANIZATION_REQUIRED"),
)

#: SearchRequest.mode -> the store's mode name (unset: hybrid).
SEARCH_MODES: dict[int, str] = {
    tools_pb2.SEARCH_MODE_UNSPECIFIED: "hybrid",
    tools_pb2.SEARCH_MODE_HYBRID: "hybrid",
    tools_pb2.SEARCH_MODE_SEMANTIC: "semantic",
    tools_pb2.SEARCH_MODE_KEYWORD: "keyword",
}
#: The hybrid weights when a request sets neither (tools.proto, SearchKnowledgeRequest).
DEFAULT_SEMANTIC_WEIGHT = 0.7
DEFAULT_KEYWORD_WEIGHT = 0.3
#: The integration whose credentials an "openai" embedding model takes its key from.
EMBEDDING_INTEGRATION = "openai"
#: The longest EmbeddingConfig strings, in characters: the knowledge_bases columns' widths
#: (provider VARCHAR(20), model VARCHAR(200), credential id VARCHAR(36) but any id up to the
#: gateway's 64 is looked up and not found rather than refused as too long).
EMBEDDING_LIMITS = {"provider": 20, "model": 200, "credential_id": 64}


def knowledge_base_pb(
    base: KnowledgeBase, document_count: int, total_chunks: int = 0, total_tokens: int = 0
) -> tools_pb2.KnowledgeBase:
    """The KnowledgeBase message of a row, with its embedding model."""
    return tools_pb2.KnowledgeBase(
        knowledge_base_id=base.id,
        organization_id=base.org_id,
        name=base.name,
        description=base.description,
        document_count=document_count,
        create_time=pb.timestamp(base.created_at),
        total_chunks=total_chunks,
        total_tokens=total_tokens,
        created_by_user_id=base.created_by or "",
        embedding=tools_pb2.EmbeddingConfig(
            provider=base.embedding_provider,
            model=base.embedding_model,
            dimensions=base.embedding_dimensions,
            credential_id=base.embedding_credential_id or "",
        ),
    )


def document_pb(document: KnowledgeDocument) -> tools_pb2.Document:
    """The Document message of a row (`error_message` empty unless indexing failed)."""
    return tools_pb2.Document(
        document_id=document.id,
        knowledge_base_id=document.knowledge_base_id,
        name=document.name,
        content_type=document.content_type,
        status=document.status,
        chunk_count=document.chunk_count,
        create_time=pb.timestamp(document.created_at),
        file_size_bytes=document.file_size_bytes,
        token_count=document.token_count,
        error_message=document.error_message or "",
        index_time=pb.timestamp(document.indexed_at) if document.indexed_at else None,
    )


def embedding_spec(request: tools_pb2.CreateKnowledgeBaseRequest) -> EmbeddingSpec | None:
    """The EmbeddingSpec of a CreateKnowledgeBase request; None (the local model) when
    `embedding` is unset. Its strings past EMBEDDING_LIMITS are FIELD_TOO_LONG, named
    `embedding.<field>`; the store checks the rest (INVALID_EMBEDDING_CONFIG,
    CREDENTIAL_NOT_FOUND)."""
    config = request.embedding
    if not request.HasField("embedding") or config == tools_pb2.EmbeddingConfig():
        return None  # an empty message too: what a client without the field's values sends
    for field, limit in EMBEDDING_LIMITS.items():
        check_length(f"embedding.{field}", getattr(config, field), limit)
    if config.dimensions < 0:
        raise invalid(
            "INVALID_EMBEDDING_CONFIG",
            f"embedding.dimensions must be >= 0 (0: read from the API), not {config.dimensions}",
        )
    return EmbeddingSpec(
        provider=config.provider,
        model=config.model,
        dimensions=config.dimensions,
        credential_id=config.credential_id,
    )


def search_weights(semantic: float, keyword: float) -> tuple[float, float]:
    """The hybrid weights of a SearchKnowledge request: both 0 (unset) are the defaults, else
    each must be from 0 to 1 and not both 0 (INVALID_ARGUMENT INVALID_WEIGHTS, metadata
    `field`)."""
    if semantic == 0 and keyword == 0:
        return DEFAULT_SEMANTIC_WEIGHT, DEFAULT_KEYWORD_WEIGHT
    for field, value in (("semantic_weight", semantic), ("keyword_weight", keyword)):
        if not 0 <= value <= 1:  # NaN too
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "INVALID_WEIGHTS",
                f"{field} must be between 0 and 1 (semantic_weight and keyword_weight not both 0;"
                f" both unset: {DEFAULT_SEMANTIC_WEIGHT} and {DEFAULT_KEYWORD_WEIGHT})",
                domain=TOOLS_DOMAIN,
                metadata={"field": field},
            )
    return semantic, keyword


def search_mode(mode: int) -> str:
    """The store's name of a SearchMode value; INVALID_ARGUMENT INVALID_MODE for a number the
    enum does not define (proto3 enums are open: a newer client may send one)."""
    name = SEARCH_MODES.get(mode)
    if name is None:
        raise RpcError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_MODE",
            f"mode must be one of SEARCH_MODE_HYBRID, SEARCH_MODE_SEMANTIC, SEARCH_MODE_KEYWORD"
            f" (unset: hybrid), not {mode}",
            domain=TOOLS_DOMAIN,
            metadata={"field": "mode"},
        )
    return name


def min_score_of(value: float) -> float:
    """A request's min_score: from 0 to 1 (scores are), else INVALID_ARGUMENT INVALID_MIN_SCORE."""
    if not 0 <= value <= 1:  # NaN too
        raise RpcError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_MIN_SCORE",
            f"min_score must be between 0 and 1, not {value}",
            domain=TOOLS_DOMAIN,
            metadata={"field": "min_score"},
        )
    return value


def page_offset(value: int) -> int:
    """A request's offset: >= 0, else INVALID_ARGUMENT INVALID_OFFSET (not clamped)."""
    if value < 0:
        raise RpcError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_OFFSET",
            f"offset must be >= 0, not {value}",
            domain=TOOLS_DOMAIN,
            metadata={"field": "offset"},
        )
    return value


class KnowledgeRpcs(tools_pb2_grpc.ToolsServiceServicer):
    """The knowledge RPCs of the tools servicer (a base of ToolsServicer, which sets
    `knowledge` and `credentials`)."""

    knowledge: KnowledgeStore
    credentials: CredentialStore

    async def _check_embedding_credential(self, org_id: str, spec: EmbeddingSpec | None) -> None:
        """NOT_FOUND CREDENTIAL_NOT_FOUND (metadata `credential_id`) unless the credential of an
        "openai" `spec` is one of the organization's, of integration EMBEDDING_INTEGRATION: its
        key is what the knowledge base's embeddings will be computed with."""
        if spec is None or spec.provider != "openai" or not spec.credential_id:
            return  # nothing to look up (the store refuses an "openai" spec without one)
        try:
            info = await self.credentials.get(org_id, spec.credential_id)
        except RpcError:
            info = None
        if info is None or info.integration != EMBEDDING_INTEGRATION:
            raise RpcError(
                grpc.StatusCode.NOT_FOUND,
                "CREDENTIAL_NOT_FOUND",
                "Credential not found: the embedding model's credential_id must name one of the"
                f" organization's {EMBEDDING_INTEGRATION} credentials",
                domain=TOOLS_DOMAIN,
                metadata={"credential_id": spec.credential_id},
            )

    @unary
    async def CreateKnowledgeBase(
        self, request: tools_pb2.CreateKnowledgeBaseRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.CreateKnowledgeBaseResponse:
        """Create an empty knowledge base embedded with `embedding` (unset: the local model).

        INVALID_ARGUMENT without organization or name, FIELD_TOO_LONG for a name or description
        past TEXT_LIMITS or an embedding string past EMBEDDING_LIMITS, INVALID_EMBEDDING_CONFIG
        for a bad provider or a missing model or credential; NOT_FOUND CREDENTIAL_NOT_FOUND for
        a credential that is not the organization's "openai" one.
        """
        check_length("name", request.name, TEXT_LIMITS["name"])
        check_length("description", request.description, TEXT_LIMITS["description"])
        spec = embedding_spec(request)
        await self._check_embedding_credential(request.organization_id, spec)
        base, count = await self.knowledge.create_base(
            request.organization_id,
            request.name,
            request.description,
            request.user_id,
            embedding=spec,
        )
        return tools_pb2.CreateKnowledgeBaseResponse(knowledge_base=knowledge_base_pb(base, count))

    @unary
    async def ListKnowledgeBases(
        self, request: tools_pb2.ListKnowledgeBasesRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.ListKnowledgeBasesResponse:
        """The organization's knowledge bases, newest first."""
        bases = await self.knowledge.list_bases_with_totals(request.organization_id)
        return tools_pb2.ListKnowledgeBasesResponse(
            knowledge_bases=[knowledge_base_pb(b, *totals) for b, totals in bases]
        )

    @unary
    async def DeleteKnowledgeBase(
        self, request: tools_pb2.DeleteKnowledgeBaseRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.DeleteKnowledgeBaseResponse:
        """Delete a knowledge base with its documents, chunks and embeddings; NOT_FOUND when
        absent or another organization's."""
        await self.knowledge.delete_base(request.organization_id, request.knowledge_base_id)
        return tools_pb2.DeleteKnowledgeBaseResponse()

    @unary
    async def AddDocument(
        self, request: tools_pb2.AddDocumentRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.AddDocumentResponse:
        """Add, chunk and index a document (text, or a file's extracted text).

        NOT_FOUND for another organization's knowledge base; INVALID_ARGUMENT
        UNSUPPORTED_FILE_TYPE / DOCUMENT_HAS_NO_TEXT for a file; FIELD_TOO_LONG for a name past
        TEXT_LIMITS["document_name"].
        """
        check_length("name", request.name, TEXT_LIMITS["document_name"])
        if request.data:
            try:
                kind = file_type(request.name, request.content_type)
                text = await asyncio.to_thread(extract_text, request.data, kind)
            except UnsupportedFileType as exc:
                raise invalid("UNSUPPORTED_FILE_TYPE", str(exc)) from None
            except ExtractionError as exc:
                raise invalid("DOCUMENT_HAS_NO_TEXT", str(exc)) from None
            document = await self.knowledge.add_document(
                request.organization_id,
                request.knowledge_base_id,
                request.name,
                text,
                MEDIA_TYPES[kind],
                file_size_bytes=len(request.data),
            )
        else:
            document = await self.knowledge.add_document(
                request.organization_id,
                request.knowledge_base_id,
                request.name,
                request.text,
                request.content_type,
            )
        return tools_pb2.AddDocumentResponse(document=document_pb(document))

    @unary
    async def GetDocument(
        self, request: tools_pb2.GetDocumentRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.GetDocumentResponse:
        """One document; NOT_FOUND when absent, in another knowledge base or another
        organization's."""
        document = await self.knowledge.get_document(
            request.organization_id, request.knowledge_base_id, request.document_id
        )
        return tools_pb2.GetDocumentResponse(document=document_pb(document))

    @unary
    async def ListDocuments(
        self, request: tools_pb2.ListDocumentsRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.ListDocumentsResponse:
        """A page of a knowledge base's documents, newest first.

        limit is 1 to 500, 0 means 100, and offset is >= 0 (the gateway's ranges); any other
        value is INVALID_ARGUMENT INVALID_LIMIT / INVALID_OFFSET, not clamped. NOT_FOUND when
        the knowledge base is absent or another organization's.
        """
        limit = page_size("limit", request.limit, 1, 500, 100)
        offset = page_offset(request.offset)
        documents = await self.knowledge.list_documents(
            request.organization_id, request.knowledge_base_id, limit=limit, offset=offset
        )
        return tools_pb2.ListDocumentsResponse(documents=[document_pb(d) for d in documents])

    @unary
    async def DeleteDocument(
        self, request: tools_pb2.DeleteDocumentRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.DeleteDocumentResponse:
        """Delete a document with its chunks and embeddings; NOT_FOUND when absent, in another
        knowledge base or another organization's."""
        await self.knowledge.delete_document(
            request.organization_id, request.knowledge_base_id, request.document_id
        )
        return tools_pb2.DeleteDocumentResponse()

    @unary
    async def SearchKnowledge(
        self, request: tools_pb2.SearchKnowledgeRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.SearchKnowledgeResponse:
        """The best chunks for the query in the organization's knowledge bases, ranked by `mode`
        (unset: hybrid), each with its semantic and keyword scores.

        top_k is 1 to 50, 0 means 5 (the gateway's range), else INVALID_TOP_K; the weights as
        `search_weights` (INVALID_WEIGHTS), min_score 0 to 1 (INVALID_MIN_SCORE), an unknown
        mode INVALID_MODE. A query past TEXT_LIMITS is FIELD_TOO_LONG, more knowledge bases than
        COUNT_LIMITS TOO_MANY_KNOWLEDGE_BASE_IDS. All checked before any query.
        """
        check_lengths(request, "query")
        check_count("knowledge_base_ids", request.knowledge_base_ids)
        top_k = page_size("top_k", request.top_k, 1, 50, 5)
        mode = search_mode(request.mode)
        semantic, keyword = search_weights(request.semantic_weight, request.keyword_weight)
        hits = await self.knowledge.search(
            request.organization_id,
            request.query,
            list(request.knowledge_base_ids),
            top_k,
            mode=mode,
            semantic_weight=semantic,
            keyword_weight=keyword,
            min_score=min_score_of(request.min_score),
        )
        return tools_pb2.SearchKnowledgeResponse(
            results=[tools_pb2.KnowledgeSearchResult(**h.to_json()) for h in hits]
        )
