"""HTTP routes of credentials, MCP servers, OAuth2 and knowledge bases (issue #6), over the tools service.

Routes and JSON shapes follow the official SDK (`modulex/resources/credentials.py`,
`modulex/resources/knowledge.py` and their `types/`) wherever it has them. Every route
but the OAuth2 callback (which the browser reaches, carrying only the single-use
`state`) requires an owner or admin (the gateway's principal dependency), authenticated
before anything is looked up. Bad input is 400 `{"detail": ...}` (BodyError); tools
service failures go through the gateway's error table (`grpc_error_response`), except
an unsupported upload type, which is 415. Secrets are never returned: a credential shows
its metadata and, on request, a masked form.

Size limits (400 past them, checked before the tools service is called, so nothing is
stored): every string field at most STRING_LIMITS[field] characters (MAX_TEXT_CHARS for a
field not listed); the JSON objects at most OBJECT_LIMITS[field] bytes as compact UTF-8
JSON (metadata 16 KiB, with `expires_at` merged in); a multi-search names at most
MAX_SEARCH_BASES knowledge bases. Errors name the field and the limit, never the value.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, Any

import grpc
import orjson
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile
from starlette.types import Message, Receive

from loopline.assistant.v1 import assistant_pb2, assistant_pb2_grpc
from loopline.tools.v1 import tools_pb2, tools_pb2_grpc
from services.common import pb
from services.common.errors import TOOLS_DOMAIN, status_details
from services.common.validation import header_fields_problem
from services.gateway.app import BodyError, check_fields, read_json_object, refuse_body
from services.gateway.config import GatewaySettings
from services.gateway.errors import detail, grpc_error_response
from services.gateway.identity import Principal
from services.gateway.openapi import error_responses
from services.gateway.query import TrueOrFalse, WholeNumber

if TYPE_CHECKING:
    from services.gateway.org_settings import HeldDefault

log = logging.getLogger(__name__)

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
_TIMEOUT_S = 30.0
_MCP_TIMEOUT_S = 120.0

# The longest value of a string field of these routes, in characters, by field name. Names fit
# the tools service's columns (a credential's display_name and a knowledge base's name are
# VARCHAR(200) there, an integration name VARCHAR(100)); a listed credential or knowledge base
# also lands in model tool results, so its free text stays small.
STRING_LIMITS = {
    "display_name": 200,
    "name": 200,
    "integration_name": 100,
    "auth_type": 32,
    "expires_at": 64,
    "description": 10_000,
}
# Any other string field (server_url, redirect_uri, scope, a search query), in characters.
MAX_TEXT_CHARS = 2_048
# The largest JSON object field, in bytes of compact UTF-8 JSON, by field name: credential metadata
# (returned by every listing) 16 KiB; a secret (auth_data, MCP headers) 64 KiB / 16 KiB.
OBJECT_LIMITS = {"metadata": 16 * 1024, "auth_data": 64 * 1024, "headers": 16 * 1024}
# The most knowledge bases one multi-search names, and the longest id (ids are 36-character UUIDs).
MAX_SEARCH_BASES = 100
MAX_ID_CHARS = 64
# The auth types a credential list can filter by: the tools service's stored types and the SDK's
# alias `bearer_token` (SDK_AUTH_TYPES); checked here so that the 400 names the alias too.
CREDENTIAL_AUTH_TYPES = ("api_key", "bearer", "bearer_token", "oauth2", "mcp_server")


# ---- OpenAPI request bodies ---------------------------------------------------------------
# What each route's hand-written checks accept (`_string`, `_object`, `_bool`, `_int`, `_number`,
# `check_fields`), as JSON Schema for `openapi_extra` (the style of POST /assistant/chat): a
# generated client sends the body, and a body the schema allows passes the gateway's checks
# (tests/gateway/test_openapi_bodies.py). Byte limits of JSON objects cannot be written in JSON
# Schema; they are in the descriptions.


def _text_schema(name: str, *, required: bool = False) -> dict[str, Any]:
    """A `_string` field: required ones are non-blank strings (null is refused), others a string or null."""
    limit = STRING_LIMITS.get(name, MAX_TEXT_CHARS)
    if required:
        return {"type": "string", "minLength": 1, "maxLength": limit, "pattern": r"\S"}
    return {"type": ["string", "null"], "maxLength": limit}


def _object_schema(name: str, description: str = "") -> dict[str, Any]:
    """An `_object` field: a JSON object or null (at most OBJECT_LIMITS[name] bytes as compact JSON)."""
    schema: dict[str, Any] = {"type": ["object", "null"]}
    limit = OBJECT_LIMITS.get(name)
    text = " ".join(
        part
        for part in (description, f"At most {limit} bytes as compact UTF-8 JSON." if limit else "")
        if part
    )
    if text:
        schema["description"] = text
    return schema


_BOOLEAN = {"type": "boolean"}  # `_bool`: absent is false; null is refused
_NOT_SUPPORTED = {
    "type": "null",
    "description": "Not supported: any value but null is refused (400).",
}
_TOP_K = {"type": "integer", "minimum": 1, "maximum": 50, "default": 5}
_MIN_SCORE = {"type": "number", "default": 0.0}


def _json_body(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    """`openapi_extra` declaring a required JSON object body with exactly `properties`."""
    schema = {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


CREATE_CREDENTIAL_BODY = _json_body(
    {
        "integration_name": _text_schema("integration_name", required=True),
        "auth_data": _object_schema(
            "auth_data", 'The secret (e.g. {"api_key": ...}); encrypted, never returned.'
        ),
        "auth_type": {
            **_text_schema("auth_type"),
            "description": "One of the integration's auth types (bearer_token is bearer); "
            "inferred from auth_data when absent.",
        },
        "oauth_config": {
            **_NOT_SUPPORTED,
            "description": "Not supported (connect OAuth2 with POST /credentials/oauth2/initiate): "
            "any value but null is refused (400).",
        },
        "display_name": _text_schema("display_name"),
        "metadata": _object_schema("metadata", "With expires_at merged in."),
        "make_default": _BOOLEAN,
        "expires_at": _text_schema("expires_at"),
    },
    ["integration_name"],
)
CREATE_MCP_SERVER_BODY = _json_body(
    {
        "server_url": _text_schema("server_url", required=True),
        "headers": {
            **_object_schema("headers", "Header names to string values, sent to the server."),
            "additionalProperties": {"type": "string"},
        },
        "display_name": _text_schema("display_name"),
        "make_default": _BOOLEAN,
    },
    ["server_url"],
)
_IGNORED = {"description": "Accepted and ignored (the SDK sends it)."}
INITIATE_OAUTH2_BODY = _json_body(
    {
        "integration_name": _text_schema("integration_name", required=True),
        "redirect_uri": _text_schema("redirect_uri", required=True),
        "use_modulex_oauth": {
            "not": {"const": False},
            "description": "false (a custom OAuth app) is refused (400); "
            "the operator configures each OAuth2 integration.",
        },
        "custom_oauth_config": _NOT_SUPPORTED,
        "scope": _text_schema("scope"),
        "display_name": _text_schema("display_name"),
        "make_default": _BOOLEAN,
        "env_var_values": _NOT_SUPPORTED,
        "composer_chat_id": _IGNORED,
        "composer_request_id": _IGNORED,
        "composer_llm_config": _IGNORED,
    },
    ["integration_name", "redirect_uri"],
)
_FIXED_CONFIG = {
    "type": ["object", "null"],
    "maxProperties": 0,
    "description": "Cannot be set (search is full-text, chunking is fixed): only null or {} is accepted.",
}
CREATE_KNOWLEDGE_BASE_BODY = _json_body(
    {
        "name": _text_schema("name", required=True),
        "description": _text_schema("description"),
        "embedding_config": _FIXED_CONFIG,
        "chunking_config": _FIXED_CONFIG,
    },
    ["name"],
)
MULTI_SEARCH_BODY = _json_body(
    {
        "knowledge_base_ids": {
            "type": "array",
            "minItems": 1,
            "maxItems": MAX_SEARCH_BASES,
            "items": {"type": "string", "minLength": 1, "maxLength": MAX_ID_CHARS},
        },
        "query": _text_schema("query", required=True),
        "top_k": _TOP_K,
        "min_score": _MIN_SCORE,
    },
    ["knowledge_base_ids", "query"],
)
SEARCH_BODY = _json_body(
    {
        "query": _text_schema("query", required=True),
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
# The OAuth2 callback's query, read by hand below (a missing state, or neither code nor error, is 400
# "state and code are required"): declared here, so that `state` is required (OpenAPI cannot say
# "code or error"; their descriptions do).
OAUTH2_CALLBACK_PARAMETERS = {
    "parameters": [
        {
            "name": "state",
            "in": "query",
            "required": True,
            "schema": {"type": "string", "minLength": 1},
            "description": "The single-use state of POST /credentials/oauth2/initiate.",
        },
        {
            "name": "code",
            "in": "query",
            "required": False,
            "schema": {"type": "string"},
            "description": "The authorization code; required unless `error` is given.",
        },
        {
            "name": "error",
            "in": "query",
            "required": False,
            "schema": {"type": "string"},
            "description": "The authorization server's denial; required unless `code` is given (the state is spent either way).",
        },
        {
            "name": "error_description",
            "in": "query",
            "required": False,
            "schema": {"type": "string"},
            "description": "Ignored.",
        },
    ]
}
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
                            "description": f"The document (1 to {MAX_UPLOAD_BYTES} bytes; txt, md, html, csv, json or pdf).",
                        },
                        "metadata": {"type": "string", "description": "Accepted and ignored."},
                    },
                    "required": ["file"],
                }
            }
        },
    }
}


def _string(body: dict[str, Any], name: str, *, required: bool = False, default: str = "") -> str:
    """The string field `name` of `body` (`default` when absent or null).

    Raises BodyError 400 when it is not a string, is required and missing or blank, or is
    longer than STRING_LIMITS[name] (MAX_TEXT_CHARS for other fields) characters.
    """
    value = body.get(name)
    if value is None:
        if required:
            raise BodyError(400, f"{name} is required")
        return default
    if not isinstance(value, str) or (required and not value.strip()):
        raise BodyError(
            400, f"{name} must be a non-empty string" if required else f"{name} must be a string"
        )
    limit = STRING_LIMITS.get(name, MAX_TEXT_CHARS)
    if len(value) > limit:
        raise BodyError(400, f"{name} must be at most {limit} characters (it has {len(value)})")
    return value


def _object(body: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The JSON object field `name` of `body`, or None when absent or null.

    Raises BodyError 400 when it is not an object, or (for a field in OBJECT_LIMITS) larger
    than its limit as compact UTF-8 JSON (`check_json_size`).
    """
    value = body.get(name)
    if value is not None and not isinstance(value, dict):
        raise BodyError(400, f"{name} must be an object")
    if value is not None and name in OBJECT_LIMITS:
        check_json_size(name, value, OBJECT_LIMITS[name])
    return value


