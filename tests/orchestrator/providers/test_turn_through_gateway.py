"""A whole turn through the HTTP API with each real provider pointed at a local fake server."""

from __future__ import annotations

import pytest

from tests.conftest import start_stack, stop_stack
from tests.orchestrator.helpers import billing_delivered, types
from tests.orchestrator.providers.fakes import (
    FakeLLMServer,
    Reply,
    anthropic_end,
    anthropic_start,
    anthropic_text_block,
    anthropic_tool_block,
    openai_text,
    openai_tool_call,
    openai_turn,
)
from tests.sse_client import read_frames

OPENAI_LLM = {"integration_name": "openai", "provider_id": "openai", "model_id": "gpt-test"}
ANTHROPIC_LLM = {
    "integration_name": "anthropic",
    "provider_id": "anthropic",
    "model_id": "claude-test",
}
FAST = {"llm_retry_base_delay_s": 0.01, "llm_timeout_s": 10.0}


async def _turn(services, llm: dict) -> list[dict]:
    async with services.client() as client:
        response = await client.post(
            "/assistant/chat", json={"message": "Which integrations can I use?", "llm": llm}
        )
        assert response.status_code == 200, response.text
        return await read_frames(client, response.json()["stream_url"])


def _check_tool_round(frames: list[dict], first_text: str, answer: str) -> dict:
    assert types(frames)[0] == "metadata" and types(frames)[-1] == "done"
    kinds = [t for t in types(frames) if t != "metadata"]
    first_call = kinds.index("tool_call")
    assert kinds[first_call + 1] == "tool_result"
    assert "response_chunk" in kinds[:first_call] and "response_chunk" in kinds[first_call + 2 :]
    chunks = [f["data"]["chunk"] for f in frames if f["type"] == "response_chunk"]
    assert "".join(chunks) == first_text + answer
    call = next(f for f in frames if f["type"] == "tool_call")["data"]
    result = next(f for f in frames if f["type"] == "tool_result")["data"]
    assert call["tool"] == result["tool"] == "get_available_integrations"
    assert result["tool_call_id"] == call["tool_call_id"]
    assert isinstance(result["output"], dict) and "integrations" in result["output"]
    done = frames[-1]["data"]
    assert done["response"] == answer
    assert done["tool_calls"][0]["tool"] == "get_available_integrations"
    return done


async def test_openai_turn_streams_chunks_runs_one_tool_and_reports_provider_usage(tmp_path):
    replies = [
        Reply(
            events=openai_tool_call(
                "get_available_integrations",
                "{}",
                call_id="call_gw1",
                say="Let me look. ",
                usage={"prompt_tokens": 400, "completion_tokens": 15, "total_tokens": 415},
            )
        ),
        Reply(
            events=openai_text(
                "You can use ",
                "three integrations.",
                usage={"prompt_tokens": 600, "completion_tokens": 9, "total_tokens": 609},
            )
        ),
    ]
    async with FakeLLMServer(replies) as server:
        stack = await start_stack(
            tmp_path,
            orchestrator={
                "openai_base_url": f"{server.url}/v1",
                "openai_api_key": "sk-platform-key-123456",
                "openai_models": "gpt-test",
                **FAST,
            },
        )
        try:
            frames = await _turn(stack, OPENAI_LLM)
        finally:
            await stop_stack(stack)
    done = _check_tool_round(frames, "Let me look. ", "You can use three integrations.")
    assert done["usage"]["input_tokens"] == 1000 and done["usage"]["output_tokens"] == 24
    assert done["usage"]["llm_calls"] == 2
    # the second call saw the tool round in the OpenAI format
    second = server.requests[1].body["messages"]
    assistant = next(m for m in second if m["role"] == "assistant")
    assert (
        assistant["tool_calls"][0]["id"] == "call_gw1"
        and assistant["tool_calls"][0]["function"]["arguments"] == "{}"
    )
    tool = next(m for m in second if m["role"] == "tool")
    assert tool["tool_call_id"] == "call_gw1" and '"integrations"' in tool["content"]
    assert server.requests[0].body["parallel_tool_calls"] is False
    assert {t["function"]["name"] for t in server.requests[0].body["tools"]} >= {
        "get_available_integrations",
        "ask_user_yes_no",
    }


