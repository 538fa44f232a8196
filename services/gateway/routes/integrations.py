"""Integration routes: the integrations an organization can use (over the tools service's
ListIntegrations and GetIntegration, with the orchestrator's model providers).

Routes and JSON shapes follow the official SDK (`modulex/resources/integrations.py`,
`types/integrations.py`): browse (filters, pages), the tools, the model providers
(`llm-providers`), the knowledge store (`knowledge-providers`), and one integration by name.
Every route requires an owner or admin, authenticated before anything is looked up. An unknown
name is 404 `{"detail": ...}`; a bad filter or page value is 400. Auth types are the SDK's names
(`bearer_token` for the tools service's `bearer`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import JSONResponse, Response

from loopline.assistant.v1 import assistant_pb2
from loopline.tools.v1 import tools_pb2
from services.common import pb
from services.gateway.context import context_of
from services.gateway.errors import BodyError
from services.gateway.identity import Principal
from services.gateway.openapi import error_responses, keyed
from services.gateway.query import TrueOrFalse, WholeNumber
from services.gateway.routes.fields import TIMEOUT_S, Who, tools_of
from services.gateway.schemas import (
    AuthSchema,
    IntegrationAction,
    IntegrationDetail,
    IntegrationModel,
    IntegrationPage,
    IntegrationSummary,
    IntegrationType,
)

_TYPES: dict[str, IntegrationType] = {
    "tool": "tool",
    "llm_provider": "llm_provider",
    "knowledge_provider": "knowledge_provider",
}
INTEGRATION_TYPES = tuple(_TYPES)
# The auth types a browse can filter by: the tools service's, and the SDK's `bearer_token`.
AUTH_TYPES = ("api_key", "bearer_token", "bearer", "oauth2", "custom", "mcp_server", "none")
# The SDK's names of the tools service's auth types, and back.
SDK_AUTH_TYPES = {"bearer": "bearer_token"}
_FROM_SDK = {sdk: ours for ours, sdk in SDK_AUTH_TYPES.items()}
# Page sizes of browse (the tools service's bound) and the pages a whole listing is read in.
MAX_PAGE_SIZE = 100
MAX_PAGE = 10_000_000  # (page - 1) * page_size stays a 32-bit offset
# Filter lengths, in characters (the tools service's FILTER_LIMITS).
CATEGORY_CHARS, SEARCH_CHARS, NAME_CHARS = 100, 200, 100

Category = Annotated[str | None, Query(max_length=CATEGORY_CHARS)]
# an integration's name (the tools service's limit)
Name = Annotated[str, Path(max_length=NAME_CHARS)]
Shape = Literal["tool", "llm_provider", "knowledge_provider", "any"]


def _title(name: str) -> str:
    """A display name made of an action's name ("list_repos" -> "List repos")."""
    text = name.replace("_", " ").replace("-", " ").strip()
    return text[:1].upper() + text[1:] if text else name


def action_json(a: tools_pb2.IntegrationAction) -> IntegrationAction:
    """The SDK's IntegrationAction of `a`."""
    return {
        "name": a.name,
        "display_name": _title(a.name),
        "description": a.description,
        "parameters": pb.from_struct(a.parameters),
    }


def auth_schema_json(s: tools_pb2.AuthSchema, oauth_flags: bool = False) -> AuthSchema:
    """The SDK's AuthSchema of `s`; with `oauth_flags` (the detail routes), an oauth2 schema says
    whether it can be connected here."""
    oauth = pb.from_struct(s.oauth_config) if s.HasField("oauth_config") else None
    scopes = (oauth or {}).get("scopes")
    schema: AuthSchema = {
        "auth_type": SDK_AUTH_TYPES.get(s.auth_type, s.auth_type),
        "display_name": s.display_name,
        "description": s.description,
        "setup_environment_variables": [
            {
                "name": f.name,
                "display_name": f.display_name,
                "description": f.description,
                "required": f.required,
                "sensitive": f.sensitive,
            }
            for f in s.fields
        ],
        "setup_instructions": list(s.setup_instructions),
        "oauth_config": oauth,
        "required_scopes": [str(x) for x in scopes] if isinstance(scopes, list) else [],
    }
    if oauth_flags and s.auth_type == "oauth2":
        schema["supports_modulex_oauth"] = s.oauth_connectable
        schema["supports_custom_oauth"] = False
    return schema


def models_json(i: tools_pb2.Integration) -> list[IntegrationModel]:
    """The models of a model provider (its allowed model ids)."""
    return [{"id": m, "name": m, "display_name": m} for m in i.model_ids]


def _type_of(i: tools_pb2.Integration) -> IntegrationType:
    return _TYPES.get(i.integration_type, "tool")


