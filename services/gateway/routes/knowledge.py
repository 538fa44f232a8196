"""Knowledge routes: knowledge bases, their documents and full-text search (over the tools service).

Routes and JSON shapes follow the official SDK (`modulex/resources/knowledge.py` and its
`types/`). Every route requires an owner or admin, authenticated before anything is looked up.
Bad input is 400 `{"detail": ...}`; tools service failures go through the error table, except
an unsupported upload type, which is 415.
"""

from __future__ import annotations

from typing import Annotated

import grpc
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile
from starlette.types import Message, Receive

from loopline.tools.v1 import tools_pb2, tools_pb2_grpc
from services.common import pb
from services.common.errors import TOOLS_DOMAIN, status_details
from services.gateway.bodies import check_fields
from services.gateway.errors import BodyError, detail, grpc_error_response
from services.gateway.identity import Principal
from services.gateway.openapi import error_responses, keyed
from services.gateway.query import WholeNumber
from services.gateway.routes.fields import (
    MAX_ID_CHARS,
    MAX_SEARCH_BASES,
    SLOW_TIMEOUT_S,
    TIMEOUT_S,
    Who,
    body_of,
    int_field,
    json_body,
    number_field,
    object_field,
    string_field,
    text_schema,
    tools_of,
)
from services.gateway.schemas import (
    Document,
    DocumentStatus,
    KnowledgeBase,
    MultiSearch,
    Search,
    SearchMatch,
)

# The largest document upload, in bytes (10 MiB); larger is 413.
MAX_UPLOAD_BYTES = 10 * 1024 * 1024
# The largest upload body (the document and its multipart framing): reading stops past it, 413.
MAX_UPLOAD_BODY_BYTES = MAX_UPLOAD_BYTES + 64 * 1024
# The SDK's KnowledgeBaseStatus: the `?status=` filter of GET /knowledge-bases takes these.
KNOWLEDGE_BASE_STATUSES = ("active", "processing", "error", "archived")
# The SDK's DocumentStatus for the tools service's document statuses.
DOCUMENT_STATUS = {
    "ready": "completed",
    "pending": "pending",
    "processing": "processing",
    "failed": "failed",
}
# The chunking the tools service applies (shown as a knowledge base's chunking_config).
CHUNKING_CONFIG = {"strategy": "paragraphs", "max_chars": 1000}
# Search is full-text (BM25 on SQLite, ts_rank_cd on PostgreSQL), not embeddings.
EMBEDDING_CONFIG = {"type": "full_text"}
_FILE_TYPES = {
    "text/plain": "txt",
    "text/markdown": "md",
    "text/html": "html",
    "text/csv": "csv",
    "application/json": "json",
    "application/pdf": "pdf",
}
_TOP_K = {"type": "integer", "minimum": 1, "maximum": 50, "default": 5}
_MIN_SCORE = {"type": "number", "default": 0.0}
_FIXED_CONFIG = {
    "type": ["object", "null"],
    "maxProperties": 0,
    "description": "Cannot be set (search is full-text, chunking is fixed):"
    " only null or {} is accepted.",
}
CREATE_KNOWLEDGE_BASE_BODY = json_body(
    {
        "name": text_schema("name", required=True),
        "description": text_schema("description"),
        "embedding_config": _FIXED_CONFIG,
        "chunking_config": _FIXED_CONFIG,
    },
    ["name"],
)
MULTI_SEARCH_BODY = json_body(
    {
        "knowledge_base_ids": {
            "type": "array",
            "minItems": 1,
            "maxItems": MAX_SEARCH_BASES,
            "items": {"type": "string", "minLength": 1, "maxLength": MAX_ID_CHARS},
        },
        "query": text_schema("query", required=True),
        "top_k": _TOP_K,
        "min_score": _MIN_SCORE,
    },
    ["knowledge_base_ids", "query"],
)
SEARCH_BODY = json_body(
    {
        "query": text_schema("query", required=True),
        "top_k": _TOP_K,
        "min_score": _MIN_SCORE,
        # refused when truthy: only an empty value passes
        "filters": {
            "enum": [None, False, 0, "", [], {}],
            "description": "Not supported: only an empty value (null, {}, ...) is accepted.",
        },
        "include_content": {"type": "boolean", "default": True},
        "include_metadata": {"type": "boolean", "default": True},
    },
    ["query"],
)
UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "file": {
                            "type": "string",
                            "format": "binary",
                            "description": f"The document (1 to {MAX_UPLOAD_BYTES} bytes;"
                            " txt, md, html, csv, json or pdf).",
                        },
                        # any text: a multipart field has no type (a generated "integer" is
                        # text on the wire too)
                        "metadata": {"description": "Accepted and ignored."},
                    },
                    "required": ["file"],
                }
            }
        },
    }
}


