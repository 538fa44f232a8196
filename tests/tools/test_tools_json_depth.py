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
from services.tools.server import mcp_tool_pb
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


async def test_http_json_nested_too_deep_arrives_with_its_deep_part_as_json_text(start_tools, local_http):
    tools = await start_tools(tools_allow_private_network=True)
    response = await tools.tool(
        "execute_integration_tool", {"integration": "http", "action": "request", "parameters": {"url": f"{local_http}/deep"}}
    )
    assert isinstance(response, tools_pb2.ExecuteToolResponse), "the response could not be decoded"
    assert response.success, response.error
    output = pb.from_value(response.output)
    assert pb.json_depth(output) == pb.MAX_JSON_DEPTH
    page = output["result"]["json"]  # output -> result -> json: 2 levels above the page
    kept = pb.MAX_JSON_DEPTH - 2
    assert json.loads(_innermost(page)) == deep(DEEP_LEVELS - kept)


async def test_http_json_too_deep_for_json_loads_comes_back_as_text(start_tools, local_http):
    tools = await start_tools(tools_allow_private_network=True)
    result = await tools.ok(
        "execute_integration_tool", {"integration": "http", "action": "request", "parameters": {"url": f"{local_http}/deeper"}}
    )
    assert "json" not in result["result"] and result["result"]["body"].startswith("[[[")


async def test_a_turn_fetching_deep_json_goes_on_and_the_chat_stays_readable(tmp_path, local_http):
    tool_input = {"integration": "http", "action": "request", "parameters": {"url": f"{local_http}/deep"}}
    async with tools_stack(tmp_path) as stack, stack.client() as client:
        started = await client.post("/assistant/chat", json={"message": script({"tool": "execute_integration_tool", "input": tool_input}, {"say": "ok"})})
        assert started.status_code == 200, started.text
        frames = await read_frames(client, started.json()["stream_url"])
        assert [f["type"] for f in frames] == ["metadata", "tool_call", "tool_result", "response_chunk", "done"], frames
        output = frames[2]["data"]["output"]
        assert output["result"]["status_code"] == 200 and pb.json_depth(output) == pb.MAX_JSON_DEPTH
        assert frames[-1]["data"]["response"] == "ok"
        chat = await client.get(f"/assistant/chat/{started.json()['chat_id']}")
        assert chat.status_code == 200, chat.text
        assert next(m for m in chat.json()["messages"] if m["role"] == "tool")["content"] == output


def test_an_mcp_servers_deep_schema_and_stored_deep_metadata_still_decode():
    import datetime

    from services.tools.credentials import CredentialInfo
    from services.tools.server import credential_pb

    listing = tools_pb2.ListMcpToolsResponse(tools=[mcp_tool_pb({"name": "t", "description": "", "input_schema": deep(DEEP_LEVELS)})])
    schema = pb.from_struct(tools_pb2.ListMcpToolsResponse.FromString(listing.SerializeToString()).tools[0].input_schema)
    assert json.loads(_innermost(schema)) == deep(DEEP_LEVELS - pb.MAX_JSON_DEPTH)
    now = datetime.datetime.now(datetime.UTC)
    info = CredentialInfo("c1", "org", "http", "bearer", "d", True, now, now, deep(33), "")  # 33: accepted before the rule
    credentials = tools_pb2.ListCredentialsResponse(credentials=[credential_pb(info)])
    metadata = pb.from_struct(tools_pb2.ListCredentialsResponse.FromString(credentials.SerializeToString()).credentials[0].metadata)
    assert json.loads(_innermost(metadata)) == deep(33 - pb.MAX_JSON_DEPTH)