def check_json_size(name: str, value: Any, limit: int) -> None:
    """BodyError 400 when `value` is larger than `limit` bytes as compact UTF-8 JSON (the error
    names `name` and the sizes, never the content: it may be a secret)."""
    size = len(orjson.dumps(value))
    if size > limit:
        raise BodyError(
            400, f"{name} must be at most {limit} bytes when JSON-encoded (it has {size})"
        )


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise BodyError(400, f"{name} must be a boolean")
    return value


def _int(body: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    """`body[name]` (else `default`) as an int in `low`..`high`; BodyError 400 otherwise.

    A number with a zero fractional part (`19.0`) is an integer, as JSON Schema's `integer`
    type that the OpenAPI document declares says (JSON Schema 2020-12 Validation, section 6.1.1;
    JSON itself has one number type); `19.5`, a string or a boolean is not."""
    value = body.get(name, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BodyError(400, f"{name} must be an integer between {low} and {high}")
    return value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BodyError(400, f"{name} must be a number")
    return float(value)


SDK_AUTH_TYPES = {"bearer_token": "bearer"}


def infer_auth_type(auth_data: dict[str, Any] | None) -> str:
    """The auth type the SDK documents for `auth_data`: api_key, token/bearer_token -> bearer,
    access_token -> oauth2; "" (the integration's first secret type) otherwise."""
    data = auth_data or {}
    if "api_key" in data:
        return "api_key"
    if "token" in data or "bearer_token" in data:
        return "bearer"
    if "access_token" in data:
        return "oauth2"
    return ""


def credential_json(
    c: tools_pb2.Credential, detail_view: bool = False, created_by_email: str | None = None
) -> dict[str, Any]:
    """The SDK's CredentialResponse (or CredentialDetailResponse when `detail_view`) of a Credential."""
    metadata = pb.from_struct(c.metadata)
    body: dict[str, Any] = {
        "credential_id": c.credential_id,
        "integration_name": c.integration_name,
        "integration_type": "mcp" if c.auth_type == "mcp_server" else "integration",
        "display_name": c.display_name,
        "auth_type": c.auth_type,
        "is_default": c.is_default,
        "created_at": pb.iso(c.create_time),
        "updated_at": pb.iso(c.update_time),
        "last_used_at": None,
        "expires_at": metadata.get("expires_at"),
        "credentials_metadata": metadata,
    }
    if detail_view:
        body.update(
            organization_id=c.organization_id,
            created_by=c.created_by_user_id or None,
            created_by_email=created_by_email,
            auth_data_masked=c.auth_data_masked or None,
        )
    return body


def knowledge_base_json(kb: tools_pb2.KnowledgeBase) -> dict[str, Any]:
    """The SDK's KnowledgeBaseResponse of a KnowledgeBase (`created_by_user_id` null when not recorded)."""
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


def document_json(d: tools_pb2.Document) -> dict[str, Any]:
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
) -> dict[str, Any]:
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


def mcp_tool_json(t: tools_pb2.McpTool) -> dict[str, Any]:
    """{name, description, input_schema} of a discovered MCP tool."""
    return {
        "name": t.name,
        "description": t.description,
        "input_schema": pb.from_struct(t.input_schema),
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


def tools_router(
    settings: GatewaySettings,
    principal_dependency: Callable[[Request], Awaitable[Principal]],
    channel: grpc.aio.Channel,
    orchestrator_channel: grpc.aio.Channel | None = None,
    user_email: Callable[[str], Awaitable[str | None]] | None = None,
    hold_default_model: Callable[[str], contextlib.AbstractAsyncContextManager[HeldDefault]]
    | None = None,
) -> APIRouter:
    """The credentials and knowledge routes, calling the tools service on `channel`.

    Args:
        settings: the gateway's settings (max_body_bytes bounds JSON bodies).
        principal_dependency: `async (request) -> Principal`; raises AuthError (401/403).
        channel: a channel to the tools service.
        orchestrator_channel: a channel to the orchestrator, told about credentials
            connected through the OAuth2 callback (NotifyCredentialConnected); None skips it.
        user_email: `async (user_id) -> email or None`, for a credential's `created_by_email`
            (None: always null).
        hold_default_model: `DefaultModels.exclusive` (org_settings.py): a credential is deleted
            inside it, after its `saved` default is checked: the key of the organization's
            default model is 409, and no PUT of the default can save that key in between (None:
            not checked).
    """
    router = APIRouter(responses=error_responses(404, 409, 413, 415, 422))
    tools = tools_pb2_grpc.ToolsServiceStub(channel)
    orchestrator = (
        assistant_pb2_grpc.AssistantServiceStub(orchestrator_channel)
        if orchestrator_channel
        else None
    )
    Who = Depends(principal_dependency)  # noqa: N806 - reads like a type in the signatures

    async def body_of(request: Request) -> dict[str, Any]:
        return await read_json_object(request, settings.max_body_bytes)

    async def owned_bases(org_id: str) -> dict[str, tools_pb2.KnowledgeBase]:
        response = await tools.ListKnowledgeBases(
            tools_pb2.ListKnowledgeBasesRequest(organization_id=org_id), timeout=_TIMEOUT_S
        )
        return {kb.knowledge_base_id: kb for kb in response.knowledge_bases}

    # ---- credentials ------------------------------------------------------------------

    @router.post(
        "/credentials",
        status_code=201,
        summary="Create a credential (secret encrypted, never returned)",
        tags=["credentials"],
        openapi_extra=CREATE_CREDENTIAL_BODY,
    )
    async def create_credential(request: Request, who: Principal = Who) -> Response:
        body = await body_of(request)
        check_fields(
            body,
            {
                "integration_name",
                "auth_data",
                "auth_type",
                "oauth_config",
                "display_name",
                "metadata",
                "make_default",
                "expires_at",
            },
        )
        integration = _string(body, "integration_name", required=True)
        auth_data = _object(body, "auth_data")
        if body.get("oauth_config") is not None:
            raise BodyError(
                400,
                "oauth_config is not supported; connect OAuth2 integrations with POST /credentials/oauth2/initiate",
            )
        metadata = dict(_object(body, "metadata") or {})
        expires_at = _string(body, "expires_at")
        if expires_at:
            metadata["expires_at"] = expires_at
            check_json_size(
                "metadata", metadata, OBJECT_LIMITS["metadata"]
            )  # as stored, with expires_at
        auth_type = _string(body, "auth_type") or infer_auth_type(auth_data)
        # the SDK's CredentialAuthOption names a bearer token "bearer_token" (modulex/types/realtime.py)
        auth_type = SDK_AUTH_TYPES.get(auth_type, auth_type)
        response = await tools.CreateCredential(
            tools_pb2.CreateCredentialRequest(
                organization_id=who.organization_id,
                integration_name=integration,
                auth_type=auth_type,
                auth_data=pb.to_struct(auth_data or {}),
                display_name=_string(body, "display_name"),
                metadata=pb.to_struct(metadata),
                make_default=_bool(body, "make_default"),
                user_id=who.user_id,
            ),
            timeout=_TIMEOUT_S,
        )
        return JSONResponse(credential_json(response.credential), status_code=201)

    @router.get(
        "/credentials",
        summary="The organization's credentials (metadata only), newest first",
        tags=["credentials"],
    )
    async def list_credentials(
        who: Principal = Who,
        integration_name: str | None = None,
        # the enums are for the document only: the checks below give the 400s (their messages); an
        # empty auth_type is no filter
        auth_type: Annotated[
            str | None, Query(json_schema_extra={"enum": ["", *CREDENTIAL_AUTH_TYPES]})
        ] = None,
        limit: Annotated[WholeNumber, Query(ge=1, le=500)] = 100,
        offset: Annotated[WholeNumber, Query(ge=0, le=2**31 - 1)] = 0,
    ) -> Response:
        if not 1 <= limit <= 500:
            raise BodyError(400, "limit must be between 1 and 500")
        if offset < 0:
            raise BodyError(400, "offset must be >= 0")
        if auth_type and auth_type not in CREDENTIAL_AUTH_TYPES:
            raise BodyError(400, f"auth_type must be one of {', '.join(CREDENTIAL_AUTH_TYPES)}")
        response = await tools.ListCredentials(
            tools_pb2.ListCredentialsRequest(
                organization_id=who.organization_id,
                integration_name=integration_name or "",
                auth_type=SDK_AUTH_TYPES.get(auth_type, auth_type)
                if auth_type
                else "",  # the SDK's names, as on create
                limit=limit,
                offset=offset,
            ),
            timeout=_TIMEOUT_S,
        )
        return JSONResponse(
            {
                "credentials": [credential_json(c) for c in response.credentials],
                "total": response.total,
                "limit": limit,
                "offset": offset,
                "has_next": offset + len(response.credentials) < response.total,
                "has_previous": offset > 0,
            }
        )

    @router.post(
        "/credentials/mcp-server",
        status_code=201,
        summary="Register a Streamable HTTP MCP server",
        tags=["credentials"],
        openapi_extra=CREATE_MCP_SERVER_BODY,
    )
    async def create_mcp_server(request: Request, who: Principal = Who) -> Response:
        body = await body_of(request)
        check_fields(body, {"server_url", "headers", "display_name", "make_default"})
        url = _string(body, "server_url", required=True)
        headers = _object(body, "headers") or {}
        problem = header_fields_problem(headers)
        if problem is not None:
            raise BodyError(400, problem)
        response = await tools.CreateMcpServer(
            tools_pb2.CreateMcpServerRequest(
                organization_id=who.organization_id,
                server_url=url,
                headers=pb.to_struct(headers),
                display_name=_string(body, "display_name"),
                make_default=_bool(body, "make_default"),
                user_id=who.user_id,
            ),
            timeout=_MCP_TIMEOUT_S,
        )
        c = response.credential
        return JSONResponse(
            {
                "credential_id": c.credential_id,
                "integration_name": c.integration_name,
                "display_name": c.display_name,
                "auth_type": c.auth_type,
                "is_default": c.is_default,
                "created_at": pb.iso(c.create_time),
                "credentials_metadata": pb.from_struct(c.metadata),
                "tools": [mcp_tool_json(t) for t in response.tools],
                "total_tools": len(response.tools),
                "discovery_error": response.discovery_error or None,
            },
            status_code=201,
        )

    @router.post(
        "/credentials/oauth2/initiate",
        summary="Start an OAuth2 authorization code flow (PKCE)",
        tags=["credentials"],
        openapi_extra=INITIATE_OAUTH2_BODY,
    )
    async def initiate_oauth2(request: Request, who: Principal = Who) -> Response:
        body = await body_of(request)
        check_fields(
            body,
            {
                "integration_name",
                "redirect_uri",
                "use_modulex_oauth",
                "custom_oauth_config",
                "scope",
                "display_name",
                "make_default",
                "env_var_values",
                "composer_chat_id",
                "composer_request_id",
                "composer_llm_config",
            },
        )
        if body.get("custom_oauth_config") is not None or body.get("use_modulex_oauth") is False:
            raise BodyError(
                400,
                "custom OAuth apps are not supported; the operator configures each OAuth2 integration",
            )
        if body.get("env_var_values") is not None:
            raise BodyError(400, "env_var_values is not supported")
        response = await tools.InitiateOAuth2(
            tools_pb2.InitiateOAuth2Request(
                organization_id=who.organization_id,
                integration_name=_string(body, "integration_name", required=True),
                redirect_uri=_string(body, "redirect_uri", required=True),
                scope=_string(body, "scope"),
                display_name=_string(body, "display_name"),
                make_default=_bool(body, "make_default"),
                user_id=who.user_id,
            ),
            timeout=_TIMEOUT_S,
        )
        return JSONResponse(
            {"authorization_url": response.authorization_url, "state": response.state}
        )

    @router.get(
        "/credentials/oauth2/callback",
        summary="OAuth2 redirect target: exchange the code, store the credential",
        tags=["credentials"],
        openapi_extra=OAUTH2_CALLBACK_PARAMETERS,
    )
    async def oauth2_callback(
        state: Annotated[str, Query(include_in_schema=False)] = "",
        code: Annotated[str, Query(include_in_schema=False)] = "",
        error: Annotated[str, Query(include_in_schema=False)] = "",
        error_description: Annotated[str, Query(include_in_schema=False)] = "",
    ) -> Response:
        # No API key here: the browser arrives from the authorization server; the
        # single-use, unguessable state names the organization and the flow.
        if not state or not (code or error):
            return detail(400, "state and code are required")
        # a denial (`error`) spends the single-use state too: the flow cannot go on to an exchange
        # (fresh-eyes test); the state is checked first, so a forged one is "Unknown or expired"
        response = await tools.CompleteOAuth2(
            tools_pb2.CompleteOAuth2Request(state=state, code=code, error=error[:2000]),
            timeout=_TIMEOUT_S,
        )
        c = response.credential
        notified = False
        if orchestrator is not None:
            try:
                await orchestrator.NotifyCredentialConnected(
                    assistant_pb2.NotifyCredentialConnectedRequest(
                        organization_id=c.organization_id,
                        integration=c.integration_name,
                        credential_id=c.credential_id,
                        user_id=response.user_id,
                    ),
                    timeout=10,
                )
                notified = True
            except grpc.aio.AioRpcError as exc:
                # The credential is stored either way; a paused run can still be resumed by hand.
                log.warning(
                    "credential notice not delivered",
                    extra={"fields": {"code": exc.code().name, "credential_id": c.credential_id}},
                )
        return JSONResponse(
            {"status": "connected", "orchestrator_notified": notified, **credential_json(c)}
        )

    @router.get(
        "/credentials/{credential_id}",
        summary="One credential (masked secret on request)",
        tags=["credentials"],
    )
    async def get_credential(
        credential_id: str, who: Principal = Who, include_masked: TrueOrFalse = False
    ) -> Response:
        response = await tools.GetCredential(
            tools_pb2.GetCredentialRequest(
                organization_id=who.organization_id,
                credential_id=credential_id,
                include_masked=include_masked,
            ),
            timeout=_TIMEOUT_S,
        )
        creator = response.credential.created_by_user_id
        email = await user_email(creator) if user_email is not None and creator else None
        return JSONResponse(
            credential_json(response.credential, detail_view=True, created_by_email=email)
        )

    @router.delete(
        "/credentials/{credential_id}",
        status_code=204,
        summary="Delete a credential",
        tags=["credentials"],
    )
    async def delete_credential(
        credential_id: str, request: Request, who: Principal = Who
    ) -> Response:
        await refuse_body(request, settings.max_body_bytes)
        held = (
            hold_default_model(who.organization_id)
            if hold_default_model is not None
            else contextlib.nullcontext()
        )
        async with held as default:  # no PUT of the default between this check and the deletion
            saved = default.saved if default is not None else None
            if saved is not None and saved.get("credential_id") == credential_id:
                # deleting it would break every turn that names no model (they use the saved default)
                raise BodyError(
                    409,
                    "This credential is the key of the organization's default model: save another default "
                    "with PUT /organizations/settings/composer-llm first",
                )
            await tools.DeleteCredential(
                tools_pb2.DeleteCredentialRequest(
                    organization_id=who.organization_id, credential_id=credential_id
                ),
                timeout=_TIMEOUT_S,
            )
        return Response(status_code=204)

    @router.post(
        "/credentials/{credential_id}/set-default",
        summary="Make a credential its integration's default",
        tags=["credentials"],
    )
    async def set_default(credential_id: str, request: Request, who: Principal = Who) -> Response:
        await refuse_body(request, settings.max_body_bytes)
        response = await tools.SetDefaultCredential(
            tools_pb2.SetDefaultCredentialRequest(
                organization_id=who.organization_id, credential_id=credential_id
            ),
            timeout=_TIMEOUT_S,
        )
        return JSONResponse(credential_json(response.credential))

    @router.post(
        "/credentials/{credential_id}/refresh-discovery",
        summary="Discover an MCP server's tools again",
        tags=["credentials"],
    )
    async def refresh_discovery(
        credential_id: str, request: Request, who: Principal = Who
    ) -> Response:
        await refuse_body(request, settings.max_body_bytes)
        r = await tools.RefreshMcpDiscovery(
            tools_pb2.RefreshMcpDiscoveryRequest(
                organization_id=who.organization_id, credential_id=credential_id
            ),
            timeout=_MCP_TIMEOUT_S,
        )
        return JSONResponse(
            {
                "credential_id": r.credential_id,
                "refreshed_at": pb.iso(r.refresh_time),
                "changes": {"added": list(r.added), "removed": list(r.removed)},
                "total_tools": r.total_tools,
                "success": r.success,
                "error": r.error or None,
            }
        )

    @router.get(
        "/credentials/{credential_id}/mcp-tools",
        summary="The tools discovered on an MCP server",
        tags=["credentials"],
    )
    async def mcp_tools(credential_id: str, who: Principal = Who) -> Response:
        r = await tools.ListMcpTools(
            tools_pb2.ListMcpToolsRequest(
                organization_id=who.organization_id, credential_id=credential_id
            ),
            timeout=_TIMEOUT_S,
        )
        return JSONResponse(
            {
                "credential_id": r.credential_id,
                "tools": [mcp_tool_json(t) for t in r.tools],
                "total_count": len(r.tools),
                "discovered_at": pb.iso(r.discovery_time) if r.HasField("discovery_time") else None,
            }
        )

    # ---- knowledge ----------------------------------------------------------------------

    @router.post(
        "/knowledge-bases",
        status_code=201,
        summary="Create a knowledge base",
        tags=["knowledge"],
        openapi_extra=CREATE_KNOWLEDGE_BASE_BODY,
    )
    async def create_knowledge_base(request: Request, who: Principal = Who) -> Response:
        body = await body_of(request)
        check_fields(body, {"name", "description", "embedding_config", "chunking_config"})
        for name in ("embedding_config", "chunking_config"):
            if _object(body, name):
                raise BodyError(
                    400,
                    f"{name} cannot be set: search is full-text and chunking is fixed ({CHUNKING_CONFIG})",
                )
        response = await tools.CreateKnowledgeBase(
            tools_pb2.CreateKnowledgeBaseRequest(
                organization_id=who.organization_id,
                name=_string(body, "name", required=True),
                description=_string(body, "description"),
                user_id=who.user_id,
            ),
            timeout=_TIMEOUT_S,
        )
        return JSONResponse(knowledge_base_json(response.knowledge_base), status_code=201)

    @router.get(
        "/knowledge-bases",
        summary="The organization's knowledge bases, newest first",
        tags=["knowledge"],
    )
    async def list_knowledge_bases(
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
        bases = list((await owned_bases(who.organization_id)).values())
        if (
            status is not None and status != "active"
        ):  # every base is active (indexing is per document)
            bases = []
        return JSONResponse([knowledge_base_json(kb) for kb in bases[offset : offset + limit]])

    @router.post(
        "/knowledge-bases/search",
        summary="Search several knowledge bases",
        tags=["knowledge"],
        openapi_extra=MULTI_SEARCH_BODY,
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
                f"knowledge_base_ids must be a non-empty list of ids (at most {MAX_ID_CHARS} characters each)",
            )
        if len(ids) > MAX_SEARCH_BASES:
            raise BodyError(
                400, f"knowledge_base_ids must name at most {MAX_SEARCH_BASES} knowledge bases"
            )
        query = _string(body, "query", required=True)
        top_k = _int(body, "top_k", 5, 1, 50)
        min_score = _number(body, "min_score", 0.0)
        owned = await owned_bases(who.organization_id)
        missing = [i for i in ids if i not in owned]
        if missing:
            return detail(404, "Knowledge base not found")
        matches = await _search(
            who.organization_id, query, list(dict.fromkeys(ids)), top_k, min_score
        )
        return JSONResponse(
            {
                "query": query,
                "knowledge_bases_searched": len(set(ids)),
                "top_k": top_k,
                "total_matches": len(matches),
                "matches": [match_json(m) for m in matches],
            }
        )

    async def _search(
        org_id: str, query: str, ids: list[str], top_k: int, min_score: float
    ) -> list[tools_pb2.KnowledgeSearchResult]:
        response = await tools.SearchKnowledge(
            tools_pb2.SearchKnowledgeRequest(
                organization_id=org_id, query=query, knowledge_base_ids=ids, top_k=top_k
            ),
            timeout=_TIMEOUT_S,
        )
        return [r for r in response.results if r.score >= min_score]

    @router.post(
        "/knowledge-bases/{knowledge_base_id}/search",
        summary="Search one knowledge base (full-text, BM25)",
        tags=["knowledge"],
        openapi_extra=SEARCH_BODY,
    )
    async def search(knowledge_base_id: str, request: Request, who: Principal = Who) -> Response:
        body = await body_of(request)
        check_fields(
            body, {"query", "top_k", "min_score", "filters", "include_content", "include_metadata"}
        )
        if body.get("filters"):
            raise BodyError(400, "filters are not supported")
        query = _string(body, "query", required=True)
        top_k = _int(body, "top_k", 5, 1, 50)
        min_score = _number(body, "min_score", 0.0)
        include_content = body.get("include_content", True)
        include_metadata = body.get("include_metadata", True)
        if not isinstance(include_content, bool) or not isinstance(include_metadata, bool):
            raise BodyError(400, "include_content and include_metadata must be booleans")
        if knowledge_base_id not in await owned_bases(who.organization_id):
            return detail(404, "Knowledge base not found")
        matches = await _search(who.organization_id, query, [knowledge_base_id], top_k, min_score)
        return JSONResponse(
            {
                "query": query,
                "knowledge_base_id": knowledge_base_id,
                "top_k": top_k,
                "total_matches": len(matches),
                "matches": [match_json(m, include_content, include_metadata) for m in matches],
            }
        )

    @router.post(
        "/knowledge-bases/{knowledge_base_id}/documents",
        status_code=201,
        summary="Upload a document (multipart `file`)",
        tags=["knowledge"],
        openapi_extra=UPLOAD_BODY,
    )
    async def upload_document(
        knowledge_base_id: str, request: Request, who: Principal = Who
    ) -> Response:
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise BodyError(400, "Upload the document as multipart/form-data with a 'file' part")
        # the knowledge base is looked up before a byte of the body is read (a chunked 200 MiB
        # upload to a base that does not exist was spooled to disk in full, then 404)
        if knowledge_base_id not in await owned_bases(who.organization_id):
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
            response = await tools.AddDocument(
                tools_pb2.AddDocumentRequest(
                    organization_id=who.organization_id,
                    knowledge_base_id=knowledge_base_id,
                    name=name,
                    content_type=content_type,
                    data=data,
                ),
                timeout=_MCP_TIMEOUT_S,
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
    )
    async def get_document(
        knowledge_base_id: str, document_id: str, who: Principal = Who
    ) -> Response:
        response = await tools.GetDocument(
            tools_pb2.GetDocumentRequest(
                organization_id=who.organization_id,
                knowledge_base_id=knowledge_base_id,
                document_id=document_id,
            ),
            timeout=_TIMEOUT_S,
        )
        return JSONResponse(document_json(response.document))

    @router.get(
        "/knowledge-bases/{knowledge_base_id}/documents/{document_id}/status",
        summary="A document's processing status",
        tags=["knowledge"],
    )
    async def document_status(
        knowledge_base_id: str, document_id: str, who: Principal = Who
    ) -> Response:
        d = (
            await tools.GetDocument(
                tools_pb2.GetDocumentRequest(
                    organization_id=who.organization_id,
                    knowledge_base_id=knowledge_base_id,
                    document_id=document_id,
                ),
                timeout=_TIMEOUT_S,
            )
        ).document
        status = DOCUMENT_STATUS.get(d.status, d.status)
        created = pb.iso(d.create_time)
        return JSONResponse(
            {
                "document_id": d.document_id,
                "status": status,
                "filename": d.name,
                "file_type": _FILE_TYPES.get(d.content_type, d.content_type),
                "message": f"Indexed into {d.chunk_count} chunks"
                if status == "completed"
                else None,
                # Documents are indexed within the upload request: it starts and ends then.
                "processing_started_at": created,
                "processing_completed_at": created if status == "completed" else None,
                "chunk_count": d.chunk_count,
                "token_count": d.token_count,
                "error": None,
            }
        )

    return router