def knowledge_base_json(kb: tools_pb2.KnowledgeBase) -> KnowledgeBase:
    """The SDK's KnowledgeBaseResponse of `kb` (`created_by_user_id` null when not recorded)."""
    created = pb.iso(kb.create_time)
    return {
        "id": kb.knowledge_base_id,
        "organization_id": kb.organization_id,
        "created_by_user_id": kb.created_by_user_id or None,
        "credential_id": None,
        "name": kb.name,
        "description": kb.description,
        "embedding_config": EMBEDDING_CONFIG,
        "chunking_config": CHUNKING_CONFIG,
        "document_count": kb.document_count,
        "total_chunks": kb.total_chunks,
        "total_tokens": kb.total_tokens,
        "status": "active",
        "created_at": created,
        "updated_at": created,
        "stats": None,
    }


def document_json(d: tools_pb2.Document) -> Document:
    """The SDK's DocumentResponse of a Document."""
    return {
        "id": d.document_id,
        "knowledge_base_id": d.knowledge_base_id,
        "filename": d.name,
        "file_type": _FILE_TYPES.get(d.content_type, d.content_type),
        "file_size_bytes": d.file_size_bytes,
        "status": DOCUMENT_STATUS.get(d.status, d.status),
        "chunk_count": d.chunk_count,
        "token_count": d.token_count,
        "error_message": None,
        "created_at": pb.iso(d.create_time),
    }


def match_json(
    r: tools_pb2.KnowledgeSearchResult, include_content: bool = True, include_metadata: bool = True
) -> SearchMatch:
    """The SDK's SearchMatch of a search result."""
    return {
        "chunk_id": r.chunk_id,
        "document_id": r.document_id,
        "document_filename": r.document_name,
        "chunk_index": r.chunk_index,
        "score": r.score,
        "content": r.content if include_content else None,
        "metadata": {"knowledge_base_id": r.knowledge_base_id} if include_metadata else None,
    }


def _bounded_receive(receive: Receive, limit: int) -> Receive:
    """ASGI `receive` that raises BodyError 413 as soon as the body passes `limit` bytes, whatever
    the framing (Content-Length or chunked): the multipart parser reading through it stops there
    instead of spooling the whole body to disk first."""
    received = 0

    async def bounded() -> Message:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise BodyError(413, f"Upload exceeds {MAX_UPLOAD_BYTES} bytes")
        return message

    return bounded


async def owned_bases(
    tools: tools_pb2_grpc.ToolsServiceStub, org_id: str
) -> dict[str, tools_pb2.KnowledgeBase]:
    """The organization's knowledge bases by id."""
    response = await tools.ListKnowledgeBases(
        tools_pb2.ListKnowledgeBasesRequest(organization_id=org_id), timeout=TIMEOUT_S
    )
    return {kb.knowledge_base_id: kb for kb in response.knowledge_bases}


async def _search(
    tools: tools_pb2_grpc.ToolsServiceStub,
    org_id: str,
    query: str,
    ids: list[str],
    top_k: int,
    min_score: float,
) -> list[tools_pb2.KnowledgeSearchResult]:
    response = await tools.SearchKnowledge(
        tools_pb2.SearchKnowledgeRequest(
            organization_id=org_id, query=query, knowledge_base_ids=ids, top_k=top_k
        ),
        timeout=TIMEOUT_S,
    )
    return [r for r in response.results if r.score >= min_score]


router = APIRouter(responses=error_responses(404, 409, 413, 415))


@router.post(
    "/knowledge-bases",
    status_code=201,
    summary="Create a knowledge base",
    tags=["knowledge"],
    response_model=KnowledgeBase,
    openapi_extra=keyed(CREATE_KNOWLEDGE_BASE_BODY),
)
async def create_knowledge_base(request: Request, who: Principal = Who) -> Response:
    body = await body_of(request)
    check_fields(body, {"name", "description", "embedding_config", "chunking_config"})
    for name in ("embedding_config", "chunking_config"):
        if object_field(body, name):
            raise BodyError(
                400,
                f"{name} cannot be set: search is full-text and chunking is fixed"
                f" ({CHUNKING_CONFIG})",
            )
    response = await tools_of(request).CreateKnowledgeBase(
        tools_pb2.CreateKnowledgeBaseRequest(
            organization_id=who.organization_id,
            name=string_field(body, "name", required=True),
            description=string_field(body, "description"),
            user_id=who.user_id,
        ),
        timeout=TIMEOUT_S,
    )
    return JSONResponse(knowledge_base_json(response.knowledge_base), status_code=201)


