"""The OpenAI-compatible provider: the real `openai` SDK against a local chat-completions server."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from services.orchestrator.providers.base import ModelError
from services.orchestrator.providers.openai_compat import OpenAICompatModel, to_openai_messages
from services.orchestrator.providers.prompt import ASSISTANT_SYSTEM_PROMPT
from services.orchestrator.providers.retry import RetryPolicy
from tests.orchestrator.providers.fakes import (
    FakeLLMServer,
    Reply,
    openai_chunk,
    openai_text,
    openai_tool_call,
)

KEY = "sk-test-SECRETSECRET123456"
FAST = RetryPolicy(max_retries=2, base_delay_s=0.01, max_delay_s=1.0)
TOOLS = [
    {
        "name": "get_available_integrations",
        "description": "List integrations.",
        "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}},
    }
]
USER = [{"role": "user", "content": "hello"}]


def model(server: FakeLLMServer, policy: RetryPolicy = FAST) -> OpenAICompatModel:
    return OpenAICompatModel(
        "openai", "gpt-test", base_url=f"{server.url}/v1", api_key=KEY, policy=policy, timeout_s=5
    )


class Collector:
    def __init__(self) -> None:
        self.chunks: list[str] = []
        self.first = asyncio.Event()  # set on the first chunk

    async def __call__(self, chunk: str) -> None:
        self.chunks.append(chunk)
        self.first.set()


async def test_text_deltas_stream_to_on_text_and_usage_comes_from_the_usage_chunk():
    usage = {
        "prompt_tokens": 120,
        "completion_tokens": 9,
        "total_tokens": 129,
        "prompt_tokens_details": {"cached_tokens": 100},
    }
    async with FakeLLMServer(
        [Reply(events=openai_text("Hel", "lo ", "there", usage=usage))]
    ) as server:
        chunks = Collector()
        reply = await model(server).generate(USER, [], chunks)
    assert chunks.chunks == ["Hel", "lo ", "there"]
    assert reply.text == "Hello there" and reply.tool_calls == []
    # billing counts uncached input only: cached prompt tokens are cache reads
    assert (reply.usage.input_tokens, reply.usage.cache_read_tokens, reply.usage.output_tokens) == (
        20,
        100,
        9,
    )
    assert reply.usage.estimated is False
    seen = server.requests[0]
    assert seen.path == "/v1/chat/completions"
    assert seen.headers["authorization"] == f"Bearer {KEY}"
    assert seen.body["stream"] is True and seen.body["stream_options"] == {"include_usage": True}
    assert seen.body["messages"][0] == {"role": "system", "content": ASSISTANT_SYSTEM_PROMPT}
    assert "tools" not in seen.body and "parallel_tool_calls" not in seen.body


async def test_tool_call_is_assembled_from_deltas_split_across_chunks():
    events = openai_tool_call(
        "get_available_integrations", json.dumps({"query": "postgres databases"}), splits=4
    )
    async with FakeLLMServer([Reply(events=events)]) as server:
        chunks = Collector()
        reply = await model(server).generate(USER, TOOLS, chunks)
    assert len(reply.tool_calls) == 1
    call = reply.tool_calls[0]
    assert (call.id, call.name, call.input) == (
        "call_abc123",
        "get_available_integrations",
        {"query": "postgres databases"},
    )
    body = server.requests[0].body
    assert body["parallel_tool_calls"] is False
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_available_integrations",
                "description": "List integrations.",
                "parameters": TOOLS[0]["input_schema"],
            },
        }
    ]


@pytest.mark.parametrize(
    "names",
    [
        ["get_available_", "integrations"],
        ["get_available_integrations", "get_available_integrations"],
    ],
)
async def test_tool_name_split_across_deltas_or_repeated_in_each_is_assembled_once(names):
    events = [openai_chunk({"role": "assistant", "content": None})]
    events.append(
        openai_chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_split",
                        "type": "function",
                        "function": {"name": names[0], "arguments": '{"qu'},
                    }
                ]
            }
        )
    )
    events.append(
        openai_chunk(
            {
                "tool_calls": [
                    {"index": 0, "function": {"name": names[1], "arguments": 'ery": "x"}'}}
                ]
            }
        )
    )
    events += [
        openai_chunk({}, finish="tool_calls"),
        openai_chunk(usage={"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}),
        "data: [DONE]\n\n",
    ]
    async with FakeLLMServer([Reply(events=events)]) as server:
        reply = await model(server).generate(USER, TOOLS, Collector())
    assert [(c.name, c.input) for c in reply.tool_calls] == [
        ("get_available_integrations", {"query": "x"})
    ]


async def test_several_tool_calls_in_one_reply_are_all_returned_in_index_order():
    frames = [
        openai_chunk({"role": "assistant"}),
        openai_chunk(
            {
                "tool_calls": [
                    {
                        "index": 1,
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "b", "arguments": '{"x"'},
                    }
                ]
            }
        ),
        openai_chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "a", "arguments": "{}"},
                    }
                ]
            }
        ),
        openai_chunk({"tool_calls": [{"index": 1, "function": {"arguments": ": 1}"}}]}),
        openai_chunk({}, finish="tool_calls"),
        "data: [DONE]\n\n",
    ]
    async with FakeLLMServer([Reply(events=frames)]) as server:
        reply = await model(server).generate(USER, TOOLS, Collector())
    assert [(c.id, c.name, c.input) for c in reply.tool_calls] == [
        ("call_1", "a", {}),
        ("call_2", "b", {"x": 1}),
    ]
    # no usage chunk: the usage is an estimate, marked as such
    assert reply.usage.estimated is True and reply.usage.input_tokens > 0


def test_thread_is_converted_to_the_chat_completions_format():
    thread: list[dict[str, Any]] = [
        {"role": "user", "content": "list my apps"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "name": "get_available_integrations", "input": {"q": "x"}}
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "name": "get_available_integrations",
            "content": {"count": 2},
        },
        {"role": "system", "content": "Converge."},
        {"role": "assistant", "content": "Two apps."},
    ]
    assert to_openai_messages(thread, "SYS") == [
        {"role": "system", "content": "SYS"},
        {"role": "user", "content": "list my apps"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_available_integrations", "arguments": '{"q":"x"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"count":2}'},
        {"role": "system", "content": "Converge."},
        {"role": "assistant", "content": "Two apps."},
    ]


async def test_429_is_retried_after_the_retry_after_delay():
    replies = [
        Reply(
            status=429,
            headers={"Retry-After": "0.3"},
            body={"error": {"message": "slow down", "type": "rate_limit"}},
        ),
        Reply(events=openai_text("ok")),
    ]
    async with FakeLLMServer(replies) as server:
        reply = await model(server).generate(USER, [], Collector())
    assert reply.text == "ok"
    assert len(server.requests) == 2
    assert (
        server.requests[1].at - server.requests[0].at >= 0.3
    )  # base delay is 0.01 s: Retry-After ruled


async def test_5xx_is_retried_a_bounded_number_of_times_then_fails_with_a_sanitized_message():
    error = {
        "error": {
            "message": f"upstream exploded with key {KEY} at http://10.0.0.7/internal",
            "type": "server_error",
        }
    }
    async with FakeLLMServer([Reply(status=500, body=error)]) as server:
        with pytest.raises(ModelError) as failure:
            await model(server).generate(USER, [], Collector())
    assert len(server.requests) == 3  # 1 attempt + 2 retries
    message = str(failure.value)
    assert message == "openai: server error (500) after 3 attempts"
    assert failure.value.usage.input_tokens == 0  # nothing was accepted, nothing estimated


async def test_400_is_not_retried_and_the_message_names_only_provider_and_kind():
    error = {
        "error": {"message": f"Incorrect API key provided: {KEY}", "type": "invalid_request_error"}
    }
    async with FakeLLMServer([Reply(status=400, body=error)]) as server:
        with pytest.raises(ModelError) as failure:
            await model(server).generate(USER, [], Collector())
    assert len(server.requests) == 1
    assert str(failure.value) == "openai: request rejected (400)"
    assert KEY not in str(failure.value) and server.url not in str(failure.value)


async def test_retry_after_longer_than_the_cap_fails_at_once():
    async with FakeLLMServer(
        [Reply(status=429, headers={"Retry-After": "120"}, body={})]
    ) as server:
        with pytest.raises(ModelError) as failure:
            await model(server).generate(USER, [], Collector())
    assert len(server.requests) == 1
    assert str(failure.value).startswith("openai: rate limited (429)")


@pytest.mark.parametrize("bad", [None, -5, 2_000_000_000, 10**30, 1.5])
async def test_a_reported_count_that_is_no_token_count_is_estimated_not_0(bad):
    # recorded as 0, such counts would leave the call's tokens unbilled
    usage = {"prompt_tokens": bad, "completion_tokens": 9, "total_tokens": 9}
    async with FakeLLMServer(
        [Reply(events=openai_text("Hel", "lo ", "there", usage=usage))]
    ) as server:
        reply = await model(server).generate(USER, [], Collector())
    assert (
        reply.usage.input_tokens > 0
        and reply.usage.output_tokens == 9
        and reply.usage.estimated is True
    )
    usage = {"prompt_tokens": 40, "completion_tokens": bad, "total_tokens": 40}
    async with FakeLLMServer(
        [Reply(events=openai_text("Hel", "lo ", "there", usage=usage))]
    ) as server:
        reply = await model(server).generate(USER, [], Collector())
    assert (
        reply.usage.input_tokens == 40
        and reply.usage.output_tokens > 0
        and reply.usage.estimated is True
    )


async def test_stream_that_stops_after_text_fails_without_retry_and_carries_estimated_usage():
    frames = openai_text("partial ", "answer")[
        :3
    ]  # role chunk and two text chunks; no finish, no usage
    async with FakeLLMServer([Reply(events=frames, end="cut")]) as server:
        chunks = Collector()
        with pytest.raises(ModelError) as failure:
            await model(server).generate(USER, [], chunks)
    assert chunks.chunks == ["partial ", "answer"]
    assert len(server.requests) == 1  # text reached the client: a retry would repeat it
    assert str(failure.value) == "openai: stream ended early"
    usage = failure.value.usage
    assert usage.estimated is True and usage.input_tokens > 0 and usage.output_tokens > 0


async def test_stream_that_stops_before_any_text_is_retried():
    replies = [
        Reply(events=[openai_chunk({"role": "assistant"})], end="cut"),
        Reply(events=openai_text("fine")),
    ]
    async with FakeLLMServer(replies) as server:
        reply = await model(server).generate(USER, [], Collector())
    assert reply.text == "fine" and len(server.requests) == 2
    # the broken attempt's input was processed: its estimate is added, so the total is marked
    # estimated
    assert reply.usage.estimated is True and reply.usage.output_tokens == 7


async def test_cancel_closes_the_provider_stream_at_once():
    frames = [
        openai_chunk({"role": "assistant", "content": ""}),
        openai_chunk({"content": "thinking..."}),
    ]
    async with FakeLLMServer([Reply(events=frames, end="hang")]) as server:
        chunks = Collector()
        llm = model(server)
        task = asyncio.create_task(llm.generate(USER, [], chunks))
        await chunks.first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(server.disconnected.wait(), 2)
    assert llm.partial_usage.estimated is True and llm.partial_usage.output_tokens > 0


async def test_a_call_that_may_not_call_tools_sends_them_with_tool_choice_none():
    """The summary call (loop._thread) reads a thread that holds tool calls: the tools go with
    it, `tool_choice` "none" and no `parallel_tool_calls` (which OpenAI allows only for calls
    that may call tools)."""
    async with FakeLLMServer([Reply(events=openai_text("A summary."))]) as server:
        reply = await model(server).generate(USER, TOOLS, Collector(), call_tools=False)
    assert reply.text == "A summary."
    body = server.requests[0].body
    assert body["tool_choice"] == "none" and "parallel_tool_calls" not in body
    assert [t["function"]["name"] for t in body["tools"]] == ["get_available_integrations"]


async def test_attempts_whose_stream_delivered_nothing_are_not_billed():
    """An attempt whose stream delivered no chunk (here a 200 with a JSON error body, not an
    event stream) records 0 tokens, so 3 failed attempts bill nothing for tokens no one saw
    rather than 3 estimates of the whole prompt. An attempt that delivered a chunk before
    breaking still carries its estimate (above)."""
    async with FakeLLMServer(
        [Reply(status=200, body={"error": {"message": "overloaded"}})]
    ) as server:
        with pytest.raises(ModelError) as failure:
            await model(server).generate(USER * 50, [], Collector())
    assert (
        str(failure.value) == "openai: stream ended early after 3 attempts"
        and len(server.requests) == 3
    )
    usage = failure.value.usage
    assert (usage.input_tokens, usage.output_tokens, usage.estimated) == (0, 0, False)


async def test_a_call_cancelled_before_its_first_chunk_is_still_billed_its_estimate():
    async with FakeLLMServer([Reply(events=[], end="hang")]) as server:
        server.replies[0].events = [
            ": keep-alive\n\n"
        ]  # headers and a comment: the request was accepted
        llm = model(server)
        task = asyncio.create_task(llm.generate(USER, [], Collector()))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert llm.partial_usage.estimated is True and llm.partial_usage.input_tokens > 0


async def test_another_compatible_server_gets_no_tools_on_a_call_that_may_not_call_them():
    """Not every OpenAI-compatible server takes tool_choice "none"; chat completions take tool
    calls in the history without the tools, so such a call (the summary) sends none, as before."""
    async with FakeLLMServer([Reply(events=openai_text("A summary."))]) as server:
        vllm = OpenAICompatModel(
            "vllm", "qwen", base_url=f"{server.url}/v1", api_key=KEY, policy=FAST, timeout_s=5
        )
        await vllm.generate(USER, TOOLS, Collector(), call_tools=False)
    body = server.requests[0].body
    assert "tools" not in body and "tool_choice" not in body and "parallel_tool_calls" not in body
