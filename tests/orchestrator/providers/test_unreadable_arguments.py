"""A tool call whose arguments are not a JSON object is answered with an error, never run.

Invalid or non-object arguments (`[1, 2]`, `"text"`, `{"a": 1` cut off) are not run as `{}`
(`get_available_integrations` would list everything, a question tool ask nothing useful): the
call keeps the input `{}` in its frame and thread (the spec's `input` is an object) and its
result is an error that names the reason, as LangChain answers its `invalid_tool_calls`; the
model sees it and the turn goes on.
"""

from __future__ import annotations

import json

import pytest

from services.orchestrator.providers.base import (
    NOT_FINITE,
    ToolCallRequest,
    arguments_of,
    parse_arguments,
)
from services.orchestrator.providers.openai_compat import OpenAICompatModel
from services.orchestrator.providers.retry import RetryPolicy
from services.orchestrator.providers.scripted import ScriptedModel
from services.orchestrator.tool_calls import checked_call
from tests.orchestrator.helpers import run_turn, types
from tests.orchestrator.providers.fakes import (
    OPENAI_DONE,
    FakeLLMServer,
    Reply,
    openai_chunk,
    openai_text,
    openai_tool_call,
    openai_turn,
)
from tests.sse_client import read_frames

FAST = RetryPolicy(max_retries=0, base_delay_s=0.01, max_delay_s=1.0)
TOOLS = [
    {
        "name": "get_available_integrations",
        "description": "List integrations.",
        "input_schema": {"type": "object", "properties": {}},
    }
]


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("[1, 2]", "the arguments are an array, not a JSON object"),
        ('"all of them"', "the arguments are a string, not a JSON object"),
        ("42", "the arguments are a number, not a JSON object"),
        ("true", "the arguments are a boolean, not a JSON object"),
        ('{"category": "database"', "the arguments are not valid JSON"),
        ("not json", "the arguments are not valid JSON"),
    ],
)
def test_arguments_that_are_not_an_object_are_read_as_empty_with_the_reason(raw, reason):
    assert parse_arguments(raw) == ({}, reason)


@pytest.mark.parametrize(
    "raw",
    [
        '{"x": NaN}',
        '{"x": Infinity}',
        '{"a": [1, {"b": -Infinity}]}',
        '{"x": 1e400}',
        '{"x": -1e400}',
    ],
)
def test_arguments_holding_a_number_json_cannot_carry_are_unreadable(raw):
    # json reads these as non-finite floats; stored, they would make GET chat 500 for good on
    # SQLite and fail the run's end on PostgreSQL (its answer lost from the thread)
    assert parse_arguments(raw) == ({}, NOT_FINITE)
    assert arguments_of({"x": [1.5, {"y": 2}], "ok": 1e308}) == (
        {"x": [1.5, {"y": 2}], "ok": 1e308},
        "",
    )


@pytest.mark.parametrize("raw", ["", "  ", "{}", '{"category": "database"}', "null"])
def test_empty_text_null_and_objects_are_readable(raw):
    value, reason = parse_arguments(raw)
    assert reason == "" and value == ({"category": "database"} if "database" in raw else {})


def test_checked_call_answers_an_unreadable_call_without_running_it():
    call, struct, error = checked_call(
        ToolCallRequest("call_1", "get_available_integrations", *arguments_of(["x"]))
    )
    assert call.input == {} and len(struct.fields) == 0
    assert error == (
        "Invalid input for get_available_integrations: the arguments are an array, "
        "not a JSON object; the call was not run. Send the input as a JSON object."
    )
    assert (
        checked_call(ToolCallRequest("call_2", "get_available_integrations", {"query": "x"}))[2]
        is None
    )


async def test_the_scripted_models_non_object_input_is_unreadable():
    model = ScriptedModel()
    reply = await model.generate(
        [
            {
                "role": "user",
                "content": '{"script": [{"tool": "get_available_integrations", "input": [1]}]}',
            }
        ],
        TOOLS,
        _noop,
    )
    assert [(c.name, c.input, c.unreadable) for c in reply.tool_calls] == [
        ("get_available_integrations", {}, "the arguments are an array, not a JSON object")
    ]


@pytest.mark.parametrize("tool", ["get_available_integrations", "ask_user_yes_no"])
async def test_a_turn_with_a_non_object_input_gets_the_error_result_and_goes_on(services, tool):
    async with services.client() as client:
        body, frames = await run_turn(client, {"tool": tool, "input": ["all"]}, {"say": "ok"})
        assert types(frames) == [
            "metadata",
            "tool_call",
            "tool_result",
            "response_chunk",
            "done",
        ], frames
        assert frames[1]["data"]["input"] == {}
        output = frames[2]["data"]["output"]
        assert output == {
            "success": False,
            "error": f"Invalid input for {tool}: the arguments are an array, not a JSON object; "
            "the call was not run. Send the input as a JSON object.",
        }
        assert frames[-1]["data"]["tool_calls"] == [{"tool": tool, "input": {}, "output": output}]
        chat = (await client.get(f"/assistant/chat/{body['chat_id']}")).json()
        assert chat["pending_user_input_request"] is None


