"""A cut-off answer is kept: the text a run streamed before a cancel or a model failure is its
assistant message, marked `thinking.cut_off`; and the scripted model's `chunk_ms`."""

from __future__ import annotations

import asyncio

import pytest

from services.orchestrator import thread
from services.orchestrator.providers.base import ModelError
from services.orchestrator.providers.scripted import ScriptedModel
from tests.orchestrator.helpers import run_turn, start, types
from tests.sse_client import read_frames

SLOW_ANSWER = {"say": "one two three four five six seven eight", "chunks": 8, "chunk_ms": 300}


def _streamed(frames: list[dict]) -> str:
    """The text of a run's `response_chunk` frames, joined."""
    return "".join(f["data"]["chunk"] for f in frames if f["type"] == "response_chunk")


async def _cancel_after_two_chunks(client, body: dict) -> list[dict]:
    """Wait for the run's first two `response_chunk` frames, cancel it, return its whole stream."""
    first = await read_frames(client, body["stream_url"], limit=3)
    assert types(first) == ["metadata", "response_chunk", "response_chunk"], first
    response = await client.post(f"/assistant/chat/{body['chat_id']}/cancel")
    assert response.status_code == 200, response.text
    frames = await read_frames(client, body["stream_url"])
    assert frames[-1]["type"] == "cancelled"
    return frames


def _assistant_messages(chat: dict, run_id: str) -> list[dict]:
    return [m for m in chat["messages"] if m["role"] == "assistant" and m["run_id"] == run_id]


async def test_a_cancelled_answer_is_kept_with_the_streamed_text_marked_cancelled(services):
    async with services.client() as client:
        body = await start(client, SLOW_ANSWER)
        frames = await _cancel_after_two_chunks(client, body)
        chat = (await client.get(f"/assistant/chat/{body['chat_id']}")).json()
    streamed = _streamed(frames)
    assert streamed.startswith("one two ") and streamed != SLOW_ANSWER["say"]
    [message] = _assistant_messages(chat, body["run_id"])
    assert message["content"] == streamed
    assert message["thinking"] == {"cut_off": "cancelled"}
    assert message["running_status"] == "cancelled"


async def test_the_next_turn_is_given_the_cancelled_answer_as_a_plain_assistant_message(services):
    async with services.client() as client:
        body = await start(client, SLOW_ANSWER)
        frames = await _cancel_after_two_chunks(client, body)
        _, more = await run_turn(client, {"say": "fresh start"}, chat_id=body["chat_id"])
        assert more[-1]["type"] == "done" and more[-1]["data"]["response"] == "fresh start"
    async with services.orchestrator.servicer.sessions() as session:
        sent = await thread.load_thread(
            session, body["chat_id"]
        )  # what the next model call is given
    assert [m["role"] for m in sent] == ["user", "assistant", "user", "assistant"]
    assert sent[1] == {"role": "assistant", "content": _streamed(frames), "tool_calls": []}


async def test_a_failed_answer_is_kept_with_the_streamed_text_marked_failed(services, monkeypatch):
    async def breaks_mid_stream(self, messages, tools, on_text, *, call_tools=True):  # noqa: ANN001, ARG001
        for chunk in ("Half of ", "an answer"):
            await on_text(chunk)
        raise ModelError("scripted model failed: the stream broke")

    async with services.client() as client:
        monkeypatch.setattr(ScriptedModel, "generate", breaks_mid_stream)
        body, frames = await run_turn(client, {"say": "never used"})
        monkeypatch.undo()
        assert types(frames) == ["metadata", "response_chunk", "response_chunk", "error", "done"], (
            frames
        )
        assert frames[-1]["data"]["error"] is True
        _, failed_at_once = await run_turn(
            client, {"fail": "no text first"}, chat_id=body["chat_id"]
        )
        assert types(failed_at_once)[-2:] == ["error", "done"]
        chat = (await client.get(f"/assistant/chat/{body['chat_id']}")).json()
    [message] = _assistant_messages(chat, body["run_id"])
    assert message["content"] == _streamed(frames) == "Half of an answer"
    assert message["thinking"] == {"cut_off": "failed"}
    assert message["running_status"] == "failed"
    assert [m for m in chat["messages"] if m["role"] == "assistant"] == [
        message
    ]  # a call that streamed nothing keeps nothing


@pytest.mark.parametrize("chunk_ms", [600_001, 1e12, -5, "10", True, [1]])
async def test_a_chunk_ms_out_of_its_range_or_type_fails_that_model_call(services, chunk_ms):
    async with services.client() as client:
        body, frames = await asyncio.wait_for(
            run_turn(client, {"say": "one two", "chunk_ms": chunk_ms}), 10
        )
    assert types(frames) == ["metadata", "error", "done"], frames
    assert (
        "chunk_ms must be a number of milliseconds between 0 and 600,000"
        in frames[1]["data"]["message"]
    )
    assert frames[-1]["data"]["error"] is True and frames[-1]["data"]["usage"]["llm_calls"] == 1


async def test_chunk_ms_waits_between_streamed_chunks(services):
    async with services.client() as client:
        began = asyncio.get_running_loop().time()
        _, frames = await run_turn(client, {"say": "one two three", "chunks": 3, "chunk_ms": 250})
        took = asyncio.get_running_loop().time() - began
    assert [f["data"]["chunk"] for f in frames if f["type"] == "response_chunk"] == [
        "one ",
        "two ",
        "three",
    ]
    assert took >= 0.5  # two waits: between the first and second chunk, and the second and third


async def test_a_cancel_during_a_chunk_ms_wait_stops_within_a_second(services):
    async with services.client() as client:
        body = await start(client, {"say": "one two", "chunks": 2, "chunk_ms": 60_000})
        first = await read_frames(client, body["stream_url"], limit=2)
        assert types(first) == ["metadata", "response_chunk"]
        began = asyncio.get_running_loop().time()
        response = await client.post(f"/assistant/chat/{body['chat_id']}/cancel")
        assert response.status_code == 200
        assert asyncio.get_running_loop().time() - began < 1.0
        frames = await read_frames(client, body["stream_url"])
    assert types(frames) == ["metadata", "response_chunk", "cancelled"]
