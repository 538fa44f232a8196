"""`ToolsServicer`: the RPCs of `loopline.tools.v1.ToolsService` and the messages they answer.

`ExecuteTool` never fails as an RPC for a tool failure: it answers success=false with an error
message (tools.proto). The other RPCs raise `RpcError`s, which `unary` turns into rich statuses
(google.rpc.Status with an ErrorInfo).
"""

from __future__ import annotations

import urllib.parse
import uuid
from typing import Any

import grpc

from loopline.tools.v1 import tools_pb2
from services.common import ids, pb
from services.common.errors import TOOLS_DOMAIN, RpcError, bounded, rpc_handler
from services.common.logging import bind
from services.common.validation import header_fields_problem
from services.tools.catalogue import ActionError
from services.tools.credentials import CredentialInfo
from services.tools.crypto import SecretBoxError
from services.tools.knowledge_rpcs import KnowledgeRpcs
from services.tools.listing import IntegrationListing, IntegrationRpcs
from services.tools.mcp_client import check_url_policy
from services.tools.mcp_servers import MCP_AUTH_TYPE, slug
from services.tools.netpolicy import OutboundPolicyError
from services.tools.oauth import OAuth2Flows
from services.tools.request_checks import (
    check_json_size,
    check_lengths,
    invalid,
    page_size,
    tool_input,
)
from services.tools.tool_definitions import PROFILES
from services.tools.tools import ToolExecutor

# RpcError -> its rich status; any other exception -> INTERNAL with a generic message.
unary = rpc_handler(
    internal_domain=TOOLS_DOMAIN,
    check=ids.request_organization_check(TOOLS_DOMAIN, "ORGANIZATION_REQUIRED"),
)


def urllib_host(url: str) -> str:
    """The host of `url` ("" when it has none)."""
    return urllib.parse.urlsplit(url).hostname or ""