async def test_anthropic_turn_streams_chunks_runs_one_tool_and_reports_provider_usage(tmp_path):
    first = [anthropic_start(input_tokens=300, cache_write=1500)] + anthropic_text_block(
        0, "Checking. "
    )
    first += anthropic_tool_block(
        1, "get_available_integrations", "{}", tool_id="toolu_gw1"
    ) + anthropic_end(20, "tool_use")
    second = [anthropic_start(input_tokens=80, cache_read=1500)] + anthropic_text_block(
        0, "Three ", "are available."
    )
    second += anthropic_end(6)
    async with FakeLLMServer([Reply(events=first), Reply(events=second)]) as server:
        stack = await start_stack(
            tmp_path,
            orchestrator={
                "anthropic_base_url": server.url,
                "anthropic_api_key": "sk-ant-platform-123456",
                "anthropic_models": "claude-test",
                **FAST,
            },
        )
        try:
            frames = await _turn(stack, ANTHROPIC_LLM)
        finally:
            await stop_stack(stack)
    done = _check_tool_round(frames, "Checking. ", "Three are available.")
    # every input token read, cached or not: 300 + 1500 written to the cache, 80 + 1500 read from it
    assert done["usage"]["input_tokens"] == 3380 and done["usage"]["output_tokens"] == 26
    assert done["usage"]["total_tokens"] == 3406
    second_body = server.requests[1].body
    results = [
        b for m in second_body["messages"] for b in m["content"] if b["type"] == "tool_result"
    ]
    assert results[0]["tool_use_id"] == "toolu_gw1"
    assert (
        second_body["system"] == server.requests[0].body["system"]
    )  # stable prefix: the cache can hit


async def test_provider_failure_fails_the_run_with_a_sanitized_error(tmp_path):
    key = "sk-platform-key-SECRET-99"
    async with FakeLLMServer(
        [Reply(status=503, body={"error": {"message": f"down, key {key}"}})]
    ) as server:
        stack = await start_stack(
            tmp_path,
            orchestrator={
                "openai_base_url": f"{server.url}/v1",
                "openai_api_key": key,
                "openai_models": "gpt-test",
                "llm_max_retries": 1,
                **FAST,
            },
        )
        try:
            frames = await _turn(stack, OPENAI_LLM)
        finally:
            await stop_stack(stack)
    assert types(frames)[-2:] == ["error", "done"] and frames[-1]["data"].get("error") is True
    message = frames[-2]["data"]["message"]
    assert message == "openai: server error (503) after 2 attempts"
    assert len(server.requests) == 2


@pytest.mark.parametrize(
    "llm, detail",
    [
        (
            {"integration_name": "x", "provider_id": "nope", "model_id": "m"},
            "unknown model provider",
        ),
        ({**OPENAI_LLM, "model_id": "gpt-unlisted"}, "unknown model"),
        ({**OPENAI_LLM, "credential_id": "cred_1"}, "cannot be used as a model key"),
    ],
)
async def test_unknown_provider_model_or_unusable_credential_is_400_and_writes_nothing(
    tmp_path, llm, detail
):
    stack = await start_stack(
        tmp_path,
        orchestrator={"openai_api_key": "sk-platform-key-123456", "openai_models": "gpt-test"},
    )
    try:
        async with stack.client() as client:
            response = await client.post("/assistant/chat", json={"message": "hi", "llm": llm})
            assert response.status_code == 400, response.text
            assert detail in response.json()["detail"]
            chats = await client.get("/assistant/chats")
            assert chats.status_code == 200 and chats.json()["items"] == []
    finally:
        await stop_stack(stack)


async def test_cancel_during_a_provider_stream_closes_it_and_records_the_usage(tmp_path):
    import asyncio

    from sqlalchemy import select

    from services.billing.models import UsageRecord
    from tests.orchestrator.helpers import wait_for

    replies = [Reply(events=openai_text("Thinking about it ", "for a long time"), end="hang")]
    async with FakeLLMServer(replies) as server:
        stack = await start_stack(
            tmp_path,
            orchestrator={
                "openai_base_url": f"{server.url}/v1",
                "openai_api_key": "sk-platform-key-123456",
                "openai_models": "gpt-test",
                **FAST,
            },
        )
        try:
            async with stack.client() as client:
                body = (
                    await client.post("/assistant/chat", json={"message": "hi", "llm": OPENAI_LLM})
                ).json()
                await wait_for(
                    lambda: any(
                        e.WhichOneof("payload") == "response_chunk"
                        for e in stack.orchestrator.runner.events.snapshot(body["run_id"])
                    )
                )
                began = asyncio.get_running_loop().time()
                assert (
                    await client.post(f"/assistant/chat/{body['chat_id']}/cancel")
                ).status_code == 200
                assert asyncio.get_running_loop().time() - began < 1.0
                frames = await read_frames(client, body["stream_url"])
            async with stack.billing.store.sessions() as session:
                rows = (
                    (
                        await session.execute(
                            select(UsageRecord).where(UsageRecord.run_id == body["run_id"])
                        )
                    )
                    .scalars()
                    .all()
                )
        finally:
            await stop_stack(stack)
    assert frames[-1]["type"] == "cancelled"
    assert len(rows) == 1 and rows[0].input_tokens > 0 and rows[0].output_tokens > 0


