"""ListTools and the discovery tools: get_available_integrations, get_integration_details."""

from __future__ import annotations

import grpc
import pytest
from jsonschema import Draft202012Validator

from loopline.tools.v1 import tools_pb2
from services.common import pb
from services.common.errors import TOOLS_DOMAIN, status_details
from services.tools.tools import DESCRIBED_AT_MOST

FIVE = [
    "get_available_integrations",
    "get_integration_details",
    "get_organization_credentials",
    "execute_integration_tool",
    "search_knowledge",
]


async def test_list_tools_returns_the_five_assistant_tools_with_valid_schemas(tools_service):
    response = await tools_service.stub.ListTools(tools_pb2.ListToolsRequest(profile="assistant"))
    assert [t.name for t in response.tools] == FIVE
    for tool in response.tools:
        assert tool.description
        schema = pb.from_struct(tool.input_schema)
        Draft202012Validator.check_schema(schema)
        assert schema["type"] == "object"
    schemas = {t.name: pb.from_struct(t.input_schema) for t in response.tools}
    assert schemas["execute_integration_tool"]["required"] == ["integration", "action"]
    assert schemas["search_knowledge"]["properties"]["top_k"]["maximum"] == 50


async def test_list_tools_of_an_unknown_profile_is_invalid_and_names_the_known_ones(tools_service):
    # It was an empty list, as if the profile had no tools.
    for profile in ("zzz", "composer", "Assistant", "x" * 10_000):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await tools_service.stub.ListTools(tools_pb2.ListToolsRequest(profile=profile))
        details = status_details(caught.value)
        assert (details.code, details.reason, details.domain) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "UNKNOWN_PROFILE",
            TOOLS_DOMAIN,
        )
        assert details.message.endswith(
            "; the known profiles are: assistant (empty means assistant)"
        )
        assert details.metadata == {"field": "profile", "known_profiles": "assistant"}
        assert len(details.message) < 200


async def test_list_tools_of_the_empty_profile_is_the_assistants(tools_service):
    response = await tools_service.stub.ListTools(tools_pb2.ListToolsRequest())
    assert [t.name for t in response.tools] == FIVE


async def test_unknown_tool_is_a_failed_result_not_an_rpc_error(tools_service):
    error = await tools_service.failed("ask_user_yes_no", {"question": "?"})
    assert "Unknown tool 'ask_user_yes_no'" in error


async def test_tool_input_that_breaks_its_schema_is_a_failed_result(tools_service):
    error = await tools_service.failed("get_integration_details", {"integration": 3})
    assert "Invalid input for get_integration_details" in error
    assert "input.integration" in error


async def test_available_integrations_become_connected_when_a_credential_is_created(tools_service):
    before = await tools_service.ok("get_available_integrations", {})
    by_name = {i["name"]: i for i in before["integrations"]}
    assert {"postgresql", "http", "loopline"} <= set(by_name)
    assert by_name["postgresql"]["connected"] is False
    assert by_name["http"]["connected"] is False
    assert by_name["loopline"]["connected"] is True  # needs no credential
    assert by_name["postgresql"]["auth_types"] == ["api_key"]
    # the whole catalogue is listed without descriptions; a narrower listing has them
    assert set(by_name["postgresql"]) == {"name", "display_name", "connected", "auth_types"}
    assert before["count"] == len(before["integrations"]) > DESCRIBED_AT_MOST
    assert "get_integration_details" in before["note"]
    narrow = await tools_service.ok("get_available_integrations", {"query": "postgresql"})
    assert set(narrow["integrations"][0]) == {
        "name",
        "display_name",
        "description",
        "categories",
        "connected",
        "auth_types",
    }
    assert "note" not in narrow

    await tools_service.create_credential(
        "postgresql", {"dsn": "postgresql://u:p@db.example:5432/x"}
    )
    await tools_service.create_credential("http", {"token": "tok-123456789"}, auth_type="bearer")
    after = {
        i["name"]: i
        for i in (await tools_service.ok("get_available_integrations", {}))["integrations"]
    }
    assert after["postgresql"]["connected"] is True
    assert after["http"]["connected"] is True
    # Another organization sees nothing connected.
    other = {
        i["name"]: i
        for i in (await tools_service.ok("get_available_integrations", {}, org="org-b"))[
            "integrations"
        ]
    }
    assert other["postgresql"]["connected"] is False


async def test_available_integrations_filter_by_category_and_query(tools_service):
    databases = await tools_service.ok("get_available_integrations", {"category": "database"})
    assert [i["name"] for i in databases["integrations"]] == ["postgresql", "mysql", "supabase"]
    web = await tools_service.ok("get_available_integrations", {"query": "HTTP request"})
    assert [i["name"] for i in web["integrations"]] == ["http"]
    none = await tools_service.ok("get_available_integrations", {"query": "no-such-thing"})
    assert none == {"integrations": [], "count": 0}


async def test_integration_details_give_actions_with_schemas_costs_and_auth_options(tools_service):
    details = await tools_service.ok("get_integration_details", {"integration": "postgresql"})
    assert details["name"] == "postgresql"
    assert details["requires_credential"] is True
    actions = {a["name"]: a for a in details["actions"]}
    assert set(actions) == {"list_schemas", "list_tables", "describe_table", "run_query"}
    assert actions["run_query"]["credit_cost_millicredits"] == 500
    assert actions["run_query"]["parameters"]["required"] == ["sql"]
    for action in actions.values():
        Draft202012Validator.check_schema(action["parameters"])
    (option,) = details["auth_options"]
    assert option["type"] == "api_key"
    assert option["fields"]["required"] == ["dsn"]

    http = await tools_service.ok("get_integration_details", {"integration": "http"})
    assert [o["type"] for o in http["auth_options"]] == ["none", "bearer", "api_key"]
    assert http["requires_credential"] is False


async def test_integration_details_of_an_unknown_integration_is_a_failed_result(tools_service):
    error = await tools_service.failed("get_integration_details", {"integration": "gitrub"})
    assert "Unknown integration 'gitrub'" in error
    assert "postgresql" in error