def _undecryptable(credential_id: str) -> RpcError:
    """FAILED_PRECONDITION CREDENTIAL_UNDECRYPTABLE (metadata `credential_id`): the answer of
    every RPC that needs the secret of `credential_id` when no configured key decrypts it.

    Not retryable: only an operator listing the old key again, or the credential connected
    again, fixes it. The store already logged a WARNING (`CredentialStore._decrypt`).
    """
    return RpcError(
        grpc.StatusCode.FAILED_PRECONDITION,
        "CREDENTIAL_UNDECRYPTABLE",
        f"Credential {credential_id!r} cannot be decrypted: the server's credential key was "
        "changed without keeping the old one. An operator must list the old key again (after the "
        "new one), or the credential must be connected again",
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


class ToolsServicer(IntegrationRpcs, KnowledgeRpcs):
    """`loopline.tools.v1.ToolsService` over a ToolExecutor and its credential and knowledge
    stores (ListIntegrations and GetIntegration: listing.IntegrationRpcs; the knowledge RPCs:
    knowledge_rpcs.KnowledgeRpcs)."""

    def __init__(self, executor: ToolExecutor, oauth: OAuth2Flows | None = None) -> None:
        self.executor = executor
        self.credentials = executor.credentials
        self.knowledge = executor.knowledge
        self.oauth = oauth
        # ListIntegrations and GetIntegration (listing.py)
        self.listing = IntegrationListing(executor, oauth.providers if oauth else ())

    @unary
    async def ListTools(
        self, request: tools_pb2.ListToolsRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.ListToolsResponse:
        """The definitions of the profile's tools: the five of "assistant" (also for "").

        Any other profile is INVALID_ARGUMENT UNKNOWN_PROFILE naming the known ones
        (tools.PROFILES), not an empty list a caller would take for a profile without tools.
        """
        if request.profile and request.profile not in PROFILES:
            known = ", ".join(PROFILES)
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "UNKNOWN_PROFILE",
                f"Unknown profile {bounded(request.profile, 64)!r}; the known profiles are: "
                f"{known} (empty means assistant)",
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

    @unary
    async def ExecuteTool(
        self, request: tools_pb2.ExecuteToolRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.ExecuteToolResponse:
        """Run one tool call: a failing tool is success=false with `error`; a cancelled call
        cancels the tool.

        The output goes as JSON text in `output_json` (pb.json_bytes: one encoding, keys in the
        tool's order), clipped to pb.MAX_JSON_DEPTH (services/common/pb.py): what a web page, an
        MCP server or a database returns may nest deeper than the next hops parse, so its deeper
        objects and arrays arrive as their JSON text.

        A request error is an RPC error: INVALID_ARGUMENT INVALID_INPUT_JSON for an `input_json`
        that is set but is not a JSON object (`tool_input`).
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

    @unary
    async def CreateCredential(
        self, request: tools_pb2.CreateCredentialRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.CreateCredentialResponse:
        """Store a credential (secret encrypted).

        INVALID_ARGUMENT for a bad integration, auth type or auth data; FIELD_TOO_LONG and
        FIELD_TOO_LARGE past TEXT_LIMITS and JSON_LIMITS, before anything is looked up or stored.
        """
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

    @unary
    async def ListCredentials(
        self, request: tools_pb2.ListCredentialsRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.ListCredentialsResponse:
        """A page of the organization's credentials, newest first.

        limit is 1 to 500, 0 means 100, and offset is >= 0 (the gateway's ranges); any other value
        is INVALID_ARGUMENT INVALID_LIMIT / INVALID_OFFSET, not clamped. A filter past TEXT_LIMITS
        is FIELD_TOO_LONG.
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

    @unary
    async def GetCredential(
        self, request: tools_pb2.GetCredentialRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.GetCredentialResponse:
        """One credential; NOT_FOUND when absent or another organization's."""
        info = await self.credentials.get(request.organization_id, request.credential_id)
        return tools_pb2.GetCredentialResponse(
            credential=credential_pb(info, include_masked=request.include_masked)
        )

    @unary
    async def ResolveCredentialSecret(
        self, request: tools_pb2.ResolveCredentialSecretRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.ResolveCredentialSecretResponse:
        """The decrypted key of a credential, for internal callers only (bring-your-own-key models).

        NOT_FOUND when absent, another organization's, for another integration, or holding no
        key; FAILED_PRECONDITION CREDENTIAL_UNDECRYPTABLE when no configured key decrypts it;
        FIELD_TOO_LONG for an integration_name past TEXT_LIMITS, before any query.
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

    @unary
    async def DeleteCredential(
        self, request: tools_pb2.DeleteCredentialRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.DeleteCredentialResponse:
        """Delete one credential; NOT_FOUND when absent or another organization's."""
        promoted = await self.credentials.delete(request.organization_id, request.credential_id)
        return tools_pb2.DeleteCredentialResponse(new_default_credential_id=promoted)

    @unary
    async def SetDefaultCredential(
        self, request: tools_pb2.SetDefaultCredentialRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.SetDefaultCredentialResponse:
        """Make one credential its integration's default; NOT_FOUND when absent or another
        organization's."""
        info = await self.credentials.set_default(request.organization_id, request.credential_id)
        return tools_pb2.SetDefaultCredentialResponse(credential=credential_pb(info))

    @unary
    async def CreateMcpServer(
        self, request: tools_pb2.CreateMcpServerRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.CreateMcpServerResponse:
        """Register a Streamable HTTP MCP server (URL and headers encrypted) and discover its tools.

        INVALID_ARGUMENT: INVALID_SERVER_URL, OUTBOUND_POLICY, INVALID_HEADERS, FIELD_TOO_LONG,
        FIELD_TOO_LARGE (TEXT_LIMITS, JSON_LIMITS; sizes checked before the URL is resolved). A
        failed discovery still stores the credential and reports `discovery_error`.
        """
        check_lengths(request, "server_url", "display_name")
        headers = pb.from_struct(request.headers)
        check_json_size("headers", headers)
        problem = header_fields_problem(headers)
        if problem is not None:
            raise invalid("INVALID_HEADERS", problem)
        url = request.server_url.strip()
        try:
            await check_url_policy(url, self.executor.settings.tools_allow_private_network)
        except ActionError as exc:
            raise invalid("INVALID_SERVER_URL", str(exc)) from None
        except OutboundPolicyError as exc:
            raise invalid("OUTBOUND_POLICY", f"server_url refused: {exc}") from None
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

    @unary
    async def RefreshMcpDiscovery(
        self, request: tools_pb2.RefreshMcpDiscoveryRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.RefreshMcpDiscoveryResponse:
        """List an MCP server's tools again; success=false with `error` (tools kept) when it
        cannot be reached.

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

    @unary
    async def ListMcpTools(
        self, request: tools_pb2.ListMcpToolsRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.ListMcpToolsResponse:
        """The tools last discovered on an MCP server credential (its secret is not read);
        INVALID_ARGUMENT WRONG_CREDENTIAL_KIND for another kind of credential."""
        _info, tools, when, _secret = await self.credentials.discovery(
            request.organization_id, request.credential_id, MCP_AUTH_TYPE, secret=False
        )
        response = tools_pb2.ListMcpToolsResponse(
            credential_id=request.credential_id, tools=[mcp_tool_pb(t) for t in tools or []]
        )
        if when is not None:
            response.discovery_time.CopyFrom(pb.timestamp(when))
        return response

    @unary
    async def InitiateOAuth2(
        self, request: tools_pb2.InitiateOAuth2Request, context: grpc.aio.ServicerContext
    ) -> tools_pb2.InitiateOAuth2Response:
        """Start an authorization code flow with PKCE; INVALID_ARGUMENT for an integration without
        OAuth2, or FIELD_TOO_LONG past TEXT_LIMITS (checked before the state is stored; the
        credential created at completion gets the display_name)."""
        check_lengths(request, "integration_name", "redirect_uri", "scope", "display_name")
        if self.oauth is None:
            raise invalid("OAUTH2_NOT_SUPPORTED", "No OAuth2 integration is configured")
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

    @unary
    async def CompleteOAuth2(
        self, request: tools_pb2.CompleteOAuth2Request, context: grpc.aio.ServicerContext
    ) -> tools_pb2.CompleteOAuth2Response:
        """Exchange the code for tokens and store them as a credential (errors: see
        OAuth2Flows.complete)."""
        if self.oauth is None:
            raise invalid("OAUTH2_STATE_INVALID", "Unknown or expired OAuth2 state")
        info, user_id = await self.oauth.complete(request.state, request.code, request.error)
        return tools_pb2.CompleteOAuth2Response(credential=credential_pb(info), user_id=user_id)
