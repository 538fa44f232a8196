"""ListIntegrations and GetIntegration: the integrations an organization sees, for the gateway's
`GET /integrations/...` routes (the SDK's `integrations` resource).

What is listed, in this order: the integrations the assistant's tools see
(`ToolExecutor.visible_integrations`: the catalogue, the operator's stdio MCP servers, the
organization's MCP servers) as type "tool"; the model providers the request names (the
orchestrator's, passed on by the gateway) as "llm_provider", with the auth options of the
catalogue integration their key is stored under (`openai`, `anthropic`: those key holders are
not listed as tools); and the knowledge store as "knowledge_provider" (KNOWLEDGE_PROVIDER).

A listing reads an integration's actions only with `include_details`, and then only for the page
it answers: the generated catalogue keeps its actions on disk until they are asked for. An
integration is `connected` when the organization has a credential for it or it takes none, as in
`get_available_integrations` (`http` can run without one but takes one: not connected until then).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import grpc

from loopline.tools.v1 import tools_pb2, tools_pb2_grpc
from services.common import ids, pb
from services.common.errors import TOOLS_DOMAIN, RpcError, bounded, rpc_handler
from services.tools.catalogue import Action, ActionContext, ActionError, AuthOption, Integration
from services.tools.mcp_servers import MCP_ACTION_MILLICREDITS
from services.tools.netpolicy import OutboundPolicyError
from services.tools.request_checks import check_length, invalid, page_size
from services.tools.tool_definitions import TOOL_DEFINITIONS
from services.tools.tools import ToolExecutor

INTEGRATION_TYPES = ("tool", "llm_provider", "knowledge_provider")
# The knowledge store's name as a knowledge provider.
KNOWLEDGE_PROVIDER = "loopline_knowledge"
# Page sizes of ListIntegrations: 0 means DEFAULT_LIMIT.
DEFAULT_LIMIT, MAX_LIMIT = 50, 100
# Filter lengths, in characters (the gateway's limits).
FILTER_LIMITS = {"category": 100, "auth_type": 32, "search": 200, "name": 100}
# The keys of an oauth2 option's settings that are shown (public facts of the provider's app).
OAUTH_CONFIG_KEYS = ("authorize_url", "token_url", "scopes", "use_pkce")

# RpcError -> its rich status (as servicer.py's `unary`).
unary = rpc_handler(
    internal_domain=TOOLS_DOMAIN,
    check=ids.request_organization_check(TOOLS_DOMAIN, "ORGANIZATION_REQUIRED"),
)


@dataclass(frozen=True)
class Listed:
    """One integration as listed: its Integration (a model provider's and the knowledge store's
    are built here), its type, and whether the organization can use it now."""

    integration: Integration
    integration_type: str
    connected: bool
    provider: tools_pb2.ModelProvider | None = None


def is_model_key(integration: Integration) -> bool:
    """Whether `integration` only holds an organization's model key (integrations/models.py):
    it is shown as its model provider, not as a tool."""
    return integration.source == "builtin" and "models" in integration.categories


async def _not_an_action(_ctx: ActionContext, _params: dict[str, Any]) -> Any:
    raise ActionError("search the knowledge bases with the search_knowledge tool")


def knowledge_integration(search_millicredits: int) -> Integration:
    """The knowledge store as an integration: one action, the search_knowledge tool's."""
    tool = next(d for d in TOOL_DEFINITIONS if d["name"] == "search_knowledge")
    search = Action(
        tool["name"], tool["description"], tool["input_schema"], search_millicredits, _not_an_action
    )
    return Integration(
        name=KNOWLEDGE_PROVIDER,
        display_name="Loopline knowledge bases",
        description="The organization's knowledge bases (POST /knowledge-bases), searched by "
        "meaning and by words by the assistant's search_knowledge tool.",
        categories=("knowledge",),
        auth_options=(AuthOption("none", "No credential", "Built in.", None),),
        actions={search.name: search},
    )


def provider_integration(
    provider: tools_pb2.ModelProvider, key_holder: Integration | None
) -> Integration:
    """A model provider as an integration: an organization's key is one of its auth options (those
    of `key_holder`, the integration its key is stored under) when it takes one; "none" when the
    deployment serves it without."""
    options: tuple[AuthOption, ...] = ()
    if provider.platform_key:
        options += (AuthOption("none", "No key", "Served with the deployment's own key.", None),)
    if provider.bring_your_own_key and key_holder is not None:
        options += tuple(o for o in key_holder.auth_options if o.type != "none")
    return Integration(
        name=provider.provider_id,
        display_name=provider.display_name or provider.provider_id,
        description=provider.description,
        categories=key_holder.categories if key_holder is not None else ("models",),
        auth_options=options,
        actions={},
        source="deployment",
    )


