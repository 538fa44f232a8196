"""The tools service's gRPC server: `ToolsServicer` and `ToolsServer` (docs/CONVENTIONS.md).

`ExecuteTool` never fails as an RPC for a tool failure: it answers success=false with
an error message (DESIGN.md, tools.proto). Credential and knowledge RPCs raise
`RpcError`s, which one wrapper turns into rich statuses (google.rpc.Status + ErrorInfo).
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
import uuid
from typing import Any

import grpc
import orjson

from loopline.tools.v1 import tools_pb2, tools_pb2_grpc
from services.common import db, ids, pb
from services.common.errors import TOOLS_DOMAIN, RpcError, bounded, rpc_handler
from services.common.grpc_server import RunningServer, start_grpc_server
from services.common.logging import bind
from services.common.validation import header_fields_problem
from services.tools.catalogue import ActionError, Catalogue
from services.tools.config import ToolsSettings
from services.tools.credentials import CredentialInfo, CredentialStore
from services.tools.crypto import SecretBox, SecretBoxError
from services.tools.extract import (
    MEDIA_TYPES,
    ExtractionError,
    UnsupportedFileType,
    extract_text,
    file_type,
)
from services.tools.knowledge import KnowledgeStore
from services.tools.mcp_servers import (
    MCP_AUTH_TYPE,
    McpConnector,
    StdioRegistry,
    check_url_policy,
    parse_stdio_servers,
    slug,
)
from services.tools.models import KnowledgeBase, KnowledgeDocument
from services.tools.netpolicy import OutboundPolicyError
from services.tools.oauth import OAuth2Flows, integration_of, parse_providers
from services.tools.tools import PROFILES, ToolExecutor

log = logging.getLogger(__name__)

SERVICE_NAME = tools_pb2.DESCRIPTOR.services_by_name["ToolsService"].full_name


# RpcError -> its rich status; any other exception -> INTERNAL with a generic message.
rpc_errors = rpc_handler(
    internal_domain=TOOLS_DOMAIN,
    check=ids.request_organization_check(TOOLS_DOMAIN, "ORGANIZATION_REQUIRED"),
)


def urllib_host(url: str) -> str:
    """The host of `url` ("" when it has none)."""
    return urllib.parse.urlsplit(url).hostname or ""


def _undecryptable(credential_id: str) -> RpcError:
    """FAILED_PRECONDITION CREDENTIAL_UNDECRYPTABLE (metadata `credential_id`): the answer of every RPC
    that needs the stored secret of `credential_id` and no configured key decrypts it (README,
    "Changing the key"). Not retryable: only an operator listing the old key again, or the credential
    connected again, fixes it. The store already logged the WARNING with the ids and
    crypto.KEY_CHANGED_HINT (`CredentialStore._decrypt`); the message names the credential, never its secret.
    """
    return RpcError(
        grpc.StatusCode.FAILED_PRECONDITION,
        "CREDENTIAL_UNDECRYPTABLE",
        f"Credential {credential_id!r} cannot be decrypted: the server's credential key was changed without "
        "keeping the old one. An operator must list the old key again (after the new one), or the credential "
        "must be connected again",
        domain=TOOLS_DOMAIN,
        metadata={"credential_id": credential_id},
    )


def credential_pb(info: CredentialInfo, include_masked: bool = False) -> tools_pb2.Credential:
    """The Credential message of `info` (auth_data_masked only when asked).

    `metadata` is clipped to pb.MAX_JSON_DEPTH (services/common/pb.py): one stored before the
    gateway's depth check could be too deep to decode, and would break every listing.
    """
    return tools_pb2.Credential(
        credential_id=info.id,
        organization_id=info.org_id,
        integration_name=info.integration,
        auth_type=info.auth_type,
        display_name=info.display_name,
        is_default=info.is_default,
        create_time=pb.timestamp(info.created_at),
        update_time=pb.timestamp(info.updated_at),
        metadata=pb.to_struct(info.metadata, clip=True),
        auth_data_masked=info.masked if include_masked else "",
        created_by_user_id=info.created_by,
    )


def knowledge_base_pb(
    base: KnowledgeBase, document_count: int, total_chunks: int = 0, total_tokens: int = 0
) -> tools_pb2.KnowledgeBase:
    """The KnowledgeBase message of a row."""
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
    )


def document_pb(document: KnowledgeDocument) -> tools_pb2.Document:
    """The Document message of a row."""
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
    )


def mcp_tool_pb(tool: dict[str, Any]) -> tools_pb2.McpTool:
    """The McpTool message of a discovered tool {name, description, input_schema}.

    The schema is the MCP server's JSON: clipped to pb.MAX_JSON_DEPTH (deeper parts as their JSON
    text, services/common/pb.py) so that the message always decodes.
    """
    return tools_pb2.McpTool(
        name=tool["name"],
        description=tool["description"],
        input_schema=pb.to_struct(tool["input_schema"], clip=True),
    )


def _invalid(reason: str, message: str) -> RpcError:
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, reason, message, domain=TOOLS_DOMAIN)


#: The longest value each string field may hold, in characters (Python's len, as the gateway counts).
#: The same limits as the HTTP gateway's STRING_LIMITS and MAX_TEXT_CHARS (services/gateway/tools_routes.py:
#: a credential's display_name and a knowledge base's name 200, a description 10,000, an integration name
#: 100, an auth type 32, any other string - server_url, redirect_uri, scope, a search query - 2,048), so
#: that a caller reaching this service directly cannot store, look up or send on what the gateway refuses;
#: a document's name is cut to 500 characters by the gateway's upload route (the column is VARCHAR(500),
#: as display_name and name are VARCHAR(200), an integration name VARCHAR(100)).
TEXT_LIMITS = {
    "display_name": 200,
    "name": 200,
    "description": 10_000,
    "document_name": 500,
    "integration_name": 100,
    "auth_type": 32,
    "server_url": 2_048,
    "redirect_uri": 2_048,
    "scope": 2_048,
    "query": 2_048,
}


def check_length(field: str, value: str, limit: int) -> None:
    """Refuse `value` of the request field `field` when it is longer than `limit` characters (TEXT_LIMITS).

    Raises RpcError INVALID_ARGUMENT FIELD_TOO_LONG (metadata `field`, `limit`) with the gateway's
    message ("display_name must be at most 200 characters (it has 5000)"): never the value.
    """
    if len(value) > limit:
        raise RpcError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "FIELD_TOO_LONG",
            f"{field} must be at most {limit} characters (it has {len(value)})",
            domain=TOOLS_DOMAIN,
            metadata={"field": field, "limit": str(limit)},
        )


def check_lengths(request: Any, *fields: str) -> None:
    """`check_length` for each of the string fields `fields` of `request`, at its TEXT_LIMITS limit, in order."""
    for field in fields:
        check_length(field, getattr(request, field), TEXT_LIMITS[field])


#: The largest JSON object each Struct field may hold, in bytes as compact UTF-8 JSON (as the gateway
#: measures it: orjson): the HTTP gateway's OBJECT_LIMITS (services/gateway/tools_routes.py). A credential's
#: metadata is returned by every listing (16 KiB, with the gateway's `expires_at` merged in); a secret,
#: auth_data (64 KiB) or an MCP server's headers (16 KiB), is encrypted and stored.
JSON_LIMITS = {"metadata": 16 * 1024, "auth_data": 64 * 1024, "headers": 16 * 1024}


def check_json_size(field: str, value: dict[str, Any]) -> None:
    """Refuse the JSON object `value` of the request field `field` when it is larger than JSON_LIMITS[field]
    bytes as compact UTF-8 JSON.

    Raises RpcError INVALID_ARGUMENT FIELD_TOO_LARGE (metadata `field`, `limit`) with the gateway's message
    ("metadata must be at most 16384 bytes when JSON-encoded (it has 20000)"): never the content, which
    may be a secret.
    """
    limit = JSON_LIMITS[field]
    size = len(orjson.dumps(value))
    if size > limit:
        raise RpcError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "FIELD_TOO_LARGE",
            f"{field} must be at most {limit} bytes when JSON-encoded (it has {size})",
            domain=TOOLS_DOMAIN,
            metadata={"field": field, "limit": str(limit)},
        )


#: The most values each repeated field may hold: the HTTP gateway's MAX_SEARCH_BASES (a search names at
#: most 100 knowledge bases; services/gateway/tools_routes.py), counted as sent, duplicates included.
COUNT_LIMITS = {"knowledge_base_ids": 100}
#: What each counted field names, for the message.
_COUNTED = {"knowledge_base_ids": "knowledge bases"}


def check_count(field: str, values: Any) -> None:
    """Refuse the repeated request field `field` when it holds more than COUNT_LIMITS[field] values.

    Raises RpcError INVALID_ARGUMENT TOO_MANY_<FIELD> (metadata `field`, `limit`) with the gateway's
    message and the count ("knowledge_base_ids must name at most 100 knowledge bases (it names 101)").
    """
    limit = COUNT_LIMITS[field]
    if len(values) > limit:
        raise RpcError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"TOO_MANY_{field.upper()}",
            f"{field} must name at most {limit} {_COUNTED[field]} (it names {len(values)})",
            domain=TOOLS_DOMAIN,
            metadata={"field": field, "limit": str(limit)},
        )


def page_size(field: str, value: int, low: int, high: int, default: int) -> int:
    """The page size `value` of the request field `field`: `default` for 0 (proto3's unset), else
    `value` when it is from `low` to `high`, as tools.proto documents the field ("1 to 50; 0 means 5").

    Raises RpcError INVALID_ARGUMENT INVALID_<FIELD> (metadata `field`) for any other value, rather
    than clamping it: a caller asking for -1 or a million results is told, not served something else.
    """
    if value == 0:
        return default
    if not low <= value <= high:
        raise RpcError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"INVALID_{field.upper()}",
            f"{field} must be between {low} and {high} (0 means {default}), not {value}",
            domain=TOOLS_DOMAIN,
            metadata={"field": field},
        )
    return value


def tool_input(request: tools_pb2.ExecuteToolRequest) -> dict[str, Any]:
    """The call's input: `input_json` as the model produced it (numbers exact) when it is set, else
    the `input` Struct (a client of an older version), as tools.proto's `input_json` says
    (`pb.object_of`, the rule of every `<name>_json` pair).

    An `input_json` that is set must be a JSON object as UTF-8 JSON text: anything else (not JSON,
    not UTF-8, nested past what orjson parses, an array or a scalar) raises RpcError INVALID_ARGUMENT
    INVALID_INPUT_JSON (metadata field=input_json) naming input_json and what it is, never its content.
    It used to be dropped silently for `input`, and the tool then failed with a misleading
    "'query' is required" (fresh-eyes test).
    """
    try:
        return pb.object_of(request, "input")
    except pb.NotAnObject as bad:
        raise RpcError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_INPUT_JSON",
            str(bad),
            domain=TOOLS_DOMAIN,
            metadata={"field": "input_json"},
        ) from None


class ToolsServicer(tools_pb2_grpc.ToolsServiceServicer):
    """`loopline.tools.v1.ToolsService` over a ToolExecutor, a CredentialStore and a KnowledgeStore."""

    def __init__(self, executor: ToolExecutor, oauth: OAuth2Flows | None = None) -> None:
        self.executor = executor
        self.credentials = executor.credentials
        self.knowledge = executor.knowledge
        self.oauth = oauth

    @rpc_errors
    async def ListTools(
        self, request: tools_pb2.ListToolsRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.ListToolsResponse:
        """The definitions of the profile's tools: the five of "assistant" (also for an empty profile).

        Any other profile is INVALID_ARGUMENT UNKNOWN_PROFILE naming the known ones (tools.PROFILES; tools.proto:
        "assistant" is the only one today), not an empty list a caller would take for a profile without tools.
        """
        if request.profile and request.profile not in PROFILES:
            known = ", ".join(PROFILES)
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "UNKNOWN_PROFILE",
                f"Unknown profile {bounded(request.profile, 64)!r}; the known profiles are: {known} (empty means assistant)",
                domain=TOOLS_DOMAIN,
                metadata={"field": "profile", "known_profiles": known},
            )
        return tools_pb2.ListToolsResponse(
            tools=[
                tools_pb2.ToolDefinition(
                    name=d["name"],
                    description=d["description"],
                    input_schema=pb.to_struct(d["input_schema"]),
                )
                for d in self.executor.definitions(request.profile)
            ]
        )

    @rpc_errors
    async def ExecuteTool(
        self, request: tools_pb2.ExecuteToolRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.ExecuteToolResponse:
        """Run one tool call. A failing tool is success=false with `error`; a cancelled call cancels the tool.

        The output goes as JSON text in `output_json` (pb.json_bytes: one encoding, keys in the
        tool's order), clipped to pb.MAX_JSON_DEPTH (services/common/pb.py): what a web page, an
        MCP server or a database returns may nest deeper than the next hops parse, so its deeper
        objects and arrays arrive as their JSON text.

        A request error is an RPC error: INVALID_ARGUMENT INVALID_INPUT_JSON for an `input_json` that
        is set but is not a JSON object (`tool_input`, tools.proto).
        """
        with bind(
            org_id=request.organization_id,
            run_id=request.run_id,
            chat_id=request.chat_id,
            tool_call_id=request.tool_call_id,
        ):
            result = await self.executor.execute(
                request.organization_id, request.tool, tool_input(request)
            )
        response = tools_pb2.ExecuteToolResponse(
            success=result.success, error=result.error, millicredits=result.millicredits
        )
        if result.success:
            response.output_json = pb.json_bytes(result.output, clip=True)
        return response

    @rpc_errors
    async def CreateCredential(
        self, request: tools_pb2.CreateCredentialRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.CreateCredentialResponse:
        """Store a credential (secret encrypted); INVALID_ARGUMENT for a bad integration, auth type or auth data,
        or FIELD_TOO_LONG for an integration_name past 100, an auth_type past 32 or a display_name past 200
        characters (TEXT_LIMITS, the gateway's limits), or FIELD_TOO_LARGE for auth_data past 64 KiB or metadata
        past 16 KiB as compact JSON (JSON_LIMITS), checked before anything is looked up or stored."""
        check_lengths(request, "integration_name", "auth_type", "display_name")
        auth_data, metadata = pb.from_struct(request.auth_data), pb.from_struct(request.metadata)
        check_json_size("auth_data", auth_data)
        check_json_size("metadata", metadata)
        info = await self.credentials.create(
            request.organization_id,
            request.integration_name,
            request.auth_type,
            auth_data,
            display_name=request.display_name,
            metadata=metadata,
            make_default=request.make_default,
            created_by=request.user_id,
        )
        return tools_pb2.CreateCredentialResponse(credential=credential_pb(info))

    @rpc_errors
    async def ListCredentials(
        self, request: tools_pb2.ListCredentialsRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.ListCredentialsResponse:
        """A page of the organization's credentials, newest first.

        limit is 1 to 500, 0 means 100 (tools.proto, the gateway's range), and offset is >= 0 (the gateway's
        `ge=0`); any other value is INVALID_ARGUMENT INVALID_LIMIT / INVALID_OFFSET, not clamped. A filter
        longer than the gateway's limit (integration_name 100, auth_type 32 characters) is FIELD_TOO_LONG.
        """
        check_lengths(request, "integration_name", "auth_type")
        limit = page_size("limit", request.limit, 1, 500, 100)
        if request.offset < 0:
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "INVALID_OFFSET",
                f"offset must be >= 0, not {request.offset}",
                domain=TOOLS_DOMAIN,
                metadata={"field": "offset"},
            )
        infos, total = await self.credentials.list(
            request.organization_id,
            request.integration_name,
            request.auth_type,
            limit=limit,
            offset=request.offset,
        )
        return tools_pb2.ListCredentialsResponse(
            credentials=[credential_pb(i) for i in infos], total=total
        )

    @rpc_errors
    async def GetCredential(
        self, request: tools_pb2.GetCredentialRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.GetCredentialResponse:
        """One credential; NOT_FOUND when absent or another organization's."""
        info = await self.credentials.get(request.organization_id, request.credential_id)
        return tools_pb2.GetCredentialResponse(
            credential=credential_pb(info, include_masked=request.include_masked)
        )

    @rpc_errors
    async def ResolveCredentialSecret(
        self, request: tools_pb2.ResolveCredentialSecretRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.ResolveCredentialSecretResponse:
        """The decrypted key of a credential, for internal callers only (bring-your-own-key models).

        NOT_FOUND when absent, another organization's, for another integration, or holding no key;
        FAILED_PRECONDITION CREDENTIAL_UNDECRYPTABLE (`_undecryptable`, one WARNING logged by the store)
        when no configured key decrypts its secret (README, "Changing the key"); INVALID_ARGUMENT FIELD_TOO_LONG
        for an integration_name past 100 characters (TEXT_LIMITS), before any query.
        """
        check_lengths(request, "integration_name")
        not_found = RpcError(
            grpc.StatusCode.NOT_FOUND,
            "CREDENTIAL_NOT_FOUND",
            "credential not found",
            domain=TOOLS_DOMAIN,
        )
        if not request.credential_id:
            raise not_found
        try:
            resolved = await self.credentials.resolve(
                request.organization_id, request.integration_name, request.credential_id
            )
        except SecretBoxError:
            raise _undecryptable(request.credential_id) from None
        if resolved is None:
            raise not_found
        _, secret = resolved
        key = secret.get("api_key") or secret.get("token") if isinstance(secret, dict) else None
        if not isinstance(key, str) or not key:
            raise not_found
        return tools_pb2.ResolveCredentialSecretResponse(secret=key)

    @rpc_errors
    async def DeleteCredential(
        self, request: tools_pb2.DeleteCredentialRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.DeleteCredentialResponse:
        """Delete one credential; NOT_FOUND when absent or another organization's."""
        promoted = await self.credentials.delete(request.organization_id, request.credential_id)
        return tools_pb2.DeleteCredentialResponse(new_default_credential_id=promoted)

    @rpc_errors
    async def SetDefaultCredential(
        self, request: tools_pb2.SetDefaultCredentialRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.SetDefaultCredentialResponse:
        """Make one credential its integration's default; NOT_FOUND when absent or another organization's."""
        info = await self.credentials.set_default(request.organization_id, request.credential_id)
        return tools_pb2.SetDefaultCredentialResponse(credential=credential_pb(info))

    @rpc_errors
    async def CreateKnowledgeBase(
        self, request: tools_pb2.CreateKnowledgeBaseRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.CreateKnowledgeBaseResponse:
        """Create an empty knowledge base; INVALID_ARGUMENT without organization or name, or FIELD_TOO_LONG for a
        name past 200 or a description past 10,000 characters (TEXT_LIMITS, the gateway's limits)."""
        check_length("name", request.name, TEXT_LIMITS["name"])
        check_length("description", request.description, TEXT_LIMITS["description"])
        base, count = await self.knowledge.create_base(
            request.organization_id, request.name, request.description, request.user_id
        )
        return tools_pb2.CreateKnowledgeBaseResponse(knowledge_base=knowledge_base_pb(base, count))

    @rpc_errors
    async def ListKnowledgeBases(
        self, request: tools_pb2.ListKnowledgeBasesRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.ListKnowledgeBasesResponse:
        """The organization's knowledge bases, newest first."""
        bases = await self.knowledge.list_bases_with_totals(request.organization_id)
        return tools_pb2.ListKnowledgeBasesResponse(
            knowledge_bases=[knowledge_base_pb(b, *totals) for b, totals in bases]
        )

    @rpc_errors
    async def AddDocument(
        self, request: tools_pb2.AddDocumentRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.AddDocumentResponse:
        """Add, chunk and index a document (text, or a file's extracted text); NOT_FOUND for another
        organization's knowledge base; INVALID_ARGUMENT UNSUPPORTED_FILE_TYPE / DOCUMENT_HAS_NO_TEXT for a file,
        FIELD_TOO_LONG for a name past 500 characters (TEXT_LIMITS: the gateway cuts an upload's name there)."""
        check_length("name", request.name, TEXT_LIMITS["document_name"])
        if request.data:
            try:
                kind = file_type(request.name, request.content_type)
                text = await asyncio.to_thread(extract_text, request.data, kind)
            except UnsupportedFileType as exc:
                raise _invalid("UNSUPPORTED_FILE_TYPE", str(exc)) from None
            except ExtractionError as exc:
                raise _invalid("DOCUMENT_HAS_NO_TEXT", str(exc)) from None
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

    @rpc_errors
    async def GetDocument(
        self, request: tools_pb2.GetDocumentRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.GetDocumentResponse:
        """One document; NOT_FOUND when absent, in another knowledge base or another organization's."""
        document = await self.knowledge.get_document(
            request.organization_id, request.knowledge_base_id, request.document_id
        )
        return tools_pb2.GetDocumentResponse(document=document_pb(document))

    @rpc_errors
    async def CreateMcpServer(
        self, request: tools_pb2.CreateMcpServerRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.CreateMcpServerResponse:
        """Register a Streamable HTTP MCP server (URL and headers encrypted) and discover its tools.

        INVALID_ARGUMENT: INVALID_SERVER_URL, OUTBOUND_POLICY, INVALID_HEADERS, FIELD_TOO_LONG (a server_url
        past 2,048 or a display_name past 200 characters, TEXT_LIMITS: the gateway's limits), FIELD_TOO_LARGE
        (headers past 16 KiB as compact JSON, JSON_LIMITS); the sizes are checked before the URL is resolved
        or called. A failed discovery still stores the credential and reports `discovery_error`.
        """
        check_lengths(request, "server_url", "display_name")
        headers = pb.from_struct(request.headers)
        check_json_size("headers", headers)
        problem = header_fields_problem(headers)
        if problem is not None:
            raise _invalid("INVALID_HEADERS", problem)
        url = request.server_url.strip()
        try:
            await check_url_policy(url, self.executor.settings.tools_allow_private_network)
        except ActionError as exc:
            raise _invalid("INVALID_SERVER_URL", str(exc)) from None
        except OutboundPolicyError as exc:
            raise _invalid("OUTBOUND_POLICY", f"server_url refused: {exc}") from None
        secret = {"url": url, "headers": headers}
        tools: list[dict[str, Any]] | None
        error = ""
        try:
            tools = await self.executor.mcp.list_tools(secret)
        except TimeoutError:
            tools, error = None, "the MCP server did not answer in time"
        except (ActionError, OutboundPolicyError) as exc:
            tools, error = None, str(exc)
        display_name = request.display_name.strip() or (urllib_host(url) or "MCP server")
        integration = f"mcp_{slug(display_name)}"
        if (
            self.executor.catalogue.get(integration)
            or integration in self.executor.stdio.servers
            or await self.credentials.integration_taken(request.organization_id, integration)
        ):
            integration = f"{integration}_{uuid.uuid4().hex[:6]}"
        info = await self.credentials.create_raw(
            request.organization_id,
            integration,
            MCP_AUTH_TYPE,
            secret,
            display_name,
            metadata={"server_url_host": urllib_host(url)},
            make_default=request.make_default,
            discovery=tools,
            created_by=request.user_id,
        )
        return tools_pb2.CreateMcpServerResponse(
            credential=credential_pb(info),
            tools=[mcp_tool_pb(t) for t in tools or []],
            discovery_error=error,
        )

    @rpc_errors
    async def RefreshMcpDiscovery(
        self, request: tools_pb2.RefreshMcpDiscoveryRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.RefreshMcpDiscoveryResponse:
        """List an MCP server's tools again; success=false with `error` (tools kept) when it cannot be reached.

        FAILED_PRECONDITION CREDENTIAL_UNDECRYPTABLE when no configured key decrypts its secret.
        """
        try:
            _info, old, _when, secret = await self.credentials.discovery(
                request.organization_id, request.credential_id, MCP_AUTH_TYPE
            )
        except SecretBoxError:
            raise _undecryptable(request.credential_id) from None
        try:
            tools = await self.executor.mcp.list_tools(secret)
        except TimeoutError:
            tools, error = None, "the MCP server did not answer in time"
        except (ActionError, OutboundPolicyError) as exc:
            tools, error = None, str(exc)
        if tools is None:
            return tools_pb2.RefreshMcpDiscoveryResponse(
                credential_id=request.credential_id,
                success=False,
                total_tools=len(old or []),
                refresh_time=pb.timestamp(),
                error=error,
            )
        when = await self.credentials.set_discovery(
            request.organization_id, request.credential_id, tools
        )
        before = {t["name"] for t in old or []}
        after = {t["name"] for t in tools}
        return tools_pb2.RefreshMcpDiscoveryResponse(
            credential_id=request.credential_id,
            success=True,
            total_tools=len(tools),
            added=sorted(after - before),
            removed=sorted(before - after),
            refresh_time=pb.timestamp(when),
        )

    @rpc_errors
    async def ListMcpTools(
        self, request: tools_pb2.ListMcpToolsRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.ListMcpToolsResponse:
        """The tools last discovered on an MCP server credential (its secret is not read); INVALID_ARGUMENT
        WRONG_CREDENTIAL_KIND for another kind of credential."""
        _info, tools, when, _secret = await self.credentials.discovery(
            request.organization_id, request.credential_id, MCP_AUTH_TYPE, secret=False
        )
        response = tools_pb2.ListMcpToolsResponse(
            credential_id=request.credential_id, tools=[mcp_tool_pb(t) for t in tools or []]
        )
        if when is not None:
            response.discovery_time.CopyFrom(pb.timestamp(when))
        return response

    @rpc_errors
    async def InitiateOAuth2(
        self, request: tools_pb2.InitiateOAuth2Request, context: grpc.aio.ServicerContext
    ) -> tools_pb2.InitiateOAuth2Response:
        """Start an authorization code flow with PKCE; INVALID_ARGUMENT for an integration without OAuth2, or
        FIELD_TOO_LONG for an integration_name past 100, a redirect_uri or scope past 2,048 or a display_name
        past 200 characters (TEXT_LIMITS: the gateway's limits; the credential created at completion gets the
        display_name), checked before the state is stored."""
        check_lengths(request, "integration_name", "redirect_uri", "scope", "display_name")
        if self.oauth is None:
            raise _invalid("OAUTH2_NOT_SUPPORTED", "No OAuth2 integration is configured")
        url, state = await self.oauth.initiate(
            request.organization_id,
            request.integration_name,
            request.redirect_uri,
            request.scope,
            request.display_name,
            request.make_default,
            request.user_id,
        )
        return tools_pb2.InitiateOAuth2Response(authorization_url=url, state=state)

    @rpc_errors
    async def CompleteOAuth2(
        self, request: tools_pb2.CompleteOAuth2Request, context: grpc.aio.ServicerContext
    ) -> tools_pb2.CompleteOAuth2Response:
        """Exchange the code for tokens and store them as a credential (see OAuth2Flows.complete for errors)."""
        if self.oauth is None:
            raise _invalid("OAUTH2_STATE_INVALID", "Unknown or expired OAuth2 state")
        info, user_id = await self.oauth.complete(request.state, request.code, request.error)
        return tools_pb2.CompleteOAuth2Response(credential=credential_pb(info), user_id=user_id)

    @rpc_errors
    async def SearchKnowledge(
        self, request: tools_pb2.SearchKnowledgeRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.SearchKnowledgeResponse:
        """The best chunks for the query in the organization's knowledge bases.

        top_k is 1 to 50, 0 means 5 (tools.proto, the gateway's range); any other value is INVALID_ARGUMENT
        INVALID_TOP_K (`page_size`), not clamped. A query past 2,048 characters (TEXT_LIMITS, the gateway's
        limit) is INVALID_ARGUMENT FIELD_TOO_LONG, more than 100 knowledge_base_ids (COUNT_LIMITS, the
        gateway's) TOO_MANY_KNOWLEDGE_BASE_IDS; both before any query.
        """
        check_lengths(request, "query")
        check_count("knowledge_base_ids", request.knowledge_base_ids)
        top_k = page_size("top_k", request.top_k, 1, 50, 5)
        hits = await self.knowledge.search(
            request.organization_id, request.query, list(request.knowledge_base_ids), top_k
        )
        return tools_pb2.SearchKnowledgeResponse(
            results=[tools_pb2.KnowledgeSearchResult(**h.to_json()) for h in hits]
        )


class ToolsServer:
    """A running tools service: gRPC server, database engine, stores.

    Use `await ToolsServer.start(settings)`; `.port` is the bound port; `await stop(grace)`.
    """

    def __init__(self, running: RunningServer, engine: Any, servicer: ToolsServicer) -> None:
        self._running = running
        self._engine = engine
        self.servicer = servicer
        self.port = running.port
        self._discovery: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, settings: ToolsSettings) -> ToolsServer:
        """Migrate (when `auto_migrate`), build the stores and serve on `settings.tools_port` (0 = any free port).

        Raises ValueError for a malformed credential key or manifest, RuntimeError when
        the port cannot be bound.
        """
        url = settings.database_url()
        if settings.auto_migrate:
            await db.migrate_async("tools", url)
        if settings.uses_dev_credential_key():
            log.warning(
                "LOOPLINE_TOOLS_CREDENTIAL_KEY is not set: credentials are encrypted with the public "
                "development key; set a Fernet key in any real deployment"
            )
        box = SecretBox(settings.credential_keys())
        providers = parse_providers(settings.tools_oauth2_integrations)
        catalogue = Catalogue(
            Catalogue.builtin().all()
            + [integration_of(p, settings.tools_timeout_s) for p in providers]
        )
        connector = McpConnector(
            settings.tools_timeout_s,
            settings.tools_max_output_bytes,
            settings.tools_allow_private_network,
        )
        stdio = StdioRegistry(parse_stdio_servers(settings.tools_mcp_stdio_servers), connector)
        engine = db.make_engine(url, settings.db_pool_size, settings.db_timeout_s)
        sessions = db.sessionmaker(engine)
        credentials = CredentialStore(
            sessions, box, catalogue, settings.tools_credential_cache_ttl_s
        )
        executor = ToolExecutor(
            settings, catalogue, credentials, KnowledgeStore(engine, sessions), connector, stdio
        )
        oauth = OAuth2Flows(providers, sessions, box, credentials, settings.tools_timeout_s)
        servicer = ToolsServicer(executor, oauth)
        try:
            running = await start_grpc_server(
                [(tools_pb2_grpc.add_ToolsServiceServicer_to_server, servicer, SERVICE_NAME)],
                settings.host,
                settings.tools_port,
                # Document uploads (up to the gateway's 10 MiB limit) arrive in one message.
                options=[("grpc.max_receive_message_length", 16 * 1024 * 1024)],
                internal_token=settings.internal_token,
            )
        except BaseException:
            await engine.dispose()
            raise
        server = cls(running, engine, servicer)
        if stdio.servers:
            # Warm the stdio servers' tool lists; failures are retried on first use.
            server._discovery = asyncio.create_task(stdio.discover_all())
        return server

    async def stop(self, grace: float) -> None:
        """Stop serving (in-flight calls get `grace` seconds, then are cancelled), let MCP sessions
        that are still closing finish (up to 10 s), and close the database."""
        if self._discovery is not None:
            self._discovery.cancel()
        await self._running.stop(grace)
        await self.servicer.executor.mcp.aclose()
        await self._engine.dispose()
