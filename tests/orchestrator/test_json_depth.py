"""Tool input and output nested past protobuf's decode limit never crash a turn or a chat.

Python protobuf decodes at most 100 message levels (3 per JSON level in a Struct): a model's
tool input 60 levels deep crashed the loop ("Internal error while running the turn.") and left
a stored thread GetChat could not encode for the gateway to decode (every GET of the chat 500,
forever); an ExecuteTool response the orchestrator could not decode (grpc.aio gives None)
crashed it with AttributeError. The rule: services/common/pb.py.
"""

from __future__ import annotations

import json
import types as pytypes
import uuid
from typing import Any

from loopline.tools.v1 import tools_pb2
from services.common import pb
from services.orchestrator.models import Message, utcnow
from services.orchestrator.tool_calls import UNREADABLE_RESULT
from tests.orchestrator.helpers import run_turn, types


def deep(levels: int, leaf: Any = "x") -> Any:
    """`levels` objects nested in one another around `leaf` ({"a": {"a": ... leaf}})."""
    value = leaf
    for _ in range(levels):
        value = {"a": value}
    return value


def _deep_echo_input(levels: int) -> dict[str, Any]:
    return {
        "integration": "loopline",
        "action": "echo",
        "parameters": {"message": "hi", "deep": deep(levels)},
    }


async def test_tool_input_nested_too_deep_is_the_calls_error_result_and_the_turn_goes_on(stack):
    tool_input = _deep_echo_input(60)
    async with stack.client() as client:
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
        for _ in range(2):  # readable now and later (it was 500 on every read)
            chat = await client.get(f"/assistant/chat/{body['chat_id']}")
            assert chat.status_code == 200, chat.text
        messages = chat.json()["messages"]
        assistant = next(m for m in messages if m["role"] == "assistant" and m["thinking"])
        assert assistant["thinking"]["tool_calls"][0]["input"] == call["input"]
        assert next(m for m in messages if m["role"] == "tool")["content"] == result
        # the next turn's model call gets the stored (clipped) thread
        _, again = await run_turn(client, {"say": "still fine"}, chat_id=body["chat_id"])
        assert again[-1]["type"] == "done" and again[-1]["data"]["response"] == "still fine"


async def test_tool_input_at_the_limit_is_run_and_the_chat_reads_back_unclipped(stack):
    # the input is the limit deep: {"integration", "action", "parameters": {"message", "deep": ...}}
    tool_input = _deep_echo_input(pb.MAX_JSON_DEPTH - 2)
    assert pb.json_depth(tool_input) == pb.MAX_JSON_DEPTH
    async with stack.client() as client:
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


async def test_a_chat_stored_with_too_deep_json_before_the_rule_reads_clipped(stack):
    async with stack.client() as client:
        body, _ = await run_turn(client, {"say": "hello"})
        chat_id = body["chat_id"]
        too_deep = deep(60)
        async with stack.orchestrator.servicer.sessions() as session, session.begin():
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


def _older_tools_service(monkeypatch: Any, tools_server: Any, output: Any) -> None:
    """Make the tools service answer as the version before `output_json` did: every successful
    call's output is `output` (a protobuf Value) and `output_json` is unset."""
    older = pytypes.SimpleNamespace(
        **{name: getattr(pb, name) for name in dir(pb) if not name.startswith("__")}
    )
    older.json_bytes = lambda data, **_: b""  # no output_json: the reader takes `output`

    def older_response(**fields: Any) -> tools_pb2.ExecuteToolResponse:
        response = tools_pb2.ExecuteToolResponse(**fields)
        response.output.CopyFrom(output)
        return response

    monkeypatch.setattr(tools_server, "pb", older)
    monkeypatch.setattr(
        tools_server, "tools_pb2", pytypes.SimpleNamespace(ExecuteToolResponse=older_response)
    )


async def test_an_execute_tool_response_that_cannot_be_decoded_is_the_calls_error_result(
    stack, monkeypatch
):
    import services.tools.servicer as tools_server

    # An older tools service (outputs as a protobuf Value) that does not clip answers a Value 60
    # levels deep: the orchestrator's grpc.aio cannot decode it, logs "Exception deserializing
    # message!", gets None.
    _older_tools_service(monkeypatch, tools_server, pb.to_value({"deep": deep(60)}, max_depth=1000))
    tool_input = {"integration": "loopline", "action": "echo", "parameters": {"message": "hi"}}
    async with stack.client() as client:
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
        assert frames[2]["data"]["output"] == {"error": UNREADABLE_RESULT, "success": False}
        assert frames[-1]["data"]["response"] == "ok" and not frames[-1]["data"].get("error")
        assert (await client.get(f"/assistant/chat/{body['chat_id']}")).status_code == 200


