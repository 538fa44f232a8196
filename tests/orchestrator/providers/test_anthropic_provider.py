"""The Anthropic provider: the real `anthropic` SDK against a local Messages streaming server."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import pytest

from services.orchestrator.providers.anthropic_provider import AnthropicModel, to_anthropic_messages
from services.orchestrator.providers.base import ModelError
from services.orchestrator.providers.prompt import ASSISTANT_SYSTEM_PROMPT
from services.orchestrator.providers.retry import RetryPolicy
from tests.orchestrator.providers.fakes import (
    FakeLLMServer,
    Reply,
    anthropic_end,
    anthropic_event,
    anthropic_start,
    anthropic_text_block,
    anthropic_tool_block,
)

KEY = "sk-ant-api03-SECRETSECRET123456"
FAST = RetryPolicy(max_retries=2, base_delay_s=0.01, max_delay_s=1.0)
TOOLS = [
    {
        "name": "get_available_integrations",
        "description": "List integrations.",
        "input_schema": {"type": "object", "properties": {}},
    },
    {
        "name": "search_knowledge",
        "description": "Search.",
        "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}},
    },
]
THREAD: list[dict[str, Any]] = [
    {"role": "user", "content": "what can I connect?"},
    {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [{"id": "toolu_a", "name": "get_available_integrations", "input": {}}],
    },
    {
        "role": "tool",
        "tool_call_id": "toolu_a",
        "name": "get_available_integrations",
        "content": {"count": 3},
    },
]


def model(server: FakeLLMServer) -> AnthropicModel:
    return AnthropicModel(
        "claude-test", base_url=server.url, api_key=KEY, policy=FAST, max_tokens=256, timeout_s=5
    )


class Collector:
    def __init__(self) -> None:
        self.chunks: list[str] = []
        self.first = asyncio.Event()  # set on the first chunk

    async def __call__(self, chunk: str) -> None:
        self.chunks.append(chunk)
        self.first.set()


async def test_text_and_a_tool_use_block_with_split_input_json_and_cache_usage():
    events = [anthropic_start(input_tokens=25, cache_read=1800, cache_write=120)]
    events += anthropic_text_block(0, "Let me ", "search.")
    events += anthropic_tool_block(
        1, "search_knowledge", json.dumps({"query": "refund policy"}), tool_id="toolu_42", splits=4
    )
    events += anthropic_end(output_tokens=31, stop_reason="tool_use")
    async with FakeLLMServer([Reply(events=events)]) as server:
        chunks = Collector()
        reply = await model(server).generate(THREAD, TOOLS, chunks)
    assert chunks.chunks == ["Let me ", "search."]
    assert reply.text == "Let me search."
    assert [(c.id, c.name, c.input) for c in reply.tool_calls] == [
        ("toolu_42", "search_knowledge", {"query": "refund policy"})
    ]
    usage = reply.usage
    assert (
        usage.input_tokens,
        usage.output_tokens,
        usage.cache_read_tokens,
        usage.cache_write_tokens,
    ) == (25, 31, 1800, 120)
    assert usage.estimated is False
    seen = server.requests[0]
    assert seen.path == "/v1/messages"
    # this SDK release sends the key as a bearer token; older ones used x-api-key
    assert KEY in (
        seen.headers.get("x-api-key"),
        seen.headers.get("authorization", "").removeprefix("Bearer "),
    )
    assert seen.headers["anthropic-version"]
    assert seen.body["stream"] is True and seen.body["max_tokens"] == 256


async def test_request_carries_cache_breakpoints_on_the_stable_prefix_and_the_history():
    events = [anthropic_start()] + anthropic_text_block(0, "3 integrations.") + anthropic_end(5)
    async with FakeLLMServer([Reply(events=events)]) as server:
        await model(server).generate(THREAD, TOOLS, Collector())
        await model(server).generate(THREAD, TOOLS, Collector())
    body = server.requests[0].body
    ephemeral = {"type": "ephemeral"}
    # stable prefix: system prompt (no timestamp: identical on every call) and the last tool
    # definition
    assert body["system"] == [
        {"type": "text", "text": ASSISTANT_SYSTEM_PROMPT, "cache_control": ephemeral}
    ]
    assert server.requests[1].body["system"] == body["system"]
    assert (
        body["tools"][-1]["cache_control"] == ephemeral and "cache_control" not in body["tools"][0]
    )
    # history: the older part (message before the newest) and the newest message
    messages = body["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["content"][-1]["cache_control"] == ephemeral
    assert messages[2]["content"][-1]["cache_control"] == ephemeral
    assert "cache_control" not in messages[0]["content"][-1]
    breakpoints = json.dumps(body).count('"cache_control"')
    assert breakpoints == 4  # the API's maximum


def test_thread_conversion_merges_roles_and_keeps_tool_results_first():
    thread = THREAD + [
        {"role": "system", "content": "3 tool calls failed."},
        {
            "role": "tool",
            "tool_call_id": "x",
            "name": "n",
            "content": {"error": "boom", "success": False},
        },
    ]
    converted = to_anthropic_messages(thread)
    assert converted[1] == {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Checking."},
            {
                "type": "tool_use",
                "id": "toolu_a",
                "name": "get_available_integrations",
                "input": {},
            },
        ],
    }
    last = converted[2]
    assert last["role"] == "user" and len(converted) == 3
    assert [b["type"] for b in last["content"]] == ["tool_result", "tool_result", "text"]
    assert last["content"][0] == {
        "type": "tool_result",
        "tool_use_id": "toolu_a",
        "content": '{"count":3}',
    }
    assert last["content"][1]["is_error"] is True
    assert last["content"][2]["text"] == "[Note from the system] 3 tool calls failed."


async def test_overloaded_529_is_retried_then_succeeds():
    overloaded = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    events = [anthropic_start()] + anthropic_text_block(0, "ok") + anthropic_end(2)
    async with FakeLLMServer([Reply(status=529, body=overloaded), Reply(events=events)]) as server:
        reply = await model(server).generate(THREAD, TOOLS, Collector())
    assert reply.text == "ok" and len(server.requests) == 2


async def test_401_fails_at_once_with_a_sanitized_message():
    body = {
        "type": "error",
        "error": {"type": "authentication_error", "message": f"invalid x-api-key {KEY}"},
    }
    async with FakeLLMServer([Reply(status=401, body=body)]) as server:
        with pytest.raises(ModelError) as failure:
            await model(server).generate(THREAD, TOOLS, Collector())
    assert len(server.requests) == 1
    assert str(failure.value) == "anthropic: authentication failed (401)"


async def test_429_retry_after_is_honored_and_exhaustion_names_the_attempts():
    body = {"type": "error", "error": {"type": "rate_limit_error", "message": "slow"}}
    async with FakeLLMServer(
        [Reply(status=429, headers={"retry-after": "0.2"}, body=body)]
    ) as server:
        with pytest.raises(ModelError) as failure:
            await model(server).generate(THREAD, TOOLS, Collector())
    assert str(failure.value) == "anthropic: rate limited (429) after 3 attempts"
    gaps = [b.at - a.at for a, b in itertools.pairwise(server.requests)]
    assert len(gaps) == 2 and min(gaps) >= 0.2


async def test_stream_that_stops_halfway_keeps_reported_input_and_estimates_output():
    events = [anthropic_start(input_tokens=40, cache_read=500)] + anthropic_text_block(
        0, "half an ans", "wer"
    )[:2]
    async with FakeLLMServer([Reply(events=events, end="cut")]) as server:
        with pytest.raises(ModelError) as failure:
            await model(server).generate(THREAD, TOOLS, Collector())
    assert str(failure.value) == "anthropic: stream ended early"
    assert len(server.requests) == 1
    usage = failure.value.usage
    assert (usage.input_tokens, usage.cache_read_tokens) == (40, 500)
    assert usage.output_tokens >= 1 and usage.estimated is True


async def test_error_event_inside_the_stream_fails_the_call():
    events = [anthropic_start()] + anthropic_text_block(0, "so")[:2]
    events.append(
        anthropic_event(
            "error", {"error": {"type": "invalid_request_error", "message": f"bad {KEY}"}}
        )
    )
    async with FakeLLMServer([Reply(events=events)]) as server:
        with pytest.raises(ModelError) as failure:
            await model(server).generate(THREAD, TOOLS, Collector())
    assert str(failure.value) == "anthropic: stream error (invalid_request_error)"
    assert len(server.requests) == 1


async def test_overloaded_error_event_before_any_text_is_retried():
    overloaded = [
        anthropic_start(),
        anthropic_event("error", {"error": {"type": "overloaded_error", "message": "Overloaded"}}),
    ]
    events = [anthropic_start()] + anthropic_text_block(0, "fine") + anthropic_end(2)
    async with FakeLLMServer([Reply(events=overloaded), Reply(events=events)]) as server:
        reply = await model(server).generate(THREAD, TOOLS, Collector())
    assert reply.text == "fine" and len(server.requests) == 2
    assert reply.usage.input_tokens == 60  # both accepted attempts reported their input


async def test_cancel_closes_the_provider_stream_at_once():
    events = [anthropic_start()] + anthropic_text_block(0, "long answer")[:2]
    async with FakeLLMServer([Reply(events=events, end="hang")]) as server:
        chunks = Collector()
        llm = model(server)
        task = asyncio.create_task(llm.generate(THREAD, TOOLS, chunks))
        await chunks.first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(server.disconnected.wait(), 2)
    assert llm.partial_usage.input_tokens == 30  # reported by message_start before the cancel


async def test_a_call_that_may_not_call_tools_sends_them_with_tool_choice_none():
    """The Messages API refuses tool_use/tool_result blocks without `tools`: the summary call
    (loop._thread) sends them with `tool_choice: {"type": "none"}`."""
    events = (
        [anthropic_start()] + anthropic_text_block(0, "A summary.") + anthropic_end(output_tokens=3)
    )
    async with FakeLLMServer([Reply(events=events)]) as server:
        reply = await model(server).generate(THREAD, TOOLS, Collector(), call_tools=False)
    assert reply.text == "A summary."
    body = server.requests[0].body
    assert body["tool_choice"] == {"type": "none"}
    assert [t["name"] for t in body["tools"]] == ["get_available_integrations", "search_knowledge"]


async def test_attempts_whose_stream_delivered_no_event_are_not_billed():
    """As for OpenAI: a 200 answer that is no event stream is retried and bills nothing."""
    async with FakeLLMServer([Reply(status=200, body={"type": "error"})]) as server:
        with pytest.raises(ModelError) as failure:
            await model(server).generate(THREAD, TOOLS, Collector())
    assert len(server.requests) == 3
    usage = failure.value.usage
    assert (usage.input_tokens, usage.output_tokens, usage.cache_read_tokens, usage.estimated) == (
        0,
        0,
        0,
        False,
    )


async def test_a_refused_call_logs_the_providers_error_type_but_never_its_message(caplog):
    """The log names the provider's error type, which tells 400s apart (not only "request
    rejected (400)", BadRequestError). Its message (which may quote the request) is never
    logged."""
    body = {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": f"bad request with {KEY}"},
    }
    async with FakeLLMServer([Reply(status=400, body=body)]) as server:
        with pytest.raises(ModelError):
            await model(server).generate(THREAD, TOOLS, Collector())
    records = [r for r in caplog.records if r.getMessage() == "model call failed"]
    assert records and records[0].fields["provider_error_type"] == "invalid_request_error"
    assert all(
        KEY not in repr(r.__dict__) and "bad request with" not in repr(r.__dict__)
        for r in caplog.records
    )
