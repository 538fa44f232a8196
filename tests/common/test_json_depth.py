"""The nesting-depth rule of JSON crossing service boundaries (services/common/pb.py), one
parametrized test per rule over the layers that apply it.

Python protobuf decodes at most 100 message levels, 3 per JSON object level inside a Struct. A
JSON value deeper than pb.MAX_JSON_DEPTH coming into a service is refused with the limit named;
one at the limit passes unchanged; one going out deeper is clipped (its deeper parts become their
JSON text) so that every message still decodes.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from loopline.assistant.v1 import assistant_pb2, events_pb2
from loopline.tools.v1 import tools_pb2
from services.common import pb
from services.orchestrator.models import Message, utcnow
from services.tools.servicer import mcp_tool_pb
from tests.common.layers import Case, Fixtures, at_once, on_services
from tests.conftest import Stack, script
from tests.orchestrator.helpers import run_turn, types
from tests.sse_client import read_frames
from tests.tools.tools_stack import tools_stack

LIMIT_TEXT = f"nested deeper than {pb.MAX_JSON_DEPTH} levels"
DEEP_LEVELS = 60  # what the local HTTP server's /deep serves (tests/tools/conftest.py)


def deep(levels: int, leaf: Any = "x") -> Any:
    """`levels` objects nested in one another around `leaf` ({"a": {"a": ... leaf}})."""
    value = leaf
    for _ in range(levels):
        value = {"a": value}
    return value


def nested_lists(levels: int) -> list:
    """`levels` lists nested in one another ([[[...]]])."""
    value: list = []
    for _ in range(levels - 1):
        value = [value]
    return value


def innermost(value: Any) -> Any:
    """What `deep` wrapped: the value under the last "a"."""
    while isinstance(value, dict):
        value = value["a"]
    return value


# --- Past the limit coming in: refused, naming the limit -----------------------------------


def _refused_by_conversion(convert: Callable[..., Any]) -> Case:
    def check() -> None:
        assert pb.from_struct(pb.to_struct(deep(pb.MAX_JSON_DEPTH))) == deep(pb.MAX_JSON_DEPTH)
        assert pb.from_value(pb.to_value(deep(pb.MAX_JSON_DEPTH))) == deep(pb.MAX_JSON_DEPTH)
        for too_deep in (
            deep(pb.MAX_JSON_DEPTH + 1),
            {"k": nested_lists(pb.MAX_JSON_DEPTH)},
            deep(5000),
        ):
            with pytest.raises(
                pb.JsonTooDeep, match=f"nested deeper than {pb.MAX_JSON_DEPTH} levels"
            ) as raised:
                convert(too_deep)
            assert isinstance(raised.value, ValueError) and raised.value.limit == pb.MAX_JSON_DEPTH
        with pytest.raises(pb.JsonTooDeep, match="deeper than 3 levels"):
            convert(deep(4), max_depth=3)

    return at_once(check)


def _is_depth_400(response) -> bool:
    return response.status_code == 400 and LIMIT_TEXT in response.json()["detail"]


def _credential_metadata_refused(levels: int) -> Case:
    async def check(services: Stack) -> None:
        body = {
            "integration_name": "http",
            "auth_type": "bearer",
            "auth_data": {"token": "t0ken-123"},
            "metadata": deep(levels),
        }
        async with services.client() as client:
            response = await client.post("/credentials", json=body)
            assert _is_depth_400(response), (response.status_code, response.text)
            assert (await client.get("/credentials")).json()["total"] == 0

    return on_services(check)


async def _turn_and_settings_bodies_are_400(services: Stack) -> None:
    async with services.client() as client:
        for path, body in (
            ("/assistant/chat", {"message": "hi", "llm": deep(60)}),
            ("/assistant/chat", {"message": "hi", "extra": deep(pb.MAX_JSON_DEPTH)}),
            ("/knowledge-bases", {"name": "kb", "extra": deep(60)}),
        ):
            response = await client.post(path, json=body)
            assert _is_depth_400(response), (path, response.status_code, response.text)
        put = await client.put("/organizations/settings/composer-llm", json={"llm": deep(60)})
        assert _is_depth_400(put), (put.status_code, put.text)


async def _paused_chat(client) -> tuple[str, str]:
    body, frames = await run_turn(
        client, {"tool": "ask_user_yes_no", "input": {"message": "Proceed?"}}, {"say": "Thanks."}
    )
    assert frames[-1]["type"] == "interrupted", frames
    return body["chat_id"], frames[-1]["data"]["request_id"]


async def _resume_body_is_400_and_the_question_stays_pending(services: Stack) -> None:
    async with services.client() as client:
        chat_id, request_id = await _paused_chat(client)
        url = f"/assistant/chat/{chat_id}/resume"
        for body in (
            {"request_id": request_id, "response": {"kind": "skipped", "reason": deep(60)}},
            {
                "request_id": request_id,
                "response": {"kind": "yes_no", "answer": True},
                "extra": deep(60),
            },
            {
                "request_id": request_id,
                "response": {"kind": "yes_no", "answer": True, "extra": deep(60)},
            },
        ):
            response = await client.post(url, json=body)
            assert _is_depth_400(response), (response.status_code, response.text)
        status = (await client.get(f"/assistant/chat/{chat_id}/status")).json()
        assert status["awaiting_input"] is True and status["pending_request_id"] == request_id
        answered = await client.post(
            url, json={"request_id": request_id, "response": {"kind": "skipped", "reason": "later"}}
        )
        assert answered.status_code == 200, answered.text


def _deep_echo_input(levels: int) -> dict[str, Any]:
    return {
        "integration": "loopline",
        "action": "echo",
        "parameters": {"message": "hi", "deep": deep(levels)},
    }


async def _model_tool_input_is_the_calls_error_result(services: Stack) -> None:
    """The turn goes on and the chat stays readable, now and on the next turn."""
    tool_input = _deep_echo_input(60)
    async with services.client() as client:
        body, frames = await run_turn(
            client, {"tool": "execute_integration_tool", "input": tool_input}, {"say": "ok"}
        )
        assert types(frames) == [
            "metadata",
            "tool_call",
            "tool_result",
            "response_chunk",
            "done",
        ], frames
        call = frames[1]["data"]
        assert call["input"] == pb.clipped(
            tool_input
        )  # a decodable copy: deeper parts as their JSON text
        assert pb.json_depth(call["input"]) == pb.MAX_JSON_DEPTH
        result = frames[2]["data"]["output"]
        assert result["success"] is False
        assert (
            f"nested deeper than {pb.MAX_JSON_DEPTH} levels" in result["error"]
            and "not run" in result["error"]
        )
        done = frames[-1]["data"]
        assert done["response"] == "ok" and not done.get("error")
        assert done["tool_calls"] == [
            {"tool": "execute_integration_tool", "input": call["input"], "output": result}
        ]
        for _ in range(2):  # readable now and on every later read
            chat = await client.get(f"/assistant/chat/{body['chat_id']}")
            assert chat.status_code == 200, chat.text
        messages = chat.json()["messages"]
        assistant = next(m for m in messages if m["role"] == "assistant" and m["thinking"])
        assert assistant["thinking"]["tool_calls"][0]["input"] == call["input"]
        assert next(m for m in messages if m["role"] == "tool")["content"] == result
        # the next turn's model call gets the stored (clipped) thread
        _, again = await run_turn(client, {"say": "still fine"}, chat_id=body["chat_id"])
        assert again[-1]["type"] == "done" and again[-1]["data"]["response"] == "still fine"


REFUSED: dict[str, Case] = {
    "pb.to_struct": _refused_by_conversion(pb.to_struct),
    "pb.to_value": _refused_by_conversion(pb.to_value),
    **{
        f"gateway credential metadata {levels} deep": _credential_metadata_refused(levels)
        for levels in (pb.MAX_JSON_DEPTH, 34, 60)
    },
    "gateway turn and settings bodies": on_services(_turn_and_settings_bodies_are_400),
    "gateway resume body": on_services(_resume_body_is_400_and_the_question_stays_pending),
    "orchestrator model tool input": on_services(_model_tool_input_is_the_calls_error_result),
}


@pytest.mark.parametrize("layer", list(REFUSED))
async def test_json_nested_past_the_limit_coming_in_is_refused_naming_the_limit(layer, fixtures):
    await REFUSED[layer](fixtures)


# --- At the limit: passes unchanged ---------------------------------------------------------


def _round_trip(message: Any) -> Any:
    return type(message).FromString(message.SerializeToString())


def _every_message_decodes_at_its_limit() -> None:
    at_limit = deep(pb.MAX_JSON_DEPTH)
    struct, value = pb.to_struct(at_limit), pb.to_value(at_limit)
    # the wrapping GetChat adds around a stored tool call's input (thinking), MAX_WIRE_DEPTH in all
    thinking = pb.to_struct(
        {"tool_calls": [{"id": "c", "name": "t", "input": at_limit}]}, max_depth=pb.MAX_WIRE_DEPTH
    )
    wire = deep(pb.MAX_WIRE_DEPTH)
    record = events_pb2.ToolCallRecord(
        tool="t",
        input=pb.to_struct(wire, max_depth=pb.MAX_WIRE_DEPTH),
        output=pb.to_value(wire, max_depth=pb.MAX_WIRE_DEPTH),
    )
    messages = [
        assistant_pb2.StreamRunResponse(
            events=[events_pb2.Event(done=events_pb2.DoneEvent(tool_calls=[record]))]
        ),
        assistant_pb2.StreamRunResponse(
            event=events_pb2.Event(tool_call=events_pb2.ToolCallEvent(input=struct))
        ),
        assistant_pb2.StreamRunResponse(
            event=events_pb2.Event(tool_result=events_pb2.ToolResultEvent(output=value))
        ),
        assistant_pb2.StreamRunResponse(
            event=events_pb2.Event(
                user_input_request=events_pb2.UserInputRequestEvent(request=struct)
            )
        ),
        assistant_pb2.GetChatResponse(
            chat=assistant_pb2.Chat(pending_user_input_request=struct),
            messages=[assistant_pb2.ChatMessage(content=value, thinking=thinking)],
        ),
        assistant_pb2.ResumeRequest(response=struct),
        tools_pb2.ExecuteToolRequest(input=struct),
        tools_pb2.ExecuteToolResponse(output=value),
        tools_pb2.CreateCredentialRequest(metadata=struct, auth_data=struct),
        tools_pb2.ListCredentialsResponse(credentials=[tools_pb2.Credential(metadata=struct)]),
        tools_pb2.ListMcpToolsResponse(tools=[tools_pb2.McpTool(input_schema=struct)]),
    ]
    for message in messages:
        assert _round_trip(message) == message


async def _credential_metadata_round_trips(services: Stack) -> None:
    metadata = deep(pb.MAX_JSON_DEPTH - 1)  # the body is one level more: exactly the limit
    async with services.client() as client:
        created = await client.post(
            "/credentials",
            json={
                "integration_name": "http",
                "auth_type": "bearer",
                "auth_data": {"token": "t0ken-123"},
                "metadata": metadata,
            },
        )
        assert created.status_code == 201, created.text
        assert created.json()["credentials_metadata"] == metadata
        listing = await client.get("/credentials")
        assert (
            listing.status_code == 200
            and listing.json()["credentials"][0]["credentials_metadata"] == metadata
        )
        one = await client.get(f"/credentials/{created.json()['credential_id']}")
        assert one.status_code == 200 and one.json()["credentials_metadata"] == metadata


async def _model_tool_input_is_run_and_reads_back_unclipped(services: Stack) -> None:
    tool_input = _deep_echo_input(pb.MAX_JSON_DEPTH - 2)
    assert pb.json_depth(tool_input) == pb.MAX_JSON_DEPTH
    async with services.client() as client:
        body, frames = await run_turn(
            client, {"tool": "execute_integration_tool", "input": tool_input}, {"say": "ok"}
        )
        assert frames[1]["data"]["input"] == tool_input
        error = frames[2]["data"]["output"]["error"]
        assert (
            "nested deeper" not in error and "deep" in error
        )  # the echo action's own schema refuses the field
        chat = await client.get(f"/assistant/chat/{body['chat_id']}")
        assert chat.status_code == 200, chat.text
        assistant = next(
            m for m in chat.json()["messages"] if m["role"] == "assistant" and m["thinking"]
        )
        assert assistant["thinking"]["tool_calls"][0]["input"] == tool_input


AT_THE_LIMIT: dict[str, Case] = {
    "wire messages": at_once(_every_message_decodes_at_its_limit),
    "gateway credential metadata": on_services(_credential_metadata_round_trips),
    "orchestrator model tool input": on_services(_model_tool_input_is_run_and_reads_back_unclipped),
}


@pytest.mark.parametrize("layer", list(AT_THE_LIMIT))
async def test_json_at_the_limit_passes_unchanged(layer, fixtures):
    await AT_THE_LIMIT[layer](fixtures)


# --- Past the limit going out: clipped to decodable -----------------------------------------


def _pb_clips_the_deeper_parts() -> None:
    value = {"keep": [1, {"b": True}], "deep": deep(60, leaf=[1.5, None, "é"])}
    clipped = pb.clipped(value)
    assert pb.json_depth(clipped) == pb.MAX_JSON_DEPTH
    assert pb.from_struct(pb.to_struct(value, clip=True)) == clipped
    assert pb.from_value(pb.to_value(value, clip=True)) == clipped
    assert clipped["keep"] == value["keep"]
    text, kept = clipped["deep"], 0
    while isinstance(text, dict):
        text, kept = text["a"], kept + 1
    assert kept == pb.MAX_JSON_DEPTH - 1  # levels 2 .. MAX_JSON_DEPTH (the value itself is level 1)
    assert json.loads(text) == deep(60 - kept, leaf=[1.5, None, "é"])
    assert pb.clipped(value, 1) == {
        "keep": json.dumps([1, {"b": True}], separators=(",", ":")),
        "deep": json.dumps(value["deep"], separators=(",", ":"), ensure_ascii=False),
    }
    shallow = {"a": [1, 2], "b": "x"}
    assert (
        pb.clipped(shallow) == shallow
        and pb.from_struct(pb.to_struct(shallow, clip=True)) == shallow
    )


async def _http_output(fixtures: Fixtures) -> None:
    start_tools, local_http = fixtures.start_tools, fixtures.local_http
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
    assert json.loads(innermost(page)) == deep(DEEP_LEVELS - kept)


def _mcp_schema_and_stored_credential_metadata() -> None:
    import datetime

    from services.tools.credentials import CredentialInfo
    from services.tools.servicer import credential_pb

    listing = tools_pb2.ListMcpToolsResponse(
        tools=[mcp_tool_pb({"name": "t", "description": "", "input_schema": deep(DEEP_LEVELS)})]
    )
    schema = pb.from_struct(
        tools_pb2.ListMcpToolsResponse.FromString(listing.SerializeToString()).tools[0].input_schema
    )
    assert json.loads(innermost(schema)) == deep(DEEP_LEVELS - pb.MAX_JSON_DEPTH)
    now = datetime.datetime.now(datetime.UTC)
    info = CredentialInfo(
        "c1", "org", "http", "bearer", "d", True, now, now, deep(33), ""
    )  # 33: stored deeper than the limit
    credentials = tools_pb2.ListCredentialsResponse(credentials=[credential_pb(info)])
    metadata = pb.from_struct(
        tools_pb2.ListCredentialsResponse.FromString(credentials.SerializeToString())
        .credentials[0]
        .metadata
    )
    assert json.loads(innermost(metadata)) == deep(33 - pb.MAX_JSON_DEPTH)


async def _a_turn_fetching_deep_json(fixtures: Fixtures) -> None:
    """The turn goes on and the chat stays readable."""
    tmp_path, local_http = fixtures.tmp_path, fixtures.local_http
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


async def _stored_chat_reads_clipped(services: Stack) -> None:
    """A chat whose rows hold JSON deeper than the limit (written directly) reads clipped."""
    async with services.client() as client:
        body, _ = await run_turn(client, {"say": "hello"})
        chat_id = body["chat_id"]
        too_deep = deep(60)
        async with services.orchestrator.servicer.sessions() as session, session.begin():
            session.add(
                Message(
                    id=str(uuid.uuid4()),
                    chat_id=chat_id,
                    run_id=body["run_id"],
                    role="assistant",
                    content="",
                    extra={
                        "tool_calls": [
                            {"id": "call_1", "name": "execute_integration_tool", "input": too_deep}
                        ]
                    },
                    created_at=utcnow(),
                )
            )
            session.add(
                Message(
                    id=str(uuid.uuid4()),
                    chat_id=chat_id,
                    run_id=body["run_id"],
                    role="tool",
                    content=too_deep,
                    extra={"tool_call_id": "call_1", "name": "execute_integration_tool"},
                    created_at=utcnow(),
                )
            )
        chat = await client.get(f"/assistant/chat/{chat_id}")
        assert chat.status_code == 200, chat.text
        messages = chat.json()["messages"]
        assert messages[-1]["content"] == pb.clipped(too_deep)
        stored_input = messages[-2]["thinking"]["tool_calls"][0]["input"]
        assert stored_input == pb.clipped(too_deep, pb.MAX_WIRE_DEPTH - 3)
        text = stored_input
        while isinstance(text, dict):
            text = text["a"]
        assert json.loads(text) == deep(60 - (pb.MAX_WIRE_DEPTH - 3))


CLIPPED: dict[str, Case] = {
    "pb.clipped": at_once(_pb_clips_the_deeper_parts),
    "tools http output": _http_output,
    "tools MCP schema and stored credential metadata": at_once(
        _mcp_schema_and_stored_credential_metadata
    ),
    "a turn fetching deep JSON": _a_turn_fetching_deep_json,
    "orchestrator stored chat": on_services(_stored_chat_reads_clipped),
}


@pytest.mark.parametrize("layer", list(CLIPPED))
async def test_json_nested_past_the_limit_going_out_is_clipped_to_its_json_text(layer, fixtures):
    await CLIPPED[layer](fixtures)
