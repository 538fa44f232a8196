"""Credential routes: API keys and tokens, MCP servers, OAuth2 connections (over the tools service).

Routes and JSON shapes follow the official SDK (`modulex/resources/credentials.py` and its
`types/`). Every route but the OAuth2 callback (which the browser reaches, carrying only the
single-use `state`) requires an owner or admin, authenticated before anything is looked up. Bad
input is 400 `{"detail": ...}`; tools service failures go through the error table. Secrets are
never returned: a credential shows its metadata and, on request, a masked form.
"""

from __future__ import annotations

import datetime
import logging
from typing import Annotated

import grpc
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from loopline.assistant.v1 import assistant_pb2
from loopline.tools.v1 import tools_pb2
from services.common import pb
from services.common.validation import header_fields_problem
from services.gateway.bodies import check_fields, refuse_body
from services.gateway.context import context_of
from services.gateway.errors import BodyError, detail
from services.gateway.identity import Principal, user_email
from services.gateway.openapi import error_responses, keyed
from services.gateway.query import TrueOrFalse, WholeNumber
from services.gateway.routes.fields import (
    BOOLEAN,
    NOT_SUPPORTED,
    OBJECT_LIMITS,
    SLOW_TIMEOUT_S,
    TIMEOUT_S,
    Who,
    body_of,
    bool_field,
    check_json_size,
    json_body,
    object_field,
    object_schema,
    string_field,
    text_schema,
    tools_of,
)
from services.gateway.schemas import (
    Credential,
    CredentialDetail,
    CredentialPage,
    DiscoveryRefreshed,
    McpServerCreated,
    McpTool,
    McpToolList,
    OAuth2Connected,
    OAuth2Started,
)

log = logging.getLogger(__name__)

# The auth types a credential list can filter by: the tools service's stored types and the SDK's
# alias `bearer_token` (SDK_AUTH_TYPES); checked here so that the 400 names the alias too.
CREDENTIAL_AUTH_TYPES = ("api_key", "bearer", "bearer_token", "oauth2", "custom", "mcp_server")

CREATE_CREDENTIAL_BODY = json_body(
    {
        "integration_name": text_schema("integration_name", required=True),
        "auth_data": object_schema(
            "auth_data", 'The secret (e.g. {"api_key": ...}); encrypted, never returned.'
        ),
        "auth_type": {
            **text_schema("auth_type"),
            "description": "One of the integration's auth types (bearer_token is bearer); "
            "inferred from auth_data's fields among them when absent.",
        },
        "oauth_config": {
            **NOT_SUPPORTED,
            "description": "Not supported (connect OAuth2 with POST /credentials/oauth2/initiate): "
            "any value but null is refused (400).",
        },
        "display_name": text_schema("display_name"),
        "metadata": object_schema("metadata", "With expires_at merged in."),
        "make_default": BOOLEAN,
        "expires_at": text_schema("expires_at"),
    },
    ["integration_name"],
)
CREATE_MCP_SERVER_BODY = json_body(
    {
        "server_url": text_schema("server_url", required=True),
        "headers": {
            **object_schema("headers", "Header names to string values, sent to the server."),
            "additionalProperties": {"type": "string"},
        },
        "display_name": text_schema("display_name"),
        "make_default": BOOLEAN,
    },
    ["server_url"],
)
_IGNORED = {"description": "Accepted and ignored (the SDK sends it)."}
INITIATE_OAUTH2_BODY = json_body(
    {
        "integration_name": text_schema("integration_name", required=True),
        "redirect_uri": text_schema("redirect_uri", required=True),
        "use_modulex_oauth": {
            "not": {"const": False},
            "description": "false (a custom OAuth app) is refused (400); "
            "the operator configures each OAuth2 integration.",
        },
        "custom_oauth_config": NOT_SUPPORTED,
        "scope": text_schema("scope"),
        "display_name": text_schema("display_name"),
        "make_default": BOOLEAN,
        "env_var_values": NOT_SUPPORTED,
        "composer_chat_id": _IGNORED,
        "composer_request_id": _IGNORED,
        "composer_llm_config": _IGNORED,
    },
    ["integration_name", "redirect_uri"],
)
# The OAuth2 callback's query, read by hand in `oauth2_callback` (a missing state, or neither code
# nor error, is 400 "state and code are required"): declared here, so that `state` is required
# (OpenAPI cannot say "code or error"; their descriptions do).
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
            "description": "The authorization server's denial; required unless `code` is given"
            " (the state is spent either way).",
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

