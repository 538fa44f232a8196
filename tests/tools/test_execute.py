"""execute_integration_tool: validation, credentials, time limit, output cap, outbound policy."""

from __future__ import annotations

import time

import pytest

from services.tools.tools import cap_result


async def test_parameters_that_break_the_action_schema_are_a_failed_result(tools_service):
    await tools_service.create_credential(
        "postgresql", {"dsn": "postgresql://postgres@127.0.0.1:5432/test"}
    )
    error = await tools_service.failed(
        "execute_integration_tool",
        {
            "integration": "postgresql",
            "action": "run_query",
            "parameters": {"sql": "select 1", "max_rows": 0, "x": 1},
        },
    )
    assert "Invalid parameters for postgresql.run_query" in error
    assert "parameters.max_rows: must be >= 1" in error
    assert "parameters: unexpected field(s) 'x' (allowed: 'sql', 'params', 'max_rows')" in error
    missing = await tools_service.failed(
        "execute_integration_tool", {"integration": "postgresql", "action": "run_query"}
    )
    assert "parameters: 'sql' is required" in missing


@pytest.mark.parametrize(
    ("tool", "tool_input", "field"),
    [
        ("get_organization_credentials", {"integration": "h\x00ttp"}, "integration"),
        ("get_integration_details", {"integration": "h\x00ttp"}, "integration"),
        (
            "execute_integration_tool",
            {
                "integration": "loopline",
                "action": "echo",
                "parameters": {"message": "hi"},
                "credential_id": "a\x00b",
            },
            "credential_id",
        ),
        (
            "search_knowledge",
            {"query": "hello", "knowledge_base_ids": ["kb", "a\x00b"]},
            "knowledge_base_ids",
        ),
    ],
)
async def test_a_nul_in_a_looked_up_field_is_a_clear_error_on_every_backend(
    tools_service, tool, tool_input, field
):
    # on PostgreSQL too, these are refused as input, not "failed because of an internal error"
    assert (
        await tools_service.failed(tool, tool_input)
        == f"Invalid input for {tool}: input.{field}: must not contain U+0000 (NUL)"
    )


async def test_a_nul_in_an_actions_parameters_is_the_actions_own_business(tools_service):
    output = await tools_service.ok(
        "execute_integration_tool",
        {"integration": "loopline", "action": "echo", "parameters": {"message": "a\x00b"}},
    )
    assert output["result"] == {"message": "a\x00b"}


async def test_unknown_action_lists_the_integrations_actions(tools_service):
    error = await tools_service.failed(
        "execute_integration_tool", {"integration": "loopline", "action": "reboot"}
    )
    assert "has no action 'reboot'" in error
    assert "echo" in error and "now" in error


async def test_missing_credential_tells_the_model_to_call_request_credential(tools_service):
    error = await tools_service.failed(
        "execute_integration_tool",
        {"integration": "postgresql", "action": "list_schemas", "parameters": {}},
    )
    assert "No credential for integration 'postgresql'" in error
    assert "request_credential" in error


async def test_another_organizations_credential_id_cannot_be_used(tools_service):
    theirs = await tools_service.create_credential(
        "postgresql", {"dsn": "postgresql://postgres@127.0.0.1:5432/test"}, org="org-b"
    )
    error = await tools_service.failed(
        "execute_integration_tool",
        {
            "integration": "postgresql",
            "action": "list_schemas",
            "credential_id": theirs.credential_id,
        },
    )
    assert "was not found" in error
    assert "request_credential" in error


async def test_credential_less_action_succeeds_and_reports_its_cost(tools_service):
    response = await tools_service.tool(
        "execute_integration_tool",
        {"integration": "loopline", "action": "echo", "parameters": {"message": "hi"}},
    )
    assert response.success
    assert response.millicredits == 0
    # the output travels as JSON text in the tool's key order, not as a protobuf Value tree
    assert not response.HasField("output") and response.output_json.startswith(
        b'{"integration":"loopline","action":"echo"'
    )
    from services.common import pb

    assert pb.output_of(response) == {
        "integration": "loopline",
        "action": "echo",
        "credential_id": None,
        "result": {"message": "hi"},
        "truncated": False,
        "result_bytes": 16,
    }


async def test_output_larger_than_the_cap_is_cut_with_a_marker(start_tools):
    tools = await start_tools(tools_max_output_bytes=4096)
    output = await tools.ok(
        "execute_integration_tool",
        {"integration": "loopline", "action": "echo", "parameters": {"message": "é" * 20_000}},
    )
    assert output["truncated"] is True
    assert output["result_bytes"] > 40_000
    assert isinstance(output["result"], str)
    assert output["result"].startswith('{"message":"éé')
    assert "[output truncated: " in output["result"]
    assert len(output["result"].encode()) <= 4096


def test_cap_result_keeps_small_results_and_cuts_on_a_character_boundary():
    assert cap_result({"a": 1}, 100) == ({"a": 1}, False, 7)
    value, truncated, size = cap_result(["€" * 1000], 300)
    assert truncated and size == 3004  # [" + 1000 × 3 bytes + "]
    assert len(value.encode()) <= 300
    value.encode("utf-8")  # no broken character