def summary_json(i: tools_pb2.Integration) -> IntegrationSummary:
    """The SDK's IntegrationMetadata of `i` (details when `i.details`)."""
    kind = _type_of(i)
    return {
        "name": i.name,
        "display_name": i.display_name,
        "description": i.description,
        "logo": i.logo or None,
        "app_url": i.app_url or None,
        "docs_url": None,
        "categories": list(i.categories),
        "integration_type": kind,
        "version": i.version or None,
        "status": "connected" if i.connected else "available",
        "recommended": False,
        "actions": [action_json(a) for a in i.actions]
        if i.details and kind != "llm_provider"
        else None,
        "models": models_json(i) if i.details and kind == "llm_provider" else None,
        "auth_schemas": [auth_schema_json(s) for s in i.auth_schemas] if i.details else None,
    }


def detail_json(i: tools_pb2.Integration, shape: Shape) -> IntegrationDetail:
    """The SDK's IntegrationDetail of `i`: a detail route's `shape` sets `actions` (tools and
    knowledge) or `models` (model providers) and says whether oauth2 can be connected here;
    GET /integrations/{name} (`shape` "any") sets both, without the oauth2 flags."""
    kind = _type_of(i)
    metadata: dict[str, object] = {
        "source": i.source,
        "requires_credential": i.requires_credential,
        "actions": {
            a.name: {
                "credit_cost_millicredits": a.credit_cost_millicredits,
                "effects": list(a.effects),
            }
            for a in i.actions
        },
    }
    if kind == "llm_provider":
        metadata["any_model"] = i.any_model
    return {
        "name": i.name,
        "display_name": i.display_name,
        "description": i.description,
        "logo": i.logo or None,
        "app_url": i.app_url or None,
        "docs_url": None,
        "categories": list(i.categories),
        "integration_type": kind,
        "version": i.version or None,
        "status": "connected" if i.connected else "available",
        "auth_schemas": [auth_schema_json(s, shape != "any") for s in i.auth_schemas],
        "actions": [action_json(a) for a in i.actions] if shape != "llm_provider" else None,
        "models": models_json(i) if shape in ("llm_provider", "any") else None,
        "features": None,
        "metadata": metadata,
    }


async def model_providers(request: Request, integration_type: str) -> list[tools_pb2.ModelProvider]:
    """The orchestrator's model providers, for a listing of `integration_type` ("" for all) that
    includes them; [] for one that does not."""
    if integration_type not in ("", "llm_provider"):
        return []
    response = await context_of(request).orchestrator.ListModelProviders(
        assistant_pb2.ListModelProvidersRequest(), timeout=TIMEOUT_S
    )
    return [
        tools_pb2.ModelProvider(
            provider_id=p.provider_id,
            integration_name=p.integration_name,
            display_name=p.display_name,
            description=p.description,
            model_ids=list(p.model_ids),
            any_model=p.any_model,
            platform_key=p.platform_key,
            bring_your_own_key=p.bring_your_own_key,
        )
        for p in response.providers
    ]


async def query_of(
    request: Request, who: Principal, integration_type: str, **filters: str | bool
) -> tools_pb2.ListIntegrationsRequest:
    """The ListIntegrations request of the caller's organization with `filters` (category,
    auth_type, search, include_details), before its page is set."""
    return tools_pb2.ListIntegrationsRequest(
        organization_id=who.organization_id,
        integration_type=integration_type,
        model_providers=await model_providers(request, integration_type),
        **filters,  # type: ignore[arg-type]
    )


async def list_page(
    request: Request, query: tools_pb2.ListIntegrationsRequest, offset: int, limit: int
) -> tools_pb2.ListIntegrationsResponse:
    """The page of `query` at `offset` of at most `limit` integrations."""
    paged = tools_pb2.ListIntegrationsRequest()
    paged.CopyFrom(query)
    paged.offset, paged.limit = offset, limit
    return await tools_of(request).ListIntegrations(paged, timeout=TIMEOUT_S)


async def list_all(
    request: Request, query: tools_pb2.ListIntegrationsRequest
) -> list[tools_pb2.Integration]:
    """Every integration of `query`, read page by page (one message stays small even with the
    actions of a hundred integrations)."""
    found: list[tools_pb2.Integration] = []
    while True:
        page = await list_page(request, query, len(found), MAX_PAGE_SIZE)
        found.extend(page.integrations)
        if not page.integrations or len(found) >= page.total_size:
            return found


async def get_one(
    request: Request, who: Principal, name: str, integration_type: str
) -> tools_pb2.Integration:
    """The integration `name` (of `integration_type`, "" for any): 404 when there is none."""
    response = await tools_of(request).GetIntegration(
        tools_pb2.GetIntegrationRequest(
            organization_id=who.organization_id,
            name=name,
            integration_type=integration_type,
            model_providers=await model_providers(request, integration_type),
        ),
        timeout=TIMEOUT_S,
    )
    return response.integration


router = APIRouter(responses=error_responses(404))


