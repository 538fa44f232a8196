"""A model's tool-call arguments nested past what json.loads parses never crash the run.

json.loads raises RecursionError at about 1,000 levels; the OpenAI and Anthropic adapters parse
a tool call's `arguments` / `input_json_delta` text with it, so arguments nested 5,000 deep
crashed the loop ("Internal error while running the turn."). They are now read by
`base.loads_deep`: the call's input is deeper than the depth rule (services/common/pb.py), so
the loop gives it its usual "Invalid input … nested deeper than 29 levels" error result.
"""

from __future__ import annotations

import json

import pytest

from services.common import pb
from services.orchestrator.providers.anthropic_provider import AnthropicModel
from services.orchestrator.providers.base import DEEP_JSON_KEPT_LEVELS, loads_deep, parse_arguments
from services.orchestrator.providers.openai_compat import OpenAICompatModel
from services.orchestrator.providers.retry import RetryPolicy
from services.orchestrator.tool_calls import checked_call
from tests.orchestrator.helpers import types
from tests.providers.fakes import (
    FakeLLMServer,
    Reply,
    anthropic_end,
    anthropic_start,
    anthropic_tool_block,
    openai_text,
    openai_tool_call,
    openai_turn,
)

FAST = RetryPolicy(max_retries=0, base_delay_s=0.01, max_delay_s=1.0)
TOOLS = [
    {
        "name": "get_available_integrations",
        "description": "List integrations.",
        "input_schema": {"type": "object", "properties": {}},
    }
]
USER = [{"role": "user", "content": "hello"}]
LEVELS = 5000


def deep_text(levels: int, leaf: str = '"x"') -> str:
    """The JSON text of `levels` objects nested around `leaf` ({"a": {"a": ... leaf}}), built as
    text."""
    return '{"a": ' * levels + leaf + "}" * levels


async def _noop(_chunk: str) -> None:
    return None


def _check_too_deep_input(value: dict) -> None:
    """`value` is the deep arguments read back: real objects to DEEP_JSON_KEPT_LEVELS, then the
    rest as JSON text."""
    assert pb.json_depth(value) == DEEP_JSON_KEPT_LEVELS
    inner = value
    for _ in range(DEEP_JSON_KEPT_LEVELS - 1):
        inner = inner["a"]
    assert inner["a"] == deep_text(LEVELS - DEEP_JSON_KEPT_LEVELS)


def test_loads_deep_reads_json_too_deep_for_json_loads_and_refuses_what_is_not_json():
    with pytest.raises(RecursionError):
        json.loads(deep_text(LEVELS))
    _check_too_deep_input(loads_deep(deep_text(LEVELS)))
    text = (
        '{"s": "[[[{{{", "n": [1, 2.5, null, true], "deep": '
        + deep_text(LEVELS, '"br]ack\\"et}"')
        + "}"
    )
    value = loads_deep(text)
    assert value["s"] == "[[[{{{" and value["n"] == [
        1,
        2.5,
        None,
        True,
    ]  # brackets inside strings do not count
    inner = value["deep"]
    while isinstance(inner, dict):
        inner = inner["a"]
    assert inner == deep_text(LEVELS - DEEP_JSON_KEPT_LEVELS + 1, '"br]ack\\"et}"')
    assert loads_deep('{"a": [1, {"b": "c"}]}') == {"a": [1, {"b": "c"}]}
    for not_json in ("[" * LEVELS, "[" * LEVELS + '"open', deep_text(LEVELS)[:-1], '{"a": 1', "]]"):
        with pytest.raises(ValueError):
            loads_deep(not_json)


def test_arguments_too_deep_for_json_loads_are_the_calls_error_result_not_a_crash():
    value, unreadable = parse_arguments(deep_text(LEVELS))
    assert unreadable == ""
    _check_too_deep_input(value)
    from services.orchestrator.providers.base import ToolCallRequest

    call, struct, error = checked_call(
        ToolCallRequest(id="call_1", name="get_available_integrations", input=value)
    )
    assert error is not None and f"nested deeper than {pb.MAX_JSON_DEPTH} levels" in error
    assert pb.json_depth(call.input) == pb.MAX_JSON_DEPTH and pb.from_struct(struct) == call.input


async def test_openai_tool_call_arguments_nested_5000_deep():
    events = openai_tool_call("get_available_integrations", deep_text(LEVELS), splits=3)
    async with FakeLLMServer([Reply(events=events)]) as server:
        model = OpenAICompatModel(
            "openai",
            "gpt-test",
            base_url=f"{server.url}/v1",
            api_key="sk-test-SECRET123456",
            policy=FAST,
            timeout_s=5,
        )
        reply = await model.generate(USER, TOOLS, _noop)
    assert [c.name for c in reply.tool_calls] == ["get_available_integrations"]
    _check_too_deep_input(reply.tool_calls[0].input)


async def test_anthropic_tool_use_input_nested_5000_deep():
    events = [
        anthropic_start(),
        *anthropic_tool_block(0, "get_available_integrations", deep_text(LEVELS)),
        *anthropic_end(12, "tool_use"),
    ]
    async with FakeLLMServer([Reply(events=events)]) as server:
        model = AnthropicModel(
            "claude-test",
            base_url=server.url,
            api_key="sk-ant-api03-SECRET123456",
            policy=FAST,
            max_tokens=256,
            timeout_s=5,
        )
        reply = await model.generate(USER, TOOLS, _noop)
    assert [c.name for c in reply.tool_calls] == ["get_available_integrations"]
    _check_too_deep_input(reply.tool_calls[0].input)


async def test_a_turn_whose_model_sends_arguments_5000_deep_goes_on_with_the_calls_error_result(
    tmp_path,
):
    replies = [
        Reply(
            events=openai_tool_call(
                "get_available_integrations", deep_text(LEVELS), call_id="call_deep"
            )
        ),
        Reply(events=openai_text("Sorry, ", "flatter next time.")),
    ]
    frames, server = await openai_turn(tmp_path, replies, "Which integrations?")
    assert types(frames) == [
        "metadata",
        "tool_call",
        "tool_result",
        "response_chunk",
        "response_chunk",
        "done",
    ], frames
    assert pb.json_depth(frames[1]["data"]["input"]) == pb.MAX_JSON_DEPTH
    output = frames[2]["data"]["output"]
    assert (
        output["success"] is False
        and f"nested deeper than {pb.MAX_JSON_DEPTH} levels" in output["error"]
    )
    assert frames[-1]["data"]["response"] == "Sorry, flatter next time." and not frames[-1][
        "data"
    ].get("error")
    tool = next(m for m in server.requests[1].body["messages"] if m["role"] == "tool")
    assert tool["tool_call_id"] == "call_deep" and "nested deeper" in tool["content"]
