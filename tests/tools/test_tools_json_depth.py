"""Tool outputs nested past protobuf's decode limit arrive clipped and decodable (tester).

The `http` integration fetching a page of JSON 60 levels deep built an ExecuteTool response the
orchestrator could not decode (Python protobuf decodes at most 100 message levels, 3 per JSON
level in a Struct): grpc.aio logged "Exception deserializing message!", gave None, and the
turn crashed. The tools service now clips every output (services/common/pb.py, `clip=True`).
"""

from __future__ import annotations

import json
from typing import Any

from loopline.tools.v1 import tools_pb2
from services.common import pb
from services.tools.servicer import mcp_tool_pb
from tests.conftest import script
from tests.sse_client import read_frames
from tests.tools.tools_stack import tools_stack

DEEP_LEVELS = 60  # what the local server's /deep serves (tests/tools/conftest.py)


def deep(levels: int, leaf: Any = "x") -> Any:
    """`levels` objects nested in one another around `leaf` ({"a": {"a": ... leaf}})."""
    value = leaf
    for _ in range(levels):
        value = {"a": value}
    return value


def _innermost(value: Any) -> Any:
    while isinstance(value, dict):
        value = value["a"]
    return value


async def test_http_json_nested_too_deep_arrives_with_its_deep_part_as_json_text(
    start_tools, local_http
):
    tools = await start_tools(tools_allow_private_network=True)
    response = await tools.tool(
        "execute_integration_tool",
        {"integration": "http", "action": "request", "parameters": {"url": f"{local_http}/deep"}},
    )
    assert isinstance(response, tools_pb2.ExecuteToolResponse), "the response could not be decoded"
    assert response.success, response.error
    output = pb.output_of(response)
    assert pb.json_depth(output) == pb.MAX_JSON_DEPTH
    page = output["result"]["json"]  # output -> result -> json: 2 levels above the page
    kept = pb.MAX_JSON_DEPTH - 2
    assert json.loads(_innermost(page)) == deep(DEEP_LEVELS - kept)


async def test_http_json_too_deep_for_json_loads_comes_back_as_text(start_tools, local_http):
    tools = await start_tools(tools_allow_private_network=True)
    result = await tools.ok(
        "execute_integration_tool",
        {"integration": "http", "action": "request", "parameters": {"url": f"{local_http}/deeper"}},
    )
    assert "json" not in result["result"] and result["result"]["body"].startswith("[[[")


async def test_a_turn_fetching_deep_json_goes_on_and_the_chat_stays_readable(tmp_path, local_http):
    tool_input = {
        "integration": "http",
        "action": "request",
        "parameters": {"url": f"{local_http}/deep"},
    }
    async with tools_stack(tmp_path) as stack, stack.client() as client:
        started = await client.post(
            "/assistant/chat",
            json={
                "message": script(
                    {"tool": "execute_integration_tool", "input": tool_input}, {"say": "ok"}
                )
            },
        )
        assert started.status_code == 200, started.text
        frames = await read_frames(client, started.json()["stream_url"])
        assert [f["type"] for f in frames] == [
            "metadata",
            "tool_call",
            "tool_result",
            "response_chunk",
            "done",
        ], frames
        output = frames[2]["data"]["output"]
        assert output["result"]["status_code"] == 200 and pb.json_depth(output) == pb.MAX_JSON_DEPTH
        assert frames[-1]["data"]["response"] == "ok"
        chat = await client.get(f"/assistant/chat/{started.json()['chat_id']}")
        assert chat.status_code == 200, chat.text
        assert next(m for m in chat.json()["messages"] if m["role"] == "tool")["content"] == output


def test_an_mcp_servers_deep_schema_and_stored_deep_metadata_still_decode():
    import datetime

    from services.tools.credentials import CredentialInfo
    from services.tools.servicer import credential_pb

    listing = tools_pb2.ListMcpToolsResponse(
        tools=[mcp_tool_pb({"name": "t", "description": "", "input_schema": deep(DEEP_LEVELS)})]
    )
    schema = pb.from_struct(
        tools_pb2.ListMcpToolsResponse.FromString(listing.SerializeToString()).tools[0].input_schema
    )
    assert json.loads(_innermost(schema)) == deep(DEEP_LEVELS - pb.MAX_JSON_DEPTH)
    now = datetime.datetime.now(datetime.UTC)
    info = CredentialInfo(
        "c1", "org", "http", "bearer", "d", True, now, now, deep(33), ""
    )  # 33: accepted before the rule
    credentials = tools_pb2.ListCredentialsResponse(credentials=[credential_pb(info)])
    metadata = pb.from_struct(
        tools_pb2.ListCredentialsResponse.FromString(credentials.SerializeToString())
        .credentials[0]
        .metadata
    )
    assert json.loads(_innermost(metadata)) == deep(33 - pb.MAX_JSON_DEPTH)