@router.get(
    "/knowledge-bases",
    summary="The organization's knowledge bases, newest first",
    tags=["knowledge"],
    response_model=list[KnowledgeBase],
    openapi_extra=keyed(),
)
async def list_knowledge_bases(
    request: Request,
    who: Principal = Who,
    status: Annotated[
        str | None, Query(json_schema_extra={"enum": list(KNOWLEDGE_BASE_STATUSES)})
    ] = None,
    limit: Annotated[WholeNumber, Query(ge=1, le=500)] = 100,
    offset: Annotated[WholeNumber, Query(ge=0, le=2**31 - 1)] = 0,
) -> Response:
    if not 1 <= limit <= 500:
        raise BodyError(400, "limit must be between 1 and 500")
    if offset < 0:
        raise BodyError(400, "offset must be >= 0")
    if status is not None and status not in KNOWLEDGE_BASE_STATUSES:
        raise BodyError(400, f"status must be one of {', '.join(KNOWLEDGE_BASE_STATUSES)}")
    bases = list((await owned_bases(tools_of(request), who.organization_id)).values())
    if status is not None and status != "active":  # every base is active (indexing is per document)
        bases = []
    return JSONResponse([knowledge_base_json(kb) for kb in bases[offset : offset + limit]])


@router.post(
    "/knowledge-bases/search",
    summary="Search several knowledge bases",
    tags=["knowledge"],
    response_model=MultiSearch,
    openapi_extra=keyed(MULTI_SEARCH_BODY),
)
async def multi_search(request: Request, who: Principal = Who) -> Response:
    body = await body_of(request)
    check_fields(body, {"knowledge_base_ids", "query", "top_k", "min_score"})
    ids = body.get("knowledge_base_ids")
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, str) and 0 < len(i) <= MAX_ID_CHARS for i in ids)
    ):
        raise BodyError(
            400,
            "knowledge_base_ids must be a non-empty list of ids"
            f" (at most {MAX_ID_CHARS} characters each)",
        )
    if len(ids) > MAX_SEARCH_BASES:
        raise BodyError(
            400, f"knowledge_base_ids must name at most {MAX_SEARCH_BASES} knowledge bases"
        )
    query = string_field(body, "query", required=True)
    top_k = int_field(body, "top_k", 5, 1, 50)
    min_score = number_field(body, "min_score", 0.0)
    owned = await owned_bases(tools_of(request), who.organization_id)
    missing = [i for i in ids if i not in owned]
    if missing:
        return detail(404, "Knowledge base not found")
    matches = await _search(
        tools_of(request), who.organization_id, query, list(dict.fromkeys(ids)), top_k, min_score
    )
    found: MultiSearch = {
        "query": query,
        "knowledge_bases_searched": len(set(ids)),
        "top_k": top_k,
        "total_matches": len(matches),
        "matches": [match_json(m) for m in matches],
    }
    return JSONResponse(found)


@router.post(
    "/knowledge-bases/{knowledge_base_id}/search",
    summary="Search one knowledge base (full-text, BM25)",
    tags=["knowledge"],
    response_model=Search,
    openapi_extra=keyed(SEARCH_BODY),
)
async def search(knowledge_base_id: str, request: Request, who: Principal = Who) -> Response:
    body = await body_of(request)
    check_fields(
        body, {"query", "top_k", "min_score", "filters", "include_content", "include_metadata"}
    )
    if body.get("filters"):
        raise BodyError(400, "filters are not supported")
    query = string_field(body, "query", required=True)
    top_k = int_field(body, "top_k", 5, 1, 50)
    min_score = number_field(body, "min_score", 0.0)
    include_content = body.get("include_content", True)
    include_metadata = body.get("include_metadata", True)
    if not isinstance(include_content, bool) or not isinstance(include_metadata, bool):
        raise BodyError(400, "include_content and include_metadata must be booleans")
    if knowledge_base_id not in await owned_bases(tools_of(request), who.organization_id):
        return detail(404, "Knowledge base not found")
    matches = await _search(
        tools_of(request), who.organization_id, query, [knowledge_base_id], top_k, min_score
    )
    found: Search = {
        "query": query,
        "knowledge_base_id": knowledge_base_id,
        "top_k": top_k,
        "total_matches": len(matches),
        "matches": [match_json(m, include_content, include_metadata) for m in matches],
    }
    return JSONResponse(found)