def matches(listed: Listed, request: tools_pb2.ListIntegrationsRequest) -> bool:
    """Whether `listed` passes the request's filters (type, category, auth type, search text)."""
    integration = listed.integration
    if request.integration_type and listed.integration_type != request.integration_type:
        return False
    categories = [c.lower() for c in integration.categories]
    if request.category and request.category.lower() not in categories:
        return False
    if request.auth_type and request.auth_type not in integration.auth_types:
        return False
    text = request.search.strip().lower()
    if text:
        haystack = " ".join(
            [integration.name, integration.display_name, integration.description, *categories]
        ).lower()
        return text in haystack
    return True


def auth_schema_pb(
    option: AuthOption, oauth_apps: Collection[str], name: str
) -> tools_pb2.AuthSchema:
    """The AuthSchema of `option`: its fields from the JSON Schema of its secret, and for oauth2
    the public part of its settings and whether this deployment can connect it."""
    schema = option.fields or {}
    required = set(schema.get("required") or ())
    fields = [
        tools_pb2.AuthField(
            name=field,
            display_name=str(spec.get("title") or field),
            description=str(spec.get("description") or ""),
            required=field in required,
            sensitive=bool(spec.get("writeOnly")),
        )
        for field, spec in (schema.get("properties") or {}).items()
        if isinstance(spec, dict)
    ]
    message = tools_pb2.AuthSchema(
        auth_type=option.type,
        display_name=option.label,
        description=option.description,
        fields=fields,
        setup_instructions=list(option.setup_instructions),
        oauth_connectable=option.type == "oauth2" and name in oauth_apps,
    )
    if option.type == "oauth2" and option.oauth:
        shown = {k: option.oauth[k] for k in OAUTH_CONFIG_KEYS if k in option.oauth}
        message.oauth_config.CopyFrom(pb.to_struct(shown, clip=True))
    return message


def action_pb(action: Action) -> tools_pb2.IntegrationAction:
    """The IntegrationAction of `action` (its schema clipped to the JSON depth limit)."""
    return tools_pb2.IntegrationAction(
        name=action.name,
        description=action.description,
        parameters=pb.to_struct(action.parameters, clip=True),
        credit_cost_millicredits=action.credit_cost_millicredits,
        effects=list(action.effects),
    )


def mcp_action_pb(tool: dict[str, Any]) -> tools_pb2.IntegrationAction:
    """The IntegrationAction of a discovered MCP tool {name, description, input_schema}."""
    return tools_pb2.IntegrationAction(
        name=tool["name"],
        description=tool["description"],
        parameters=pb.to_struct(tool["input_schema"], clip=True),
        credit_cost_millicredits=MCP_ACTION_MILLICREDITS,
    )