@router.get(
    "/integrations/browse",
    summary="Browse the integrations (filters, pages)",
    tags=["integrations"],
    response_model=IntegrationPage,
    openapi_extra=keyed(),
)
async def browse(
    request: Request,
    who: Principal = Who,
    category: Category = None,
    # the enums are for the document only: the checks below give the 400s; empty is no filter
    integration_type: Annotated[
        str | None, Query(alias="type", json_schema_extra={"enum": ["", *INTEGRATION_TYPES]})
    ] = None,
    auth_type: Annotated[str | None, Query(json_schema_extra={"enum": ["", *AUTH_TYPES]})] = None,
    search: Annotated[str | None, Query(max_length=SEARCH_CHARS)] = None,
    include_details: TrueOrFalse = True,
    paginate: TrueOrFalse = True,
    page: Annotated[WholeNumber, Query(ge=1, le=MAX_PAGE)] = 1,
    page_size: Annotated[WholeNumber, Query(ge=1, le=MAX_PAGE_SIZE)] = 50,
) -> Response:
    if not 1 <= page <= MAX_PAGE:
        raise BodyError(400, f"page must be between 1 and {MAX_PAGE}")
    if not 1 <= page_size <= MAX_PAGE_SIZE:
        raise BodyError(400, f"page_size must be between 1 and {MAX_PAGE_SIZE}")
    if integration_type and integration_type not in INTEGRATION_TYPES:
        raise BodyError(400, f"type must be one of {', '.join(INTEGRATION_TYPES)}")
    if auth_type and auth_type not in AUTH_TYPES:
        raise BodyError(400, f"auth_type must be one of {', '.join(AUTH_TYPES)}")
    query = await query_of(
        request,
        who,
        integration_type or "",
        category=category or "",
        auth_type=_FROM_SDK.get(auth_type or "", auth_type or ""),
        search=search or "",
        include_details=include_details,
    )
    if paginate:
        offset = (page - 1) * page_size
        listed = await list_page(request, query, offset, page_size)
        integrations, total = list(listed.integrations), listed.total_size
        has_more = offset + len(integrations) < total
    else:  # everything on one page
        integrations = await list_all(request, query)
        total, page, page_size, has_more = len(integrations), 1, len(integrations), False
    answer: IntegrationPage = {
        "integrations": [summary_json(i) for i in integrations],
        "total": total,
        "page": page,
        "page_size": page_size,
        "has_more": has_more,
    }
    return JSONResponse(answer)


async def _listing(
    request: Request, who: Principal, integration_type: str, category: str | None
) -> Response:
    """Every integration of `integration_type` (in `category`), without details."""
    query = await query_of(request, who, integration_type, category=category or "")
    found = await list_all(request, query)
    return JSONResponse([summary_json(i) for i in found])


@router.get(
    "/integrations/tools",
    summary="The tool integrations",
    tags=["integrations"],
    response_model=list[IntegrationSummary],
    openapi_extra=keyed(),
)
async def tools(request: Request, who: Principal = Who, category: Category = None) -> Response:
    return await _listing(request, who, "tool", category)


@router.get(
    "/integrations/tools/{integration_name}",
    summary="One tool integration with its actions and auth schemas",
    tags=["integrations"],
    response_model=IntegrationDetail,
    openapi_extra=keyed(),
)
async def tool_detail(integration_name: Name, request: Request, who: Principal = Who) -> Response:
    found = await get_one(request, who, integration_name, "tool")
    return JSONResponse(detail_json(found, "tool"))


@router.get(
    "/integrations/llm-providers",
    summary="The model providers this deployment serves",
    tags=["integrations"],
    response_model=list[IntegrationSummary],
    openapi_extra=keyed(),
)
async def llm_providers(
    request: Request, who: Principal = Who, category: Category = None
) -> Response:
    return await _listing(request, who, "llm_provider", category)


@router.get(
    "/integrations/llm-providers/{provider_name}",
    summary="One model provider with its models",
    tags=["integrations"],
    response_model=IntegrationDetail,
    openapi_extra=keyed(),
)
async def llm_provider_detail(
    provider_name: Name, request: Request, who: Principal = Who
) -> Response:
    found = await get_one(request, who, provider_name, "llm_provider")
    return JSONResponse(detail_json(found, "llm_provider"))


@router.get(
    "/integrations/knowledge-providers",
    summary="The knowledge providers (Loopline's knowledge bases)",
    tags=["integrations"],
    response_model=list[IntegrationSummary],
    openapi_extra=keyed(),
)
async def knowledge_providers(
    request: Request, who: Principal = Who, category: Category = None
) -> Response:
    return await _listing(request, who, "knowledge_provider", category)


@router.get(
    "/integrations/knowledge-providers/{provider_name}",
    summary="One knowledge provider",
    tags=["integrations"],
    response_model=IntegrationDetail,
    openapi_extra=keyed(),
)
async def knowledge_provider_detail(
    provider_name: Name, request: Request, who: Principal = Who
) -> Response:
    found = await get_one(request, who, provider_name, "knowledge_provider")
    return JSONResponse(detail_json(found, "knowledge_provider"))


# after the routes above: `/integrations/tools` is the listing, not an integration named "tools"
@router.get(
    "/integrations/{integration_name}",
    summary="One integration of any type",
    tags=["integrations"],
    response_model=IntegrationDetail,
    openapi_extra=keyed(),
)
async def get_integration(
    integration_name: Name, request: Request, who: Principal = Who
) -> Response:
    found = await get_one(request, who, integration_name, "")
    return JSONResponse(detail_json(found, "any"))