@router.post(
    "/knowledge-bases/{knowledge_base_id}/documents",
    status_code=201,
    summary="Upload a document (multipart `file`)",
    tags=["knowledge"],
    response_model=Document,
    openapi_extra=keyed(UPLOAD_BODY),
)
async def upload_document(
    knowledge_base_id: str, request: Request, who: Principal = Who
) -> Response:
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise BodyError(400, "Upload the document as multipart/form-data with a 'file' part")
    # the knowledge base is looked up before a byte of the body is read (a chunked 200 MiB
    # upload to a base that does not exist was spooled to disk in full, then 404)
    if knowledge_base_id not in await owned_bases(tools_of(request), who.organization_id):
        return detail(404, "Knowledge base not found")
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_UPLOAD_BODY_BYTES:
        raise BodyError(413, f"Upload exceeds {MAX_UPLOAD_BYTES} bytes")
    try:
        form = await Request(
            request.scope, _bounded_receive(request.receive, MAX_UPLOAD_BODY_BYTES)
        ).form(max_files=1, max_fields=5)
    except BodyError:
        raise
    except Exception:  # noqa: BLE001 - a malformed multipart body is bad input
        raise BodyError(
            400, "The multipart body cannot be parsed (one 'file' part, optional 'metadata')"
        ) from None
    try:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise BodyError(400, "A 'file' part is required")
        data = await upload.read(MAX_UPLOAD_BYTES + 1)
        if len(data) > MAX_UPLOAD_BYTES:
            raise BodyError(413, f"Upload exceeds {MAX_UPLOAD_BYTES} bytes")
        name = (upload.filename or "document").rsplit("/", 1)[-1][:500]
        content_type = upload.content_type or ""
    finally:
        await form.close()
    if not data:
        raise BodyError(400, "The file is empty")
    try:
        response = await tools_of(request).AddDocument(
            tools_pb2.AddDocumentRequest(
                organization_id=who.organization_id,
                knowledge_base_id=knowledge_base_id,
                name=name,
                content_type=content_type,
                data=data,
            ),
            timeout=SLOW_TIMEOUT_S,
        )
    except grpc.aio.AioRpcError as exc:
        parsed = status_details(exc)
        if parsed.domain == TOOLS_DOMAIN and parsed.reason == "UNSUPPORTED_FILE_TYPE":
            return detail(415, parsed.message)
        return grpc_error_response(exc)
    return JSONResponse(document_json(response.document), status_code=201)


@router.get(
    "/knowledge-bases/{knowledge_base_id}/documents/{document_id}",
    summary="One document",
    tags=["knowledge"],
    response_model=Document,
    openapi_extra=keyed(),
)
async def get_document(
    knowledge_base_id: str, document_id: str, request: Request, who: Principal = Who
) -> Response:
    response = await tools_of(request).GetDocument(
        tools_pb2.GetDocumentRequest(
            organization_id=who.organization_id,
            knowledge_base_id=knowledge_base_id,
            document_id=document_id,
        ),
        timeout=TIMEOUT_S,
    )
    return JSONResponse(document_json(response.document))


@router.get(
    "/knowledge-bases/{knowledge_base_id}/documents/{document_id}/status",
    summary="A document's processing status",
    tags=["knowledge"],
    response_model=DocumentStatus,
    openapi_extra=keyed(),
)
async def document_status(
    knowledge_base_id: str, document_id: str, request: Request, who: Principal = Who
) -> Response:
    d = (
        await tools_of(request).GetDocument(
            tools_pb2.GetDocumentRequest(
                organization_id=who.organization_id,
                knowledge_base_id=knowledge_base_id,
                document_id=document_id,
            ),
            timeout=TIMEOUT_S,
        )
    ).document
    status = DOCUMENT_STATUS.get(d.status, d.status)
    created = pb.iso(d.create_time)
    answer: DocumentStatus = {
        "document_id": d.document_id,
        "status": status,
        "filename": d.name,
        "file_type": _FILE_TYPES.get(d.content_type, d.content_type),
        "message": f"Indexed into {d.chunk_count} chunks" if status == "completed" else None,
        # Documents are indexed within the upload request: it starts and ends then.
        "processing_started_at": created,
        "processing_completed_at": created if status == "completed" else None,
        "chunk_count": d.chunk_count,
        "token_count": d.token_count,
        "error": None,
    }
    return JSONResponse(answer)
