"""The SDK's `integrations` resource against the gateway: browse (filters, pages, details), the
tools, the model providers, the knowledge provider, one integration by name; and the refusals
(404 for an unknown name, 400 for a bad filter or page) over raw HTTP.

Shapes: the SDK's `modulex/types/integrations.py`. The model providers are the orchestrator's
(ListModelProviders); the tools service lists them beside its integrations.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import pytest
from modulex import Modulex
from modulex._exceptions import NotFoundError

from loopline.tools.v1 import tools_pb2
from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.servicer.model_providers import model_providers
from services.tools.catalogue import (
    Action,
    ActionError,
    AuthOption,
    Catalogue,
    Integration,
    LazyActions,
)
from services.tools.config import ToolsSettings
from services.tools.listing import KNOWLEDGE_PROVIDER, IntegrationListing
from services.tools.mcp_servers import StdioRegistry
from services.tools.mcp_stdio import StdioServer
from services.tools.tools import ToolExecutor
from tests.conftest import Stack, start_stack, stop_stack
from tests.gateway.test_oauth2_connect import acme_provider
from tests.tools.tools_stack import PG_DSN, failure_mcp_app, serve_asgi

T = TypeVar("T")


def given(value: T | None) -> T:
    """`value`, which the answer must have set (the SDK's models make every detail optional)."""
    assert value is not None
    return value


def sdk(stack: Stack) -> Modulex:
    return Modulex(api_key=stack.api_key, organization_id=stack.org_id, base_url=stack.base_url)


@pytest.fixture
async def stack(tmp_path) -> AsyncIterator[Stack]:
    """The four services with the operator's OAuth2 integration `acme` (its server is never
    reached: listing reads configuration only) and loopback allowed (an MCP server)."""
    running = await start_stack(
        tmp_path,
        tools={
            "tools_allow_private_network": True,
            "tools_oauth2_integrations": json.dumps([acme_provider("http://127.0.0.1:9")]),
        },
    )
    try:
        yield running
    finally:
        await stop_stack(running)


async def test_browse_lists_tools_model_providers_and_the_knowledge_store_with_details(stack):
    client = sdk(stack)
    try:
        page = await client.integrations.browse(paginate=False)
        by_name = {i.name: i for i in page.integrations}
        assert page.total == len(page.integrations) == len(by_name) and page.has_more is False
        assert (page.page, page.page_size) == (1, page.total)
        assert by_name["loopline"].integration_type == "tool"
        assert by_name["loopline"].status == "connected"  # needs no credential
        assert by_name["postgresql"].status == "available"
        assert by_name["http"].status == "available"  # runs without one, but takes a credential
        assert by_name["scripted"].integration_type == "llm_provider"
        assert by_name["scripted"].status == "connected"  # no key needed
        assert by_name["openai"].status == "available"  # no platform key in the tests
        assert by_name[KNOWLEDGE_PROVIDER].integration_type == "knowledge_provider"
        # details by default: actions with their schemas, auth schemas in the SDK's names
        echo = next(a for a in given(by_name["loopline"].actions) if a.name == "echo")
        assert echo.parameters["required"] == ["message"] and echo.display_name == "Echo"
        http = {s.auth_type for s in given(by_name["http"].auth_schemas)}
        assert http == {"bearer_token", "api_key"}  # "none" is no schema
        assert [m.id for m in given(by_name["scripted"].models)] == ["default"]
        assert by_name["scripted"].actions is None and by_name["loopline"].models is None
        # the model key holders are their providers, not tools
        assert [i.integration_type for i in page.integrations if i.name == "openai"] == [
            "llm_provider"
        ]
        bare = await client.integrations.browse(include_details=False, paginate=False)
        assert [i.name for i in bare.integrations] == [i.name for i in page.integrations]
        assert all(i.actions is None and i.auth_schemas is None for i in bare.integrations)
    finally:
        await client.close()


async def test_browse_pages_follow_the_listing_order(stack):
    client = sdk(stack)
    try:
        everything = await client.integrations.browse(paginate=False, include_details=False)
        names = [i.name for i in everything.integrations]
        assert everything.total == len(names) > 5 and everything.has_more is False
        second = await client.integrations.browse(page=2, page_size=2, include_details=False)
        assert [i.name for i in second.integrations] == names[2:4]
        assert (second.total, second.page, second.page_size, second.has_more) == (
            len(names),
            2,
            2,
            True,
        )
        last = await client.integrations.browse(page=len(names), page_size=1)
        assert [i.name for i in last.integrations] == names[-1:] and last.has_more is False
        beyond = await client.integrations.browse(page=len(names) + 1, page_size=1)
        assert beyond.integrations == [] and beyond.total == len(names)
    finally:
        await client.close()


async def test_browse_filters_by_type_category_auth_type_and_search(stack):
    client = sdk(stack)

    async def names(**filters: Any) -> list[str]:
        page = await client.integrations.browse(paginate=False, include_details=False, **filters)
        return [i.name for i in page.integrations]

    try:
        tools = await names(type="tool")
        providers = await names(type="llm_provider")
        assert "loopline" in tools and "scripted" not in tools and KNOWLEDGE_PROVIDER not in tools
        assert {"scripted", "openai", "anthropic"} <= set(providers)
        assert "loopline" not in providers
        assert await names(type="knowledge_provider") == [KNOWLEDGE_PROVIDER]
        utilities = await client.integrations.browse(category="UTILITIES", paginate=False)
        assert "loopline" in [i.name for i in utilities.integrations]  # case-insensitive
        assert all("utilities" in [c.lower() for c in i.categories] for i in utilities.integrations)
        found = await client.integrations.browse(search="PostgreSQL", paginate=False)
        assert "postgresql" in [i.name for i in found.integrations]
        for listed in found.integrations:
            text = " ".join(
                [
                    listed.name,
                    given(listed.display_name),
                    given(listed.description),
                    *listed.categories,
                ]
            )
            assert "postgresql" in text.lower()
        bearer = await client.integrations.browse(auth_type="bearer_token", paginate=False)
        assert "http" in [i.name for i in bearer.integrations]
        for listed in bearer.integrations:
            assert "bearer_token" in {s.auth_type for s in given(listed.auth_schemas)}
        assert await names(auth_type="bearer") == [i.name for i in bearer.integrations]
        assert "acme" in await names(auth_type="oauth2")
        assert "postgresql" not in await names(auth_type="oauth2")
        assert await names(search="no such integration anywhere") == []
    finally:
        await client.close()


async def test_status_is_connected_once_the_organization_has_a_credential(stack):
    client = sdk(stack)
    try:
        async with stack.client() as http:
            for name, auth_data in (("postgresql", {"dsn": PG_DSN}), ("openai", {"api_key": "k"})):
                created = await http.post(
                    "/credentials", json={"integration_name": name, "auth_data": auth_data}
                )
                assert created.status_code == 201, created.text
        tools = {i.name: i.status for i in await client.integrations.tools()}
        assert tools["postgresql"] == "connected" and tools["acme"] == "available"
        providers = {i.name: i.status for i in await client.integrations.llm_providers()}
        assert providers["openai"] == "connected" and providers["anthropic"] == "available"
    finally:
        await client.close()


async def test_the_list_routes_return_one_type_without_details(stack):
    client = sdk(stack)
    try:
        tools = await client.integrations.tools()
        assert tools and {i.integration_type for i in tools} == {"tool"}
        assert not {"openai", "anthropic", "scripted"} & {i.name for i in tools}
        assert all(i.actions is None and i.auth_schemas is None for i in tools)
        assert "acme" in [i.name for i in await client.integrations.tools(category="oauth2")]
        providers = await client.integrations.llm_providers()
        assert [i.name for i in providers][:3] == ["scripted", "openai", "anthropic"]
        assert all(i.models is None for i in providers)
        knowledge = await client.integrations.knowledge_providers()
        assert [i.name for i in knowledge] == [KNOWLEDGE_PROVIDER]
        assert await client.integrations.knowledge_providers(category="nope") == []
    finally:
        await client.close()


async def test_tool_detail_has_actions_costs_effects_and_auth_fields(stack):
    client = sdk(stack)
    try:
        pg = await client.integrations.tool_detail("postgresql")
        assert pg.integration_type == "tool" and pg.models is None
        assert pg.actions and all(a.parameters.get("type") == "object" for a in pg.actions)
        assert set(given(pg.metadata)["actions"]) == {a.name for a in given(pg.actions)}
        assert given(pg.metadata)["source"] == "builtin"
        assert given(pg.metadata)["requires_credential"] is True
        for costs in given(pg.metadata)["actions"].values():
            assert costs["credit_cost_millicredits"] >= 0 and isinstance(costs["effects"], list)
        (schema,) = pg.auth_schemas
        assert schema.auth_type == "api_key"
        assert [v["name"] for v in schema.setup_environment_variables] == ["dsn"]
        assert schema.setup_environment_variables[0]["required"] is True
        acme = await client.integrations.tool_detail("acme")
        (oauth,) = acme.auth_schemas
        assert (oauth.auth_type, oauth.supports_modulex_oauth) == ("oauth2", True)
        assert oauth.supports_custom_oauth is False
        assert "client-secret" not in json.dumps(acme.to_dict())  # the operator's app secret
        assert given(acme.metadata)["source"] == "oauth2"
        # GET /integrations/{name}: actions and models both set, no OAuth2 flags
        same = await client.integrations.get("acme")
        assert (
            same.actions
            and same.models == []
            and same.auth_schemas[0].supports_modulex_oauth is None
        )
    finally:
        await client.close()


async def test_model_provider_and_knowledge_provider_details(stack):
    client = sdk(stack)
    try:
        openai = await client.integrations.llm_provider_detail("openai")
        assert openai.actions is None and given(openai.metadata)["any_model"] is False
        defaults = OrchestratorSettings().openai_models.split(",")
        assert [m.id for m in given(openai.models)] == sorted(defaults)
        assert [s.auth_type for s in openai.auth_schemas] == ["api_key"]
        assert openai.auth_schemas[0].setup_environment_variables[0]["name"] == "api_key"
        scripted = await client.integrations.get("scripted")
        assert scripted.integration_type == "llm_provider" and scripted.actions == []
        assert [m.id for m in given(scripted.models)] == ["default"] and scripted.auth_schemas == []
        knowledge = await client.integrations.knowledge_provider_detail(KNOWLEDGE_PROVIDER)
        assert [a.name for a in given(knowledge.actions)] == ["search_knowledge"]
        assert given(knowledge.metadata)["actions"]["search_knowledge"][
            "credit_cost_millicredits"
        ] == (ToolsSettings().tools_search_millicredits)
    finally:
        await client.close()


async def test_an_organizations_mcp_server_is_a_tool_with_its_discovered_actions(stack):
    async with serve_asgi(failure_mcp_app([])) as base, stack.client() as http:
        created = await http.post(
            "/credentials/mcp-server",
            json={"server_url": f"{base}/mcp", "display_name": "Test Tools"},
        )
        assert created.status_code == 201, created.text
        name = created.json()["integration_name"]
        client = sdk(stack)
        try:
            (listed,) = (await client.integrations.browse(search="test tools")).integrations
            assert (listed.name, listed.status, listed.integration_type) == (
                name,
                "connected",
                "tool",
            )
            assert "echo" in {a.name for a in given(listed.actions)}
            detail = await client.integrations.tool_detail(name)
            assert given(detail.metadata)["source"] == "mcp"
            assert [s.auth_type for s in detail.auth_schemas] == ["mcp_server"]
        finally:
            await client.close()


async def test_unknown_names_are_404_on_every_detail_route(stack):
    client = sdk(stack)
    try:
        for call in (
            client.integrations.tool_detail("scripted"),  # a model provider, not a tool
            client.integrations.llm_provider_detail("loopline"),
            client.integrations.knowledge_provider_detail("openai"),
            client.integrations.get("no_such_integration"),
        ):
            with pytest.raises(NotFoundError):
                await call
    finally:
        await client.close()
    async with stack.client() as http:
        missing = await http.get("/integrations/no_such_integration")
        assert missing.status_code == 404
        assert missing.json() == {"detail": "No integration named 'no_such_integration'"}
        tool = await http.get("/integrations/tools/scripted")
        assert tool.json() == {"detail": "No tool named 'scripted'"}


@pytest.mark.parametrize(
    ("params", "detail"),
    [
        ({"page": "0"}, "page"),
        ({"page": "-1"}, "page"),
        ({"page": "x"}, "page"),
        ({"page_size": "0"}, "page_size"),
        ({"page_size": "101"}, "page_size"),
        ({"page_size": "1.5"}, "page_size"),
        ({"type": "tools"}, "type must be one of tool, llm_provider, knowledge_provider"),
        ({"auth_type": "basic"}, "auth_type must be one of"),
        ({"include_details": "yes"}, "include_details"),
        ({"paginate": "1"}, "paginate"),
        ({"search": "x" * 201}, "search"),
        ({"category": "x" * 101}, "category"),
    ],
)
async def test_bad_browse_values_are_400(services, params, detail):
    async with services.client() as http:
        response = await http.get("/integrations/browse", params=params)
    assert response.status_code == 400, response.text
    assert detail in response.json()["detail"]


async def test_the_routes_need_an_owner_or_admin(services):
    member = await services.member("member")
    async with services.client() as http:
        for path in ("/integrations/browse", "/integrations/tools", "/integrations/loopline"):
            anonymous = await http.get(path, headers={"Authorization": "Bearer nope"})
            assert anonymous.status_code == 401, path
            refused = await http.get(path, headers=services.headers(member["api_key"]))
            assert refused.status_code == 403, path
        too_long = await http.get("/integrations/" + "x" * 101)
        assert too_long.status_code == 400


def test_the_model_providers_are_the_orchestrators_configuration():
    settings = OrchestratorSettings(
        openai_api_key="sk-platform",
        openai_models="b-model,a-model",
        anthropic_models="*",
        openai_compatible_providers={
            "ollama": {"base_url": "http://127.0.0.1:11434/v1", "models": ["llama3.2"]},
            "keyed": {"base_url": "http://127.0.0.1:1/v1", "api_key_env": "LOOPLINE_NO_SUCH_VAR"},
        },
    )
    found = {p.provider_id: p for p in model_providers(settings)}
    assert list(found) == ["scripted", "openai", "anthropic", "ollama", "keyed"]
    assert list(found["openai"].model_ids) == ["a-model", "b-model"]
    assert found["openai"].platform_key and found["openai"].bring_your_own_key
    assert found["anthropic"].any_model and not found["anthropic"].platform_key
    assert found["ollama"].platform_key and not found["ollama"].bring_your_own_key  # needs no key
    assert not found["keyed"].platform_key and not found["keyed"].bring_your_own_key
    assert found["scripted"].integration_name == "loopline"
    assert "127.0.0.1" not in str(model_providers(settings))  # no base URL, no key
    assert "sk-platform" not in str(model_providers(settings))
    disabled = model_providers(OrchestratorSettings(scripted_model_enabled=False))
    assert "scripted" not in [p.provider_id for p in disabled]


class _NoCredentials:
    """The credential store of an organization that has none."""

    async def connected_integrations(self, org_id: str) -> set[str]:
        return set()

    async def of_auth_type(self, org_id: str, auth_type: str, **_: Any) -> list[Any]:
        return []


async def test_a_listing_reads_actions_only_for_the_page_it_answers_with_details():
    loads: list[str] = []

    def lazy(name: str) -> Integration:
        async def handler(_ctx: Any, _params: Any) -> Any:
            return None

        def load() -> dict[str, Action]:
            loads.append(name)
            return {"act": Action("act", "Acts.", {"type": "object"}, 5, handler)}

        option = AuthOption("api_key", "Key", "", {"type": "object"})
        return Integration(name, name, "", ("tests",), (option,), LazyActions(load))

    catalogue = Catalogue([lazy(f"lazy_{n}") for n in range(5)])
    executor = ToolExecutor(ToolsSettings(), catalogue, _NoCredentials(), None)  # type: ignore[arg-type]
    listing = IntegrationListing(executor)
    bare = await listing.list(tools_pb2.ListIntegrationsRequest(organization_id="org_1", limit=100))
    assert bare.total_size == 6 and loads == []  # five tools and the knowledge store
    detailed = await listing.list(
        tools_pb2.ListIntegrationsRequest(
            organization_id="org_1", include_details=True, offset=1, limit=2
        )
    )
    assert [i.name for i in detailed.integrations] == ["lazy_1", "lazy_2"]
    assert sorted(set(loads)) == ["lazy_1", "lazy_2"]  # LazyActions asks its (caching) loader
    assert [a.credit_cost_millicredits for a in detailed.integrations[0].actions] == [5]


class _Connector:
    """Discovers one tool on every stdio server, or fails as an unreachable server does."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.discoveries = 0

    async def list_tools(self, server: Any) -> list[dict[str, Any]]:
        self.discoveries += 1
        if self.fail:
            raise ActionError("the MCP server is unavailable")
        return [{"name": "ping", "description": "Pings.", "input_schema": {"type": "object"}}]


@pytest.mark.parametrize("fail", [False, True])
async def test_a_listing_never_waits_for_a_stdio_server_and_its_detail_discovers_it(fail):
    connector = _Connector(fail)
    stdio = StdioRegistry([StdioServer("ops", sys.executable, (), {})], connector)  # type: ignore[arg-type]
    executor = ToolExecutor(ToolsSettings(), Catalogue([]), _NoCredentials(), None, stdio=stdio)  # type: ignore[arg-type]
    listing = IntegrationListing(executor)
    query = tools_pb2.ListIntegrationsRequest(
        organization_id="org_1", integration_type="tool", include_details=True
    )
    (listed,) = (await listing.list(query)).integrations
    assert (listed.name, listed.source, listed.connected) == ("ops", "mcp", True)
    assert list(listed.actions) == [] and connector.discoveries == 0
    detail = await listing.get(tools_pb2.GetIntegrationRequest(organization_id="org_1", name="ops"))
    assert [a.name for a in detail.integration.actions] == ([] if fail else ["ping"])
    assert connector.discoveries == 1
    (listed,) = (await listing.list(query)).integrations
    assert [a.name for a in listed.actions] == ([] if fail else ["ping"])
