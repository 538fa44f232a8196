"""A tool output the orchestrator cannot read is the call's error result, never a crash.

An ExecuteTool response that does not decode (grpc.aio gives None) or whose `output_json` is not
JSON ends as UNREADABLE_RESULT and the turn goes on; a tools service that answers with the
`output` Value only (no `output_json`) is read like JSON text. The depth rule itself:
tests/common/test_json_depth.py.
"""

from __future__ import annotations

import types as pytypes
from typing import Any

from loopline.tools.v1 import tools_pb2
from services.common import pb
from services.orchestrator.tool_calls import UNREADABLE_RESULT
from tests.orchestrator.helpers import run_turn, types


def deep(levels: int, leaf: Any = "x") -> Any:
    """`levels` objects nested in one another around `leaf` ({"a": {"a": ... leaf}})."""
    value = leaf
    for _ in range(levels):
        value = {"a": value}
    return value


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
    services, monkeypatch
):
    import services.tools.servicer as tools_server

    # An older tools service (outputs as a protobuf Value) that does not clip answers a Value 60
    # levels deep: the orchestrator's grpc.aio cannot decode it, logs "Exception deserializing
    # message!", gets None.
    _older_tools_service(monkeypatch, tools_server, pb.to_value({"deep": deep(60)}, max_depth=1000))
    tool_input = {"integration": "loopline", "action": "echo", "parameters": {"message": "hi"}}
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
        assert frames[2]["data"]["output"] == {"error": UNREADABLE_RESULT, "success": False}
        assert frames[-1]["data"]["response"] == "ok" and not frames[-1]["data"].get("error")
        assert (await client.get(f"/assistant/chat/{body['chat_id']}")).status_code == 200


async def test_a_tool_output_that_is_not_json_is_the_calls_error_result(services, monkeypatch):
    import services.tools.servicer as tools_server

    broken = pytypes.SimpleNamespace(
        **{name: getattr(pb, name) for name in dir(pb) if not name.startswith("__")}
    )
    broken.json_bytes = lambda data, **_: b"{not json"
    monkeypatch.setattr(tools_server, "pb", broken)
    tool_input = {"integration": "loopline", "action": "echo", "parameters": {"message": "hi"}}
    async with services.client() as client:
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
    services, monkeypatch
):
    """A tools service of the version before `output_json` answers with the `output` Value only:
    the orchestrator converts it once and the frames carry the same JSON (rolling upgrades)."""
    import services.tools.servicer as tools_server

    _older_tools_service(
        monkeypatch, tools_server, pb.to_value({"echoed": {"message": "hi"}, "n": 2})
    )
    tool_input = {"integration": "loopline", "action": "echo", "parameters": {"message": "hi"}}
    async with services.client() as client:
        _, frames = await run_turn(
            client, {"tool": "execute_integration_tool", "input": tool_input}, {"say": "ok"}
        )
    assert frames[2]["data"]["output"] == {"echoed": {"message": "hi"}, "n": 2}
    assert frames[-1]["data"]["tool_calls"][0]["output"] == {"echoed": {"message": "hi"}, "n": 2}