SDK_AUTH_TYPES = {"bearer_token": "bearer"}


def check_expiry(value: str) -> None:
    """BodyError 400 unless `value` is an ISO 8601 date or date and time (no offset: UTC) later
    than now: a credential that has already expired would only fail the calls that pick it (the
    same rule as an API key's expires_at)."""
    try:
        moment = datetime.datetime.fromisoformat(value)
    except ValueError:
        raise BodyError(
            400, "expires_at must be an ISO 8601 date or date and time (e.g. 2030-01-01T00:00:00Z)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    if moment <= datetime.datetime.now(datetime.UTC):
        raise BodyError(400, "expires_at must be in the future")


def credential_json(c: tools_pb2.Credential) -> Credential:
    """The SDK's CredentialResponse of `c`."""
    metadata = pb.from_struct(c.metadata)
    return {
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


def credential_detail_json(
    c: tools_pb2.Credential, created_by_email: str | None = None
) -> CredentialDetail:
    """The SDK's CredentialDetailResponse of `c`, created by the user with `created_by_email`."""
    return {
        **credential_json(c),
        "organization_id": c.organization_id,
        "created_by": c.created_by_user_id or None,
        "created_by_email": created_by_email,
        "auth_data_masked": c.auth_data_masked or None,
    }


def mcp_tool_json(t: tools_pb2.McpTool) -> McpTool:
    """{name, description, input_schema} of a discovered MCP tool."""
    return {
        "name": t.name,
        "description": t.description,
        "input_schema": pb.from_struct(t.input_schema),
    }


router = APIRouter(responses=error_responses(404, 409, 413, 415))


@router.post(
    "/credentials",
    status_code=201,
    summary="Create a credential (secret encrypted, never returned)",
    tags=["credentials"],
    response_model=Credential,
    openapi_extra=keyed(CREATE_CREDENTIAL_BODY),
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
    integration = string_field(body, "integration_name", required=True)
    auth_data = object_field(body, "auth_data")
    if body.get("oauth_config") is not None:
        raise BodyError(
            400,
            "oauth_config is not supported; connect OAuth2 integrations with"
            " POST /credentials/oauth2/initiate",
        )
    metadata = dict(object_field(body, "metadata") or {})
    expires_at = string_field(body, "expires_at")
    if expires_at:
        check_expiry(expires_at)
        metadata["expires_at"] = expires_at
        check_json_size(
            "metadata", metadata, OBJECT_LIMITS["metadata"]
        )  # as stored, with expires_at
    # absent: the tools service picks it from auth_data's fields among the integration's own
    auth_type = string_field(body, "auth_type")
    # the SDK's CredentialAuthOption names a bearer token "bearer_token" (modulex/types/realtime.py)
    auth_type = SDK_AUTH_TYPES.get(auth_type, auth_type)
    response = await tools_of(request).CreateCredential(
        tools_pb2.CreateCredentialRequest(
            organization_id=who.organization_id,
            integration_name=integration,
            auth_type=auth_type,
            auth_data=pb.to_struct(auth_data or {}),
            display_name=string_field(body, "display_name"),
            metadata=pb.to_struct(metadata),
            make_default=bool_field(body, "make_default"),
            user_id=who.user_id,
        ),
        timeout=TIMEOUT_S,
    )
    return JSONResponse(credential_json(response.credential), status_code=201)


@router.get(
    "/credentials",
    summary="The organization's credentials (metadata only), newest first",
    tags=["credentials"],
    response_model=CredentialPage,
    openapi_extra=keyed(),
)
async def list_credentials(
    request: Request,
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
    response = await tools_of(request).ListCredentials(
        tools_pb2.ListCredentialsRequest(
            organization_id=who.organization_id,
            integration_name=integration_name or "",
            auth_type=SDK_AUTH_TYPES.get(auth_type, auth_type)
            if auth_type
            else "",  # the SDK's names, as on create
            limit=limit,
            offset=offset,
        ),
        timeout=TIMEOUT_S,
    )
    page: CredentialPage = {
        "credentials": [credential_json(c) for c in response.credentials],
        "total": response.total,
        "limit": limit,
        "offset": offset,
        "has_next": offset + len(response.credentials) < response.total,
        "has_previous": offset > 0,
    }
    return JSONResponse(page)


@router.post(
    "/credentials/mcp-server",
    status_code=201,
    summary="Register a Streamable HTTP MCP server",
    tags=["credentials"],
    response_model=McpServerCreated,
    openapi_extra=keyed(CREATE_MCP_SERVER_BODY),
)
async def create_mcp_server(request: Request, who: Principal = Who) -> Response:
    body = await body_of(request)
    check_fields(body, {"server_url", "headers", "display_name", "make_default"})
    url = string_field(body, "server_url", required=True)
    headers = object_field(body, "headers") or {}
    problem = header_fields_problem(headers)
    if problem is not None:
        raise BodyError(400, problem)
    response = await tools_of(request).CreateMcpServer(
        tools_pb2.CreateMcpServerRequest(
            organization_id=who.organization_id,
            server_url=url,
            headers=pb.to_struct(headers),
            display_name=string_field(body, "display_name"),
            make_default=bool_field(body, "make_default"),
            user_id=who.user_id,
        ),
        timeout=SLOW_TIMEOUT_S,
    )
    c = response.credential
    created: McpServerCreated = {
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
    }
    return JSONResponse(created, status_code=201)


@router.post(
    "/credentials/oauth2/initiate",
    summary="Start an OAuth2 authorization code flow (PKCE)",
    tags=["credentials"],
    response_model=OAuth2Started,
    openapi_extra=keyed(INITIATE_OAUTH2_BODY),
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
    response = await tools_of(request).InitiateOAuth2(
        tools_pb2.InitiateOAuth2Request(
            organization_id=who.organization_id,
            integration_name=string_field(body, "integration_name", required=True),
            redirect_uri=string_field(body, "redirect_uri", required=True),
            scope=string_field(body, "scope"),
            display_name=string_field(body, "display_name"),
            make_default=bool_field(body, "make_default"),
            user_id=who.user_id,
        ),
        timeout=TIMEOUT_S,
    )
    started: OAuth2Started = {
        "authorization_url": response.authorization_url,
        "state": response.state,
    }
    return JSONResponse(started)


@router.get(
    "/credentials/oauth2/callback",
    summary="OAuth2 redirect target: exchange the code, store the credential",
    tags=["credentials"],
    response_model=OAuth2Connected,
    # no API key (an empty security requirement): the browser comes back from the authorization
    # server with the state only
    openapi_extra={**OAUTH2_CALLBACK_PARAMETERS, "security": []},
)
async def oauth2_callback(
    request: Request,
    state: Annotated[str, Query(include_in_schema=False)] = "",
    code: Annotated[str, Query(include_in_schema=False)] = "",
    error: Annotated[str, Query(include_in_schema=False)] = "",
    error_description: Annotated[str, Query(include_in_schema=False)] = "",
) -> Response:
    # No API key here: the browser arrives from the authorization server; the
    # single-use, unguessable state names the organization and the flow.
    if not state or not (code or error):
        return detail(400, "state and code are required")
    # a denial (`error`) spends the single-use state too: the flow cannot go on to an exchange;
    # the state is checked first, so a forged one is "Unknown or expired"
    response = await tools_of(request).CompleteOAuth2(
        tools_pb2.CompleteOAuth2Request(state=state, code=code, error=error[:2000]),
        timeout=TIMEOUT_S,
    )
    c = response.credential
    notified = False
    try:
        await context_of(request).orchestrator.NotifyCredentialConnected(
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
    connected: OAuth2Connected = {
        "status": "connected",
        "orchestrator_notified": notified,
        **credential_json(c),
    }
    return JSONResponse(connected)


@router.get(
    "/credentials/{credential_id}",
    summary="One credential (masked secret on request)",
    tags=["credentials"],
    response_model=CredentialDetail,
    openapi_extra=keyed(),
)
async def get_credential(
    credential_id: str, request: Request, who: Principal = Who, include_masked: TrueOrFalse = False
) -> Response:
    response = await tools_of(request).GetCredential(
        tools_pb2.GetCredentialRequest(
            organization_id=who.organization_id,
            credential_id=credential_id,
            include_masked=include_masked,
        ),
        timeout=TIMEOUT_S,
    )
    creator = response.credential.created_by_user_id
    sessions = context_of(request).authenticator.sessions
    email = await user_email(sessions, creator) if creator else None
    return JSONResponse(credential_detail_json(response.credential, email))


@router.delete(
    "/credentials/{credential_id}",
    status_code=204,
    summary="Delete a credential",
    tags=["credentials"],
    openapi_extra=keyed(),
)
async def delete_credential(credential_id: str, request: Request, who: Principal = Who) -> Response:
    context = context_of(request)
    await refuse_body(request, context.settings.max_body_bytes)
    # no PUT of the default between this check and the deletion
    async with context.default_models.exclusive(who.organization_id) as default:
        saved = default.saved
        if saved is not None and saved.get("credential_id") == credential_id:
            # deleting it would break every turn that names no model (they use the saved default)
            raise BodyError(
                409,
                "This credential is the key of the organization's default model: save another "
                "default with PUT /organizations/settings/composer-llm first",
            )
        await tools_of(request).DeleteCredential(
            tools_pb2.DeleteCredentialRequest(
                organization_id=who.organization_id, credential_id=credential_id
            ),
            timeout=TIMEOUT_S,
        )
    return Response(status_code=204)


@router.post(
    "/credentials/{credential_id}/set-default",
    summary="Make a credential its integration's default",
    tags=["credentials"],
    response_model=Credential,
    openapi_extra=keyed(),
)
async def set_default(credential_id: str, request: Request, who: Principal = Who) -> Response:
    await refuse_body(request, context_of(request).settings.max_body_bytes)
    response = await tools_of(request).SetDefaultCredential(
        tools_pb2.SetDefaultCredentialRequest(
            organization_id=who.organization_id, credential_id=credential_id
        ),
        timeout=TIMEOUT_S,
    )
    return JSONResponse(credential_json(response.credential))


@router.post(
    "/credentials/{credential_id}/refresh-discovery",
    summary="Discover an MCP server's tools again",
    tags=["credentials"],
    response_model=DiscoveryRefreshed,
    openapi_extra=keyed(),
)
async def refresh_discovery(credential_id: str, request: Request, who: Principal = Who) -> Response:
    await refuse_body(request, context_of(request).settings.max_body_bytes)
    r = await tools_of(request).RefreshMcpDiscovery(
        tools_pb2.RefreshMcpDiscoveryRequest(
            organization_id=who.organization_id, credential_id=credential_id
        ),
        timeout=SLOW_TIMEOUT_S,
    )
    refreshed: DiscoveryRefreshed = {
        "credential_id": r.credential_id,
        "refreshed_at": pb.iso(r.refresh_time),
        "changes": {"added": list(r.added), "removed": list(r.removed)},
        "total_tools": r.total_tools,
        "success": r.success,
        "error": r.error or None,
    }
    return JSONResponse(refreshed)


@router.get(
    "/credentials/{credential_id}/mcp-tools",
    summary="The tools discovered on an MCP server",
    tags=["credentials"],
    response_model=McpToolList,
    openapi_extra=keyed(),
)
async def mcp_tools(credential_id: str, request: Request, who: Principal = Who) -> Response:
    r = await tools_of(request).ListMcpTools(
        tools_pb2.ListMcpToolsRequest(
            organization_id=who.organization_id, credential_id=credential_id
        ),
        timeout=TIMEOUT_S,
    )
    listed: McpToolList = {
        "credential_id": r.credential_id,
        "tools": [mcp_tool_json(t) for t in r.tools],
        "total_count": len(r.tools),
        "discovered_at": pb.iso(r.discovery_time) if r.HasField("discovery_time") else None,
    }
    return JSONResponse(listed)