def deep_json_text(levels: int, leaf: str) -> str:
    """`levels` arrays nested around the JSON text `leaf`, built as text (json.dumps recurses)."""
    return "[" * levels + leaf + "]" * levels


def test_a_json_document_too_deep_for_json_loads_is_extracted_as_its_text():
    from services.tools.extract import ExtractionError, extract_text

    assert (
        extract_text(deep_json_text(500, '"zeppelin"').encode(), "json").count("zeppelin") == 1
    )  # re-indented as before
    raw = deep_json_text(5000, '{"note": "zeppelin airship"}')
    assert extract_text(raw.encode(), "json") == raw  # was RecursionError: "unhandled error", 500
    try:
        extract_text(b'{"a": [1, 2', "json")
        raise AssertionError("not JSON must stay an ExtractionError")
    except ExtractionError as exc:
        assert "does not parse" in str(exc)


async def test_uploading_a_json_document_nested_1000_deep_is_indexed_as_its_text(tmp_path):
    # tester: `['*1000 + '1' + ']'*1000` uploaded to a knowledge base was a 500 (tools: unhandled
    # RecursionError)
    async with tools_stack(tmp_path) as stack, stack.client() as client:
        kb = (
            await client.post("/knowledge-bases", json={"name": "Deep", "description": "deep json"})
        ).json()
        for levels in (1000, 5000):
            data = deep_json_text(levels, f'{{"word": "zeppelin{levels}"}}').encode()
            response = await client.post(
                f"/knowledge-bases/{kb['id']}/documents",
                files={"file": ("deep.json", data, "application/json")},
            )
            assert response.status_code == 201, (levels, response.status_code, response.text)
            assert response.json()["status"] == "completed" and response.json()["chunk_count"] >= 1
            found = (
                await client.post(
                    f"/knowledge-bases/{kb['id']}/search", json={"query": f"zeppelin{levels}"}
                )
            ).json()
            assert (
                found["total_matches"] >= 1
                and found["matches"][0]["document_id"] == response.json()["id"]
            ), found


async def test_oauth2_api_and_token_responses_too_deep_for_json_loads(monkeypatch, start_tools):
    """An OAuth2 API's body nested past json.loads comes back as text (as the http integration's); a
    token endpoint answering such JSON is "did not issue a token", not an unhandled
    RecursionError."""
    import grpc
    import httpx

    from services.common.errors import status_details
    from services.tools.catalogue import ActionContext
    from services.tools.oauth import OAuth2Provider, integration_of

    body = deep_json_text(5000, '"x"')
    real = httpx.AsyncClient
    monkeypatch.setattr(
        httpx,
        "AsyncClient",
        lambda **kw: real(
            transport=httpx.MockTransport(
                lambda request: httpx.Response(
                    200, text=body, headers={"Content-Type": "application/json"}
                )
            ),
            **kw,
        ),
    )
    provider = OAuth2Provider(
        name="acme",
        display_name="Acme",
        description="",
        authorize_url="http://auth.test/authorize",
        token_url="http://auth.test/token",
        client_id="c",
        client_secret="",
        scope="",
        api_base_url="http://api.test/api",
    )
    context = ActionContext(
        secret={"access_token": "at-secret"},
        auth_type="oauth2",
        timeout_s=5,
        max_output_bytes=100_000,
        allow_private_network=False,
    )
    assert await integration_of(provider, 5).actions["api_request"].handler(
        context, {"path": "/me"}
    ) == {"status": 200, "body": body}

    tools = await start_tools(
        tools_oauth2_integrations=json.dumps(
            [
                {
                    "name": "acme",
                    "authorize_url": "https://auth.example/authorize",
                    "token_url": "https://auth.example/token",
                    "client_id": "loopline-client",
                    "api_base_url": "https://api.example",
                }
            ]
        )
    )
    started = await tools.stub.InitiateOAuth2(
        tools_pb2.InitiateOAuth2Request(
            organization_id="org-a",
            integration_name="acme",
            redirect_uri="https://app.example/callback",
        )
    )
    try:
        await tools.stub.CompleteOAuth2(
            tools_pb2.CompleteOAuth2Request(state=started.state, code="code-1")
        )
        raise AssertionError("no token was issued")
    except grpc.aio.AioRpcError as error:
        details = status_details(error)
        assert (details.code, details.reason) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "OAUTH2_EXCHANGE_FAILED",
        ), details
        assert "status 200" in details.message
