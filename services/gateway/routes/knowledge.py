"""Knowledge routes: knowledge bases and their documents (over the tools service); the search
routes are in knowledge_search.py.

Routes and JSON shapes follow the official SDK (`modulex/resources/knowledge.py` and its
`types/`). Every route requires an owner or admin, authenticated before anything is looked up.
Bad input is 400 `{"detail": ...}`; another organization's knowledge base or document is 404;
tools service failures go through the error table, except an unsupported upload type, which is
415.
"""

from __future__ import annotations

from typing import Annotated, Any

import grpc
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile
from starlette.types import Message, Receive

from loopline.tools.v1 import tools_pb2, tools_pb2_grpc
from services.common import pb
from services.common.errors import TOOLS_DOMAIN, status_details
from services.gateway.bodies import check_fields, refuse_body
from services.gateway.context import context_of
from services.gateway.errors import BodyError, detail, grpc_error_response
from services.gateway.identity import Principal
from services.gateway.openapi import error_responses, keyed
from services.gateway.query import TrueOrFalse, WholeNumber
from services.gateway.routes.fields import (
    MAX_ID_CHARS,
    SLOW_TIMEOUT_S,
    TIMEOUT_S,
    Who,
    body_of,
    int_field,
    json_body,
    object_field,
    string_field,
    text_schema,
    tools_of,
)
from services.gateway.schemas import Document, DocumentStatus, KnowledgeBase

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
# The SDK's DocumentStatus: the `?status=` filter of GET .../documents takes these.
DOCUMENT_STATUSES = ("pending", "processing", "completed", "failed")
# The documents read per ListDocuments call when GET .../documents filters by status.
DOCUMENTS_PAGE = 500
# The chunking the tools service applies (shown as a knowledge base's chunking_config): by
# headings and paragraphs, chunks of at most 900 characters, each after a section's first
# starting with the last ~150 of the one before (services/tools/chunking.py; a test pins them).
CHUNKING_CONFIG = {"strategy": "structure", "max_chars": 900, "overlap_chars": 150}
# The embedding providers of POST /knowledge-bases, and the most dimensions a vector may have
# (pgvector's limit).
EMBEDDING_PROVIDERS = ("local", "openai")
MAX_EMBEDDING_DIMENSIONS = 16_000
MAX_MODEL_CHARS = 200  # the tools service's column
_FILE_TYPES = {
    "text/plain": "txt",
    "text/markdown": "md",
    "text/html": "html",
    "text/csv": "csv",
    "application/json": "json",
    "application/pdf": "pdf",
}
_EMBEDDING_CONFIG = {
    "type": ["object", "null"],
    "properties": {
        "provider": {"enum": [*EMBEDDING_PROVIDERS, None], "default": "local"},
        "model": {"type": "string", "minLength": 1, "maxLength": MAX_MODEL_CHARS, "pattern": r"\S"},
        "credential_id": {
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_ID_CHARS,
            "pattern": r"\S",
        },
        "dimensions": {"type": "integer", "minimum": 1, "maximum": MAX_EMBEDDING_DIMENSIONS},
    },
    "additionalProperties": False,
    "if": {"properties": {"provider": {"const": "openai"}}, "required": ["provider"]},
    "then": {"required": ["model", "credential_id"]},
    "else": {"properties": {"model": False, "credential_id": False, "dimensions": False}},
    "description": "How the chunks are embedded: null, {} or {provider: local} for the tools"
    " service's own model (all-MiniLM-L6-v2); {provider: openai, model, credential_id,"
    " dimensions?} for an OpenAI-compatible embeddings API with the organization's credential"
    " of integration openai (dimensions: read from the API's first answer when absent).",
}
_FIXED_CONFIG = {
    "type": ["object", "null"],
    "maxProperties": 0,
    "description": "Cannot be set (chunking is fixed, shown as chunking_config):"
    " only null or {} is accepted.",
}
CREATE_KNOWLEDGE_BASE_BODY = json_body(
    {
        "name": text_schema("name", required=True),
        "description": text_schema("description"),
        "embedding_config": _EMBEDDING_CONFIG,
        "chunking_config": _FIXED_CONFIG,
    },
    ["name"],
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
    """The SDK's KnowledgeBaseResponse of `kb` (`created_by_user_id` null when not recorded;
    `credential_id` the embedding model's credential, null for the local model)."""
    created = pb.iso(kb.create_time)
    return {
        "id": kb.knowledge_base_id,
        "organization_id": kb.organization_id,
        "created_by_user_id": kb.created_by_user_id or None,
        "credential_id": kb.embedding.credential_id or None,
        "name": kb.name,
        "description": kb.description,
        "embedding_config": {
            "provider": kb.embedding.provider,
            "model": kb.embedding.model,
            "dimensions": kb.embedding.dimensions,
        },
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
        "error_message": d.error_message or None,
        "created_at": pb.iso(d.create_time),
    }


def embedding_config(body: dict[str, Any]) -> tools_pb2.EmbeddingConfig | None:
    """The EmbeddingConfig of a POST /knowledge-bases body; None (the local model) for no
    `embedding_config`, null, {} or {provider: local}.

    Raises BodyError 400 for other fields, another provider, the local provider with a model,
    credential or dimensions, or "openai" without model and credential_id.
    """
    config = object_field(body, "embedding_config")
    if not config:
        return None
    allowed = {"provider", "model", "credential_id", "dimensions"}
    unknown = sorted(set(config) - allowed)
    if unknown:
        raise BodyError(
            400,
            f"embedding_config: unknown field(s): {', '.join(unknown)}"
            " (it takes provider, model, credential_id and dimensions)",
        )
    provider = config.get("provider")
    if provider is None:
        provider = "local"
    if not isinstance(provider, str) or provider not in EMBEDDING_PROVIDERS:
        raise BodyError(400, "embedding_config.provider must be local or openai")
    if provider == "local":
        if set(config) - {"provider"}:
            raise BodyError(
                400,
                "embedding_config: the local provider (all-MiniLM-L6-v2) takes no model,"
                " credential_id or dimensions",
            )
        return None
    fields: dict[str, str] = {}
    for name, limit in (("model", MAX_MODEL_CHARS), ("credential_id", MAX_ID_CHARS)):
        value = config.get(name)
        if not isinstance(value, str) or not value.strip() or len(value) > limit:
            raise BodyError(
                400,
                f"embedding_config.{name} is required for the openai provider"
                f" (a non-empty string of at most {limit} characters)",
            )
        fields[name] = value
    dimensions = 0  # the tools service reads them from the API's first answer
    if "dimensions" in config:
        try:
            dimensions = int_field(config, "dimensions", 0, 1, MAX_EMBEDDING_DIMENSIONS)
        except BodyError:
            raise BodyError(
                400,
                "embedding_config.dimensions must be an integer between 1 and"
                f" {MAX_EMBEDDING_DIMENSIONS}",
            ) from None
    return tools_pb2.EmbeddingConfig(provider=provider, dimensions=dimensions, **fields)


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


async def documents_page(
    tools: tools_pb2_grpc.ToolsServiceStub,
    org_id: str,
    knowledge_base_id: str,
    status: str | None,
    limit: int,
    offset: int,
) -> list[tools_pb2.Document]:
    """A page of a knowledge base's documents, newest first; with `status` (the SDK's
    DocumentStatus), of the documents in that status: the tools service lists without a
    filter, so its pages are read (DOCUMENTS_PAGE at a time) until the page is full."""
    if status is None:
        response = await tools.ListDocuments(
            tools_pb2.ListDocumentsRequest(
                organization_id=org_id,
                knowledge_base_id=knowledge_base_id,
                limit=limit,
                offset=offset,
            ),
            timeout=TIMEOUT_S,
        )
        return list(response.documents)
    matching: list[tools_pb2.Document] = []
    read = 0
    while len(matching) < offset + limit:
        page = (
            await tools.ListDocuments(
                tools_pb2.ListDocumentsRequest(
                    organization_id=org_id,
                    knowledge_base_id=knowledge_base_id,
                    limit=DOCUMENTS_PAGE,
                    offset=read,
                ),
                timeout=TIMEOUT_S,
            )
        ).documents
        matching += [d for d in page if DOCUMENT_STATUS.get(d.status, d.status) == status]
        read += len(page)
        if len(page) < DOCUMENTS_PAGE:
            break
    return matching[offset : offset + limit]


async def owned_bases(
    tools: tools_pb2_grpc.ToolsServiceStub, org_id: str
) -> dict[str, tools_pb2.KnowledgeBase]:
    """The organization's knowledge bases by id."""
    response = await tools.ListKnowledgeBases(
        tools_pb2.ListKnowledgeBasesRequest(organization_id=org_id), timeout=TIMEOUT_S
    )
    return {kb.knowledge_base_id: kb for kb in response.knowledge_bases}


def check_page(limit: int, offset: int, status: str | None, statuses: tuple[str, ...]) -> None:
    """A listing's `limit` (1 to 500), `offset` (>= 0) and `status` (one of `statuses`, or
    None); BodyError 400 naming the first that is not."""
    if not 1 <= limit <= 500:
        raise BodyError(400, "limit must be between 1 and 500")
    if offset < 0:
        raise BodyError(400, "offset must be >= 0")
    if status is not None and status not in statuses:
        raise BodyError(400, f"status must be one of {', '.join(statuses)}")


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
    if object_field(body, "chunking_config"):
        raise BodyError(
            400,
            "chunking_config cannot be set: documents are cut by headings and paragraphs into"
            f" chunks of at most {CHUNKING_CONFIG['max_chars']} characters overlapping by about"
            f" {CHUNKING_CONFIG['overlap_chars']}",
        )
    name = string_field(body, "name", required=True)
    description = string_field(body, "description")
    response = await tools_of(request).CreateKnowledgeBase(
        tools_pb2.CreateKnowledgeBaseRequest(
            organization_id=who.organization_id,
            name=name,
            description=description,
            user_id=who.user_id,
            embedding=embedding_config(body),
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
    check_page(limit, offset, status, KNOWLEDGE_BASE_STATUSES)
    bases = list((await owned_bases(tools_of(request), who.organization_id)).values())
    if status is not None and status != "active":  # every base is active (indexing is per document)
        bases = []
    return JSONResponse([knowledge_base_json(kb) for kb in bases[offset : offset + limit]])


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
    chunks = f"{d.chunk_count} chunk{'' if d.chunk_count == 1 else 's'}"
    messages = {
        "completed": f"Indexed into {chunks}",
        "processing": f"Embedding {chunks}; keyword search already finds them",
    }
    answer: DocumentStatus = {
        "document_id": d.document_id,
        "status": status,
        "filename": d.name,
        "file_type": _FILE_TYPES.get(d.content_type, d.content_type),
        "message": messages.get(status, d.error_message or None),
        # Processing starts within the upload request and ends when its last chunk is embedded.
        "processing_started_at": created,
        "processing_completed_at": (
            pb.iso(d.index_time) if status == "completed" and d.HasField("index_time") else None
        ),
        "chunk_count": d.chunk_count,
        "token_count": d.token_count,
        "error": d.error_message or None,
    }
    return JSONResponse(answer)


@router.get(
    "/knowledge-bases/{knowledge_base_id}",
    summary="One knowledge base",
    tags=["knowledge"],
    response_model=KnowledgeBase,
    openapi_extra=keyed(),
)
async def get_knowledge_base(
    knowledge_base_id: str, request: Request, who: Principal = Who
) -> Response:
    kb = (await owned_bases(tools_of(request), who.organization_id)).get(knowledge_base_id)
    if kb is None:
        return detail(404, "Knowledge base not found")
    return JSONResponse(knowledge_base_json(kb))


@router.delete(
    "/knowledge-bases/{knowledge_base_id}",
    status_code=204,
    summary="Delete a knowledge base with its documents",
    tags=["knowledge"],
    openapi_extra=keyed(),
)
async def delete_knowledge_base(
    knowledge_base_id: str,
    request: Request,
    who: Principal = Who,
    delete_files: Annotated[
        TrueOrFalse, Query(description="Accepted: no uploaded file is kept apart to delete.")
    ] = True,
) -> Response:
    await refuse_body(request, context_of(request).settings.max_body_bytes)
    await tools_of(request).DeleteKnowledgeBase(
        tools_pb2.DeleteKnowledgeBaseRequest(
            organization_id=who.organization_id, knowledge_base_id=knowledge_base_id
        ),
        timeout=TIMEOUT_S,
    )
    return Response(status_code=204)


@router.get(
    "/knowledge-bases/{knowledge_base_id}/documents",
    summary="A knowledge base's documents, newest first",
    tags=["knowledge"],
    response_model=list[Document],
    openapi_extra=keyed(),
)
async def list_documents(
    knowledge_base_id: str,
    request: Request,
    who: Principal = Who,
    status: Annotated[
        str | None, Query(json_schema_extra={"enum": list(DOCUMENT_STATUSES)})
    ] = None,
    limit: Annotated[WholeNumber, Query(ge=1, le=500)] = 100,
    offset: Annotated[WholeNumber, Query(ge=0, le=2**31 - 1)] = 0,
) -> Response:
    check_page(limit, offset, status, DOCUMENT_STATUSES)
    documents = await documents_page(
        tools_of(request), who.organization_id, knowledge_base_id, status, limit, offset
    )
    return JSONResponse([document_json(d) for d in documents])


@router.delete(
    "/knowledge-bases/{knowledge_base_id}/documents/{document_id}",
    status_code=204,
    summary="Delete a document with its chunks",
    tags=["knowledge"],
    openapi_extra=keyed(),
)
async def delete_document(
    knowledge_base_id: str,
    document_id: str,
    request: Request,
    who: Principal = Who,
    delete_file: Annotated[
        TrueOrFalse, Query(description="Accepted: no uploaded file is kept apart to delete.")
    ] = True,
) -> Response:
    await refuse_body(request, context_of(request).settings.max_body_bytes)
    await tools_of(request).DeleteDocument(
        tools_pb2.DeleteDocumentRequest(
            organization_id=who.organization_id,
            knowledge_base_id=knowledge_base_id,
            document_id=document_id,
        ),
        timeout=TIMEOUT_S,
    )
    return Response(status_code=204)