async def test_bring_your_own_key_uses_the_organizations_credential_and_is_not_credited(tmp_path):
    import grpc
    from sqlalchemy import select

    from loopline.tools.v1 import tools_pb2, tools_pb2_grpc
    from services.billing.models import UsageRecord

    replies = [
        Reply(
            events=openai_text(
                "Hello from your own key.",
                usage={"prompt_tokens": 50, "completion_tokens": 5, "total_tokens": 55},
            )
        )
    ]
    async with FakeLLMServer(replies) as server:
        stack = await start_stack(
            tmp_path,
            orchestrator={
                "openai_base_url": f"{server.url}/v1",
                "openai_api_key": "",
                "openai_models": "gpt-test",
                **FAST,
            },
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.tools.port}") as channel:
                created = await tools_pb2_grpc.ToolsServiceStub(channel).CreateCredential(
                    tools_pb2.CreateCredentialRequest(
                        organization_id=stack.org_id,
                        integration_name="openai",
                        auth_data={"api_key": "sk-org-own-key-999999"},
                    )
                )
            credential_id = created.credential.credential_id
            async with stack.client() as client:
                missing = await client.post(
                    "/assistant/chat", json={"message": "hi", "llm": OPENAI_LLM}
                )
                assert missing.status_code == 400  # no platform key and no credential
                wrong = await client.post(
                    "/assistant/chat",
                    json={"message": "hi", "llm": {**OPENAI_LLM, "credential_id": "nope"}},
                )
                assert wrong.status_code == 400
                body = (
                    await client.post(
                        "/assistant/chat",
                        json={
                            "message": "hi",
                            "llm": {**OPENAI_LLM, "credential_id": credential_id},
                        },
                    )
                ).json()
                frames = await read_frames(client, body["stream_url"])
            await billing_delivered(
                stack
            )  # billing has a run's usage ~0.2 s after its done (stored with its end)
            async with stack.billing.store.sessions() as session:
                rows = (
                    (
                        await session.execute(
                            select(UsageRecord).where(UsageRecord.run_id == body["run_id"])
                        )
                    )
                    .scalars()
                    .all()
                )
        finally:
            await stop_stack(stack)
    assert (
        frames[-1]["type"] == "done"
        and frames[-1]["data"]["response"] == "Hello from your own key."
    )
    assert server.requests[0].headers["authorization"] == "Bearer sk-org-own-key-999999"
    assert len(rows) == 1 and rows[0].byok is True and rows[0].millicredits == 0
    assert "sk-org-own-key-999999" not in str(frames)


async def test_done_usage_counts_the_cached_prompt_tokens_the_provider_reported(tmp_path):
    """`done.usage.input_tokens` is every input token the provider read, cached ones
    included: OpenAI's prompt_tokens 1000 with 800 cached is 1000, not the 200 uncached, and
    Anthropic's cache reads and writes count too. Billing still prices each part at its own
    rate."""
    replies = [
        Reply(
            events=openai_text(
                "Cached.",
                usage={
                    "prompt_tokens": 1000,
                    "completion_tokens": 10,
                    "total_tokens": 1010,
                    "prompt_tokens_details": {"cached_tokens": 800},
                },
            )
        )
    ]
    frames, _server = await openai_turn(tmp_path, replies, "Which integrations can I use?")
    assert frames[-1]["data"]["usage"] == {
        "input_tokens": 1000,
        "output_tokens": 10,
        "total_tokens": 1010,
        "llm_calls": 1,
    }


class StrictAnthropic(FakeLLMServer):
    """Refuses, as the Messages API does, a request whose messages hold tool_use or tool_result
    blocks without `tools` (400 invalid_request_error); otherwise serves its replies in order."""

    async def _respond(self, reply, reader, writer):  # noqa: ANN001, ANN202
        body = self.requests[-1].body or {}
        blocks = [
            b
            for m in body.get("messages", [])
            if isinstance(m.get("content"), list)
            for b in m["content"]
        ]
        if not body.get("tools") and any(
            b.get("type") in ("tool_use", "tool_result") for b in blocks
        ):
            self.refused += 1
            error = {
                "type": "error",
                "error": {
                    "type": "invalid_request_error",
                    "message": "Requests which include `tool_use` or `tool_result` blocks "
                    "must define tools.",
                },
            }
            return await super()._respond(Reply(status=400, body=error), reader, writer)
        self.served += 1
        return await super()._respond(
            self.replies[min(self.served - 1, len(self.replies) - 1)], reader, writer
        )

    refused = 0
    served = 0


LONG_TEXT = "word " * 600