def deep_text(levels: int, leaf: str = '"x"') -> str:
    """The JSON text of `levels` objects nested around `leaf`, built as text (json.dumps
    recurses)."""
    return '{"a": ' * levels + leaf + "}" * levels


async def test_a_script_whose_tool_input_is_too_deep_for_json_loads_gives_the_calls_error_result(
    stack,
):
    # json.loads raises RecursionError on such a script (the scripted model's stack is deep);
    # 990 levels must end like 30-200 do, not as "Internal error while running the turn."
    message = (
        '{"script": [{"tool": "execute_integration_tool", "input": {"integration": "loopline", '
        '"action": "echo", "parameters": {"message": "hi", "deep": '
        + deep_text(990)
        + '}}}, {"say": "ok"}]}'
    )
    async with stack.client() as client:
        body, frames = await run_turn_message(client, message)
        assert types(frames) == [
            "metadata",
            "tool_call",
            "tool_result",
            "response_chunk",
            "done",
        ], frames
        call, result = frames[1]["data"], frames[2]["data"]["output"]
        assert pb.json_depth(call["input"]) == pb.MAX_JSON_DEPTH
        assert result["success"] is False and result["error"].startswith(
            "Invalid input for execute_integration_tool"
        )
        assert f"nested deeper than {pb.MAX_JSON_DEPTH} levels" in result["error"]
        assert frames[-1]["data"]["response"] == "ok" and not frames[-1]["data"].get("error")
        chat = await client.get(f"/assistant/chat/{body['chat_id']}")
        assert chat.status_code == 200, chat.text


async def run_turn_message(client, message: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A turn whose user message is `message` as given (a script too deep for json.dumps)."""
    from tests.orchestrator.helpers import start
    from tests.sse_client import read_frames

    body = await start(client, message=message)
    return body, await read_frames(client, body["stream_url"])


async def test_a_tool_output_that_is_not_json_is_the_calls_error_result(stack, monkeypatch):
    import services.tools.servicer as tools_server

    broken = pytypes.SimpleNamespace(
        **{name: getattr(pb, name) for name in dir(pb) if not name.startswith("__")}
    )
    broken.json_bytes = lambda data, **_: b"{not json"
    monkeypatch.setattr(tools_server, "pb", broken)
    tool_input = {"integration": "loopline", "action": "echo", "parameters": {"message": "hi"}}
    async with stack.client() as client:
        body, frames = await run_turn(
            client, {"tool": "execute_integration_tool", "input": tool_input}, {"say": "ok"}
        )
    assert types(frames) == ["metadata", "tool_call", "tool_result", "response_chunk", "done"], (
        frames
    )
    assert frames[2]["data"]["output"] == {"error": UNREADABLE_RESULT, "success": False}
    assert frames[-1]["data"]["tool_calls"][0]["output"] == {
        "error": UNREADABLE_RESULT,
        "success": False,
    }


async def test_an_older_tools_services_output_value_is_read_and_streamed_like_json_text(
    stack, monkeypatch
):
    """A tools service of the version before `output_json` answers with the `output` Value only:
    the orchestrator converts it once and the frames carry the same JSON (rolling upgrades)."""
    import services.tools.servicer as tools_server

    _older_tools_service(
        monkeypatch, tools_server, pb.to_value({"echoed": {"message": "hi"}, "n": 2})
    )
    tool_input = {"integration": "loopline", "action": "echo", "parameters": {"message": "hi"}}
    async with stack.client() as client:
        _, frames = await run_turn(
            client, {"tool": "execute_integration_tool", "input": tool_input}, {"say": "ok"}
        )
    assert frames[2]["data"]["output"] == {"echoed": {"message": "hi"}, "n": 2}
    assert frames[-1]["data"]["tool_calls"][0]["output"] == {"echoed": {"message": "hi"}, "n": 2}
