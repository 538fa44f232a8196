"""Summarization keeps a long thread inside the model's context; cuts fall between turns."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from services.orchestrator.models import Message
from services.orchestrator.thread import load_thread
from tests.conftest import script, start_stack, stop_stack
from tests.orchestrator.helpers import run_turn, start
from tests.sse_client import read_frames


@pytest.fixture
async def small_context(tmp_path):
    running = await start_stack(
        tmp_path,
        orchestrator={"summarization_budget_tokens": 400, "summarization_keep_tokens": 150},
    )
    try:
        yield running
    finally:
        await stop_stack(running)


async def test_long_thread_is_summarized_between_turns_and_keeps_working(small_context):
    stack = small_context
    chat_id = None
    async with stack.client() as client:
        for turn in range(6):
            body = await start(
                client,
                {
                    "say": f"answer {turn} " + "words " * 40,
                    "tool": "get_available_integrations",
                    "input": {},
                },
                {"say": f"final {turn}"},
                chat_id=chat_id,
            )
            chat_id = body["chat_id"]
            frames = await read_frames(client, body["stream_url"])
            assert frames[-1]["type"] == "done", frames[-1]
    async with stack.orchestrator.servicer.sessions() as session:
        rows = list(
            (
                await session.execute(
                    select(Message).where(Message.chat_id == chat_id).order_by(Message.seq)
                )
            ).scalars()
        )
        assert chat_id is not None
        thread = await load_thread(session, chat_id)
    summaries = [r for r in rows if r.role == "summary"]
    assert summaries, "no summary was written"
    by_seq = {r.seq: i for i, r in enumerate(rows)}
    for summary in summaries:
        covered = summary.extra["covers_until_seq"]
        following = [r for r in rows[by_seq[covered] + 1 :] if r.role != "summary"]
        assert following[0].role == "user", "a cut fell inside a turn"
    assert thread[0]["role"] == "system" and thread[0]["content"].startswith(
        "Summary of the earlier conversation"
    )
    assert thread[1]["role"] == "user"
    call_ids = [
        c["id"] for m in thread if m["role"] == "assistant" for c in m.get("tool_calls", [])
    ]
    result_ids = [m["tool_call_id"] for m in thread if m["role"] == "tool"]
    assert call_ids == result_ids


async def test_summary_model_call_counts_in_usage(small_context):
    stack = small_context
    async with stack.client() as client:
        body, _ = await run_turn(client, {"say": "x " * 200})
        second, frames = await run_turn(client, {"say": "y " * 200}, chat_id=body["chat_id"])
        third, frames = await run_turn(client, {"say": "z"}, chat_id=body["chat_id"])
    assert frames[-1]["data"]["usage"]["llm_calls"] == 2
    async with stack.orchestrator.servicer.sessions() as session:
        summaries = (
            (
                await session.execute(
                    select(Message).where(
                        Message.chat_id == body["chat_id"], Message.role == "summary"
                    )
                )
            )
            .scalars()
            .all()
        )
    assert len(summaries) == 1 and summaries[0].run_id == third["run_id"]


def test_script_helper_is_json():
    assert script({"say": "x"}).startswith('{"script"')