async def _summarized_anthropic_chat(
    tmp_path, later: list[list[str]]
) -> tuple[list[dict], dict, StrictAnthropic]:
    """Two turns on one chat through a StrictAnthropic server with a small summarization budget:
    the first calls a tool and answers at length (~1,200 tokens), so the second starts over
    budget; `later` are the server's replies from the second turn on. Returns (the second
    turn's frames, GET chat, the server)."""
    tool_step = [anthropic_start(input_tokens=900)] + anthropic_text_block(0, LONG_TEXT)
    tool_step += anthropic_tool_block(
        1, "get_available_integrations", "{}", tool_id="toolu_s1"
    ) + anthropic_end(600, "tool_use")
    answer = (
        [anthropic_start(input_tokens=1000)]
        + anthropic_text_block(0, LONG_TEXT)
        + anthropic_end(600)
    )
    async with StrictAnthropic([Reply(events=e) for e in (tool_step, answer, *later)]) as server:
        stack = await start_stack(
            tmp_path,
            orchestrator={
                "anthropic_base_url": server.url,
                "anthropic_api_key": "sk-ant-platform-123456",
                "anthropic_models": "claude-test",
                "summarization_budget_tokens": 800,
                "summarization_keep_tokens": 100,
                **FAST,
            },
        )
        try:
            async with stack.client() as client:
                first = await client.post(
                    "/assistant/chat",
                    json={"message": "Which integrations can I use?", "llm": ANTHROPIC_LLM},
                )
                assert first.status_code == 200, first.text
                assert types(await read_frames(client, first.json()["stream_url"]))[-1] == "done"
                chat_id = first.json()["chat_id"]
                second = await client.post(
                    "/assistant/chat",
                    json={"message": "And now?", "llm": ANTHROPIC_LLM, "chat_id": chat_id},
                )
                assert second.status_code == 200, second.text
                frames = await read_frames(client, second.json()["stream_url"])
                chat = (await client.get(f"/assistant/chat/{chat_id}")).json()
        finally:
            await stop_stack(stack)
    return frames, chat, server


async def test_an_anthropic_thread_with_tool_calls_is_summarized_and_the_chat_keeps_working(
    tmp_path,
):
    """The summary call carries the run's tools with tool_choice none (the same cached
    prefix as the other calls): the Messages API refuses (400) a history holding
    tool_use/tool_result blocks without tools, which would fail every turn of a chat long
    enough to summarize."""
    summary = [anthropic_start(input_tokens=1200, cache_read=700)] + anthropic_text_block(
        0, "The user asked about integrations."
    )
    summary += anthropic_end(8)
    short = (
        [anthropic_start(input_tokens=300)]
        + anthropic_text_block(0, "Still here.")
        + anthropic_end(3)
    )
    frames, chat, server = await _summarized_anthropic_chat(tmp_path, [summary, short])
    assert server.refused == 0
    assert types(frames)[-1] == "done" and frames[-1]["data"].get("error") is not True, frames[-2:]
    assert frames[-1]["data"]["response"] == "Still here."
    assert frames[-1]["data"]["usage"]["llm_calls"] == 2  # the summary call and the answer
    assert "summary" in [m["role"] for m in chat["messages"]]
    summary_call = server.requests[2].body
    assert summary_call["tool_choice"] == {"type": "none"}
    assert [t["name"] for t in summary_call["tools"]] == [
        t["name"] for t in server.requests[0].body["tools"]
    ]
    assert summary_call["system"] == server.requests[0].body["system"]


async def test_a_summary_call_that_returns_no_text_keeps_the_thread_whole_and_is_not_asked_again(
    tmp_path,
):
    """When a model answers the summary call with a tool call and no text (tool_choice
    "none" not honoured), the older part of the thread is kept whole, not replaced by an empty
    summary, and the run does not ask again at every step."""
    no_summary = [anthropic_start(input_tokens=1200)] + anthropic_tool_block(
        0, "get_available_integrations", "{}", tool_id="toolu_x"
    )
    no_summary += anthropic_end(5, "tool_use")
    again = [anthropic_start(input_tokens=300)] + anthropic_text_block(0, "Checking. ")
    again += anthropic_tool_block(
        1, "get_available_integrations", "{}", tool_id="toolu_s2"
    ) + anthropic_end(3, "tool_use")
    short = (
        [anthropic_start(input_tokens=300)]
        + anthropic_text_block(0, "Still here.")
        + anthropic_end(3)
    )
    frames, chat, server = await _summarized_anthropic_chat(tmp_path, [no_summary, again, short])
    assert frames[-1]["type"] == "done" and frames[-1]["data"]["response"] == "Still here."
    assert (
        frames[-1]["data"]["usage"]["llm_calls"] == 3
    )  # one summary call, two answers: not a summary before each
    assert len(server.requests) == 5 and "summary" not in [m["role"] for m in chat["messages"]]
    assert len([m for m in chat["messages"] if m["role"] == "user"]) == 2