class IntegrationListing:
    """Builds the answers of ListIntegrations and GetIntegration.

    Args:
        executor: what the assistant's tools see (catalogue, MCP servers, credentials).
        oauth_apps: the names of the integrations whose OAuth2 app the operator configured.
    """

    def __init__(self, executor: ToolExecutor, oauth_apps: Collection[str] = ()) -> None:
        self.executor = executor
        self.oauth_apps = oauth_apps

    async def listed(
        self, org_id: str, providers: Collection[tools_pb2.ModelProvider], integration_type: str
    ) -> list[Listed]:
        """Everything `org_id` sees (of `integration_type` when set), in listing order."""
        connected = await self.executor.credentials.connected_integrations(org_id)
        found: list[Listed] = []
        if integration_type in ("", "tool"):
            found += [
                Listed(i, "tool", i.name in connected or i.auth_types == ["none"])
                for i in await self.executor.visible_integrations(org_id)
                if not is_model_key(i)
            ]
        if integration_type in ("", "llm_provider"):
            for provider in providers:
                holder = self.executor.catalogue.get(provider.integration_name)
                integration = provider_integration(provider, holder)
                own_key = provider.bring_your_own_key and provider.integration_name in connected
                found.append(
                    Listed(integration, "llm_provider", provider.platform_key or own_key, provider)
                )
        if integration_type in ("", "knowledge_provider"):
            millicredits = self.executor.settings.tools_search_millicredits
            found.append(Listed(knowledge_integration(millicredits), "knowledge_provider", True))
        return found

    async def _actions(
        self, integration: Integration, discover: bool
    ) -> list[tools_pb2.IntegrationAction]:
        """The actions of `integration`. An operator's stdio MCP server's are those discovered
        (with `discover`, a discovery is started when there are none yet; a failed one lists
        none: the assistant's tools report it)."""
        stdio = self.executor.stdio
        if integration.name in stdio.servers and not integration.actions:
            tools = stdio.discovered(integration.name)
            if tools is None and discover:
                try:
                    tools = await stdio.tools(integration.name)
                except (TimeoutError, ActionError, OutboundPolicyError):
                    tools = None
            return [mcp_action_pb(t) for t in tools or []]
        return [action_pb(a) for a in integration.actions.values()]

    async def message(
        self, listed: Listed, details: bool, discover: bool = False
    ) -> tools_pb2.Integration:
        """The Integration message of `listed`, with its details when asked for."""
        integration = listed.integration
        message = tools_pb2.Integration(
            name=integration.name,
            display_name=integration.display_name,
            description=integration.description,
            logo=integration.logo or "",
            app_url=integration.app_url or "",
            categories=list(integration.categories),
            integration_type=listed.integration_type,
            version=integration.version,
            connected=listed.connected,
            source=integration.source,
            requires_credential=integration.requires_credential,
            details=details,
        )
        if listed.provider is not None:
            message.any_model = listed.provider.any_model
        if not details:
            return message
        message.auth_schemas.extend(
            auth_schema_pb(o, self.oauth_apps, integration.name)
            for o in integration.auth_options
            if o.type != "none"
        )
        message.actions.extend(await self._actions(integration, discover))
        if listed.provider is not None:
            message.model_ids.extend(listed.provider.model_ids)
        return message

    async def list(
        self, request: tools_pb2.ListIntegrationsRequest
    ) -> tools_pb2.ListIntegrationsResponse:
        """A filtered page of what the organization sees (see ListIntegrationsRequest)."""
        _check_type(request.integration_type)
        for field in ("category", "auth_type", "search"):
            check_length(field, getattr(request, field), FILTER_LIMITS[field])
        limit = page_size("limit", request.limit, 1, MAX_LIMIT, DEFAULT_LIMIT)
        if request.offset < 0:
            raise invalid("INVALID_OFFSET", f"offset must be >= 0, not {request.offset}")
        everything = await self.listed(
            request.organization_id, request.model_providers, request.integration_type
        )
        found = [listed for listed in everything if matches(listed, request)]
        page = found[request.offset : request.offset + limit]
        return tools_pb2.ListIntegrationsResponse(
            integrations=[await self.message(listed, request.include_details) for listed in page],
            total_size=len(found),
        )

    async def get(
        self, request: tools_pb2.GetIntegrationRequest
    ) -> tools_pb2.GetIntegrationResponse:
        """One integration with its details; NOT_FOUND INTEGRATION_NOT_FOUND when the organization
        sees none of that name and type. A name that is both a tool and a model provider (none
        today) is the tool."""
        _check_type(request.integration_type)
        check_length("name", request.name, FILTER_LIMITS["name"])
        everything = await self.listed(
            request.organization_id, request.model_providers, request.integration_type
        )
        listed = next((x for x in everything if x.integration.name == request.name), None)
        if listed is None:
            kind = request.integration_type.replace("_", " ") or "integration"
            raise RpcError(
                grpc.StatusCode.NOT_FOUND,
                "INTEGRATION_NOT_FOUND",
                f"No {kind} named {bounded(request.name, 100)!r}",
                domain=TOOLS_DOMAIN,
                metadata={"integration_type": request.integration_type},
            )
        return tools_pb2.GetIntegrationResponse(
            integration=await self.message(listed, details=True, discover=True)
        )


def _check_type(integration_type: str) -> None:
    """INVALID_ARGUMENT UNKNOWN_INTEGRATION_TYPE unless `integration_type` is "" or a known one."""
    if integration_type and integration_type not in INTEGRATION_TYPES:
        raise invalid(
            "UNKNOWN_INTEGRATION_TYPE",
            f"integration_type must be one of {', '.join(INTEGRATION_TYPES)}",
        )


class IntegrationRpcs(tools_pb2_grpc.ToolsServiceServicer):
    """ListIntegrations and GetIntegration of the tools servicer (a base of ToolsServicer, which
    sets `listing`)."""

    listing: IntegrationListing

    @unary
    async def ListIntegrations(
        self, request: tools_pb2.ListIntegrationsRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.ListIntegrationsResponse:
        """A filtered page of the integrations the organization sees (IntegrationListing.list)."""
        return await self.listing.list(request)

    @unary
    async def GetIntegration(
        self, request: tools_pb2.GetIntegrationRequest, context: grpc.aio.ServicerContext
    ) -> tools_pb2.GetIntegrationResponse:
        """One integration with its details (IntegrationListing.get)."""
        return await self.listing.get(request)
