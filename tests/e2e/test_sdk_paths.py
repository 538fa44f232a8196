"""The official SDK over every terminal path and every question kind (issues 3 and 4).

These use the in-process stack (fast); tests/e2e/test_sdk_and_wire.py covers the real processes.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from modulex import Modulex
from modulex.types.realtime import user_input_request_from_event

from tests.conftest import SCRIPTED
from tests.orchestrator.questions import QUESTIONS
from tests.sse_client import validate_frame


def _client(services) -> Modulex:
    return Modulex(
        api_key=services.api_key, organization_id=services.org_id, base_url=services.base_url
    )


async def _events(client: Modulex, chat_id: str, run_id: str) -> list:
    events = []
    async with client.assistant.listen(chat_id, run_id) as stream:
        async for event in stream:
            validate_frame(event.data)
            events.append(event)
    return events


def _script(*steps: dict) -> str:
    return json.dumps({"script": list(steps)})


async def test_sdk_listen_ends_on_completed(services):
    client = _client(services)
    turn = await client.assistant.chat(_script({"say": "all good"}), llm=SCRIPTED)
    assert turn.chat_id is not None and turn.run_id is not None
    events = await _events(client, turn.chat_id, turn.run_id)
    assert events[-1].event == "done" and events[-1].data["data"]["response"] == "all good"


async def test_sdk_listen_ends_on_failed(services):
    client = _client(services)
    turn = await client.assistant.chat(_script({"fail": "nope"}), llm=SCRIPTED)
    assert turn.chat_id is not None and turn.run_id is not None
    events = await _events(client, turn.chat_id, turn.run_id)
    # the SDK stops at the first terminal type it sees, which is `error` (followed on the wire
    # by done+error)
    assert events[-1].event == "error" and events[-1].data["data"]["message"]


async def test_sdk_listen_ends_on_cancelled_during_model_wait(services):
    client = _client(services)
    turn = await client.assistant.chat(_script({"say": "slow", "sleep_ms": 10_000}), llm=SCRIPTED)
    assert turn.chat_id is not None and turn.run_id is not None
    listening = asyncio.create_task(_events(client, turn.chat_id, turn.run_id))
    await asyncio.sleep(0.3)
    cancelled = await client.assistant.cancel(turn.chat_id)
    assert cancelled.status == "cancelled" and cancelled.run_id == turn.run_id
    events = await asyncio.wait_for(listening, 5)
    assert events[-1].event == "cancelled"


async def test_sdk_listen_ends_on_cancelled_during_tool_call(services):
    client = _client(services)
    slow = {
        "tool": "execute_integration_tool",
        "input": {"integration": "loopline", "action": "wait", "parameters": {"seconds": 20}},
    }
    turn = await client.assistant.chat(_script(slow, {"say": "never"}), llm=SCRIPTED)
    chat_id, run_id = turn.chat_id, turn.run_id
    assert chat_id is not None and run_id is not None
    seen: list = []
    tool_called = asyncio.Event()

    async def listen() -> None:
        async with client.assistant.listen(chat_id, run_id) as stream:
            async for event in stream:
                seen.append(event)
                if event.event == "tool_call":
                    tool_called.set()

    listening = asyncio.create_task(listen())
    await tool_called.wait()
    await client.assistant.cancel(chat_id)
    await asyncio.wait_for(listening, 5)
    assert seen[-1].event == "cancelled"


@pytest.mark.parametrize("tool", list(QUESTIONS))
async def test_sdk_ask_resume_done_round_for_each_question_kind(services, tool):
    question, answer = QUESTIONS[tool]
    assert isinstance(question, dict) and isinstance(answer, dict)
    client = _client(services)
    turn = await client.assistant.chat(
        _script({"tool": tool, "input": question}, {"say": "thanks"}), llm=SCRIPTED
    )
    assert turn.chat_id is not None and turn.run_id is not None
    events = await _events(client, turn.chat_id, turn.run_id)
    assert [e.event for e in events][-2:] == ["user_input_request", "interrupted"]
    request = user_input_request_from_event(events[-2].data)  # the SDK parses the question itself
    assert request is not None
    assert request.kind == question.get("kind", request.kind)
    status = await client.assistant.status(turn.chat_id)
    assert status.awaiting_input and status.pending_request_id == request.request_id
    resumed = await client.assistant.resume(
        turn.chat_id, request_id=request.request_id, response=answer, llm=SCRIPTED
    )
    assert resumed.run_id != turn.run_id and resumed.thread_id == turn.chat_id
    assert resumed.run_id is not None
    rest = await _events(client, turn.chat_id, resumed.run_id)
    assert rest[-1].event == "done" and rest[-1].data["data"]["response"] == "thanks"
