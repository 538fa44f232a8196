"""A tool gets the model's numbers exactly. A protobuf Struct holds every number as a double,
so an id past 2^53 would reach the tool changed (9007199254740993 as 9007199254740992.0: a
wrong id sent to an API) and 1.0 as 1: `ExecuteToolRequest.input_json` carries the model's
JSON, and the output comes back as JSON text."""

from __future__ import annotations

import pytest

from loopline.tools.v1 import tools_pb2
from services.common import pb
from services.common.errors import RpcError
from services.tools.request_checks import tool_input
from tests.orchestrator.helpers import run_turn, types


async def test_a_tool_gets_the_models_integers_past_2_53_and_floats_exactly(services, monkeypatch):
    executor = services.tools.servicer.executor
    received: list[dict] = []
    original = executor.execute

    async def recording(org_id, tool, args):  # noqa: ANN001, ANN202
        received.append(args)
        return await original(org_id, tool, args)

    monkeypatch.setattr(executor, "execute", recording)
    parameters = {"id": 9007199254740993, "u64": 18446744073709551615, "ratio": 1.0, "neg": -0.5}
    tool_input = {"integration": "loopline", "action": "echo", "parameters": parameters}
    async with services.client() as client:
        _, frames = await run_turn(
            client, {"tool": "execute_integration_tool", "input": tool_input}, {"say": "ok"}
        )
    assert "done" in types(frames)
    assert received[0]["parameters"] == parameters
    assert isinstance(received[0]["parameters"]["id"], int) and isinstance(
        received[0]["parameters"]["ratio"], float
    )


def test_a_server_takes_input_json_when_it_is_set_else_the_struct():
    struct = pb.to_struct({"a": 1})
    assert tool_input(
        tools_pb2.ExecuteToolRequest(input=struct, input_json=b'{"a": 9007199254740993}')
    ) == {"a": 9007199254740993}
    assert tool_input(tools_pb2.ExecuteToolRequest(input=struct)) == {
        "a": 1
    }  # a client of the older version
    for bad in (b"[1]", b"{nope"):  # set but not an object: refused, never replaced by the Struct
        with pytest.raises(RpcError) as refused:
            tool_input(tools_pb2.ExecuteToolRequest(input=struct, input_json=bad))
        assert refused.value.reason == "INVALID_INPUT_JSON"


async def test_the_tool_call_frames_show_the_models_input_exactly_and_in_its_key_order(services):
    # not as a Struct would give it (keys sorted, an integer past 2^53 rounded, 1.0 as 1)
    parameters = {"zeta": 9007199254740993, "alpha": 1.0, "mid": [1, 2.5]}
    tool_input = {"integration": "loopline", "action": "echo", "parameters": parameters}
    async with services.client() as client:
        _, frames = await run_turn(
            client, {"tool": "execute_integration_tool", "input": tool_input}, {"say": "ok"}
        )
    shown = [
        next(f for f in frames if f["type"] == "tool_call")["data"]["input"],
        frames[-1]["data"]["tool_calls"][0]["input"],
    ]
    for seen in shown:
        assert seen == tool_input and list(seen) == ["integration", "action", "parameters"]
        assert list(seen["parameters"]) == ["zeta", "alpha", "mid"] and isinstance(
            seen["parameters"]["alpha"], float
        )