@pytest.mark.parametrize("number", ["NaN", "1e400", "-Infinity"])
async def test_a_turn_whose_tool_input_holds_nan_or_infinity_keeps_its_chat_readable(
    services, number
):
    script = (
        '{"script": [{"tool": "execute_integration_tool", "input": {"integration": "loopline", '
        f'"action": "echo", "parameters": {{"message": "hi"}}, "x": {number}}}}}, '
        '{"say": "ok"}]}'
    )
    async with services.client() as client:
        started = await client.post("/assistant/chat", json={"message": script})
        assert started.status_code == 200, started.text
        body = started.json()
        frames = await read_frames(client, body["stream_url"])
        assert types(frames) == [
            "metadata",
            "tool_call",
            "tool_result",
            "response_chunk",
            "done",
        ], frames
        assert frames[1]["data"]["input"] == {}
        output = frames[2]["data"]["output"]
        assert (
            output["success"] is False
            and NOT_FINITE in output["error"]
            and "not run" in output["error"]
        )
        assert frames[-1]["data"]["response"] == "ok" and not frames[-1]["data"].get("error")
        for _ in range(2):
            chat = await client.get(f"/assistant/chat/{body['chat_id']}")
            assert chat.status_code == 200, chat.text
        assert [m["role"] for m in chat.json()["messages"]] == [
            "user",
            "assistant",
            "tool",
            "assistant",
        ]
        _, again = await run_turn(client, {"say": "still fine"}, chat_id=body["chat_id"])
        assert again[-1]["type"] == "done" and again[-1]["data"]["response"] == "still fine"


@pytest.mark.parametrize(
    ("raw", "reason"),
    [('{"category": "data', "the arguments are not valid JSON"), ('{"category": NaN}', NOT_FINITE)],
)
async def test_an_openai_call_with_unreadable_arguments_is_answered_and_the_model_sees_why(
    tmp_path, raw, reason
):
    replies = [
        Reply(events=openai_tool_call("get_available_integrations", raw, call_id="call_cut")),
        Reply(events=openai_text("Let me ", "retry.")),
    ]
    async with FakeLLMServer(replies) as server:
        model = OpenAICompatModel(
            "openai",
            "gpt-test",
            base_url=f"{server.url}/v1",
            api_key="sk-test-SECRET123456",
            policy=FAST,
            timeout_s=5,
        )
        reply = await model.generate([{"role": "user", "content": "hi"}], TOOLS, _noop)
        assert [(c.id, c.input, c.unreadable) for c in reply.tool_calls] == [
            ("call_cut", {}, reason)
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
    assert frames[2]["data"]["output"]["success"] is False
    tool = next(m for m in server.requests[1].body["messages"] if m["role"] == "tool")
    assert tool["tool_call_id"] == "call_cut" and reason in json.loads(tool["content"])["error"]


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({"category": "database"}, ({"category": "database"}, "")),
        (5, ({}, "the arguments are a number, not a JSON object")),
        ([1], ({}, "the arguments are an array, not a JSON object")),
    ],
)
async def test_a_server_that_sends_arguments_as_json_instead_of_a_string_is_read_not_a_crash(
    arguments, expected
):
    # an object or a number in `function.arguments` must not end the run with "unexpected error"
    # (TypeError)
    events = [
        openai_chunk({"role": "assistant", "content": None}),
        openai_chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_obj",
                        "type": "function",
                        "function": {"name": "get_available_integrations", "arguments": arguments},
                    }
                ]
            }
        ),
        openai_chunk({}, finish="tool_calls"),
        openai_chunk(usage={"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}),
        OPENAI_DONE,
    ]
    async with FakeLLMServer([Reply(events=events)]) as server:
        model = OpenAICompatModel(
            "openai",
            "gpt-test",
            base_url=f"{server.url}/v1",
            api_key="sk-test-SECRET123456",
            policy=FAST,
            timeout_s=5,
        )
        reply = await model.generate([{"role": "user", "content": "hi"}], TOOLS, _noop)
    assert [(c.id, c.input, c.unreadable) for c in reply.tool_calls] == [("call_obj", *expected)]


async def _noop(_: str) -> None:
    return None