async def test_http_to_loopback_is_refused_by_default(tools_service, local_http):
    for url in (
        f"{local_http}/json",
        local_http.replace("127.0.0.1", "localhost") + "/json",
        "http://[::1]:9/",
        "http://10.1.2.3/",
    ):
        error = await tools_service.failed(
            "execute_integration_tool",
            {"integration": "http", "action": "request", "parameters": {"url": url}},
        )
        assert "outbound policy" in error, error


async def test_the_policy_names_the_kind_of_address_with_its_article(tools_service):
    # "an unspecified address", not "a unspecified address"
    for url, says in (
        ("http://0.0.0.0:9/", "resolves to an unspecified address"),
        ("http://10.1.2.3/", "resolves to a private address"),
    ):
        error = await tools_service.failed(
            "execute_integration_tool",
            {"integration": "http", "action": "request", "parameters": {"url": url}},
        )
        assert says in error, error


async def test_http_to_loopback_works_when_the_operator_allows_private_networks(
    start_tools, local_http
):
    tools = await start_tools(tools_allow_private_network=True)
    response = await tools.tool(
        "execute_integration_tool",
        {
            "integration": "http",
            "action": "request",
            "parameters": {"url": f"{local_http}/json", "query": {"q": "1"}},
        },
    )
    assert response.success, response.error
    assert response.millicredits == 200
    from services.common import pb

    result = pb.output_of(response)["result"]
    assert result["status_code"] == 200
    assert result["json"] == {"hello": "world", "authorization": None, "path": "/json?q=1"}


async def test_http_bearer_credential_is_sent_and_never_returned_in_errors(start_tools, local_http):
    tools = await start_tools(tools_allow_private_network=True)
    await tools.create_credential("http", {"token": "tok-very-secret-1234"}, auth_type="bearer")
    output = await tools.ok(
        "execute_integration_tool",
        {"integration": "http", "action": "request", "parameters": {"url": f"{local_http}/json"}},
    )
    # the server got it (its echo is the secret, so it is redacted): an echo never hands the
    # token to the model
    assert output["result"]["json"]["authorization"] == "Bearer ***"
    error = await tools.failed(
        "execute_integration_tool",
        {
            "integration": "http",
            "action": "request",
            "parameters": {"url": "http://127.0.0.1:1/tok-very-secret-1234"},
        },
    )
    assert "tok-very-secret-1234" not in error


async def test_a_json_body_with_nan_or_a_number_past_a_double_comes_back_as_its_text(
    start_tools, local_http
):
    # NaN and 1e400 are not JSON: the body is kept as text, not parsed and written as null
    tools = await start_tools(tools_allow_private_network=True)
    output = await tools.ok(
        "execute_integration_tool",
        {"integration": "http", "action": "request", "parameters": {"url": f"{local_http}/nan"}},
    )
    assert (
        "json" not in output["result"]
        and output["result"]["body"] == '{"ratio": NaN, "big": 1e400, "ok": 1}'
    )


async def test_http_body_is_read_only_up_to_the_cap(start_tools, local_http):
    tools = await start_tools(tools_allow_private_network=True, tools_max_output_bytes=8192)
    output = await tools.ok(
        "execute_integration_tool",
        {"integration": "http", "action": "request", "parameters": {"url": f"{local_http}/big"}},
    )
    assert output["result"]["body_truncated"] is True
    assert len(output["result"]["body"]) <= 8192


async def test_action_that_exceeds_the_time_limit_returns_an_error_within_the_limit(
    start_tools, local_http
):
    tools = await start_tools(tools_allow_private_network=True, tools_timeout_s=0.5)
    started = time.monotonic()
    error = await tools.failed(
        "execute_integration_tool",
        {"integration": "http", "action": "request", "parameters": {"url": f"{local_http}/slow"}},
    )
    elapsed = time.monotonic() - started
    assert "timed out after 0.5 s" in error
    assert elapsed < 2.0


async def test_an_invalid_host_name_is_a_plain_tool_error(tools_service):
    # never "UnicodeError: encoding with 'idna' codec failed"
    for url in ("http://a..com/", "http://" + "a" * 64 + ".com/"):
        error = await tools_service.failed(
            "execute_integration_tool",
            {"integration": "http", "action": "request", "parameters": {"url": url}},
        )
        assert "UnicodeError" not in error and "idna" not in error, error
        assert "invalid URL" in error or "outbound policy" in error, error


def test_ipv6_addresses_that_carry_an_ipv4_address_are_judged_by_it():
    # security: 6to4 2002:7f00:1:: (127.0.0.1 inside) is loopback, not public
    import ipaddress

    from services.tools.netpolicy import classify

    for text, kind in (
        ("2002:7f00:1::", "loopback"),
        ("2002:a01:203::1", "private"),
        ("2002:a9fe:a9fe::", "link-local"),
        ("::ffff:127.0.0.1", "loopback"),
        ("2001:0:4136:e378:8000:63bf:80ff:fffe", "loopback"),
    ):
        assert classify(ipaddress.ip_address(text)) == kind, text
    assert (
        classify(ipaddress.ip_address("2002:5db8:d822::1")) is None
    )  # 93.184.216.34 inside: public
