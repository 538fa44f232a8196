"""Cancelling a run through the HTTP API: during a model wait, right after the start, inside a
tool call, while paused on a question, racing the run's natural end or a resume; the stream ends
with `cancelled`, every tool call gets its result and the chat takes a next turn.
"""

from __future__ import annotations

import asyncio

from sqlalchemy import select

from services.orchestrator import thread
from services.orchestrator.models import Chat, Interrupt, Message, Run
from tests.conftest import SCRIPTED
from tests.orchestrator.helpers import run_turn, start, wait_for
from tests.orchestrator.questions import ask
from tests.sse_client import read_frames


async def test_cancel_during_model_wait_stops_within_a_second(services):
    async with services.client() as client:
        body = await start(client, {"say": "slow", "sleep_ms": 10_000})
        await wait_for(lambda: services.orchestrator.runner.events.snapshot(body["run_id"]))
        began = asyncio.get_running_loop().time()
        response = await client.post(f"/assistant/chat/{body['chat_id']}/cancel")
        assert response.status_code == 200
        assert response.json() == {
            "status": "cancelled",
            "chat_id": body["chat_id"],
            "run_id": body["run_id"],
        }
        assert asyncio.get_running_loop().time() - began < 1.0
        frames = await read_frames(client, body["stream_url"])
        assert frames[-1] == {"type": "cancelled", "data": {"reason": "cancelled by user"}}
        nxt, again = await run_turn(client, {"say": "fine"}, chat_id=body["chat_id"])
        assert again[-1]["type"] == "done"
    async with services.orchestrator.servicer.sessions() as session:
        assert (await session.get(Run, body["run_id"])).status == "cancelled"
        assert (await session.get(Chat, body["chat_id"])).running_id is None


async def test_cancel_right_after_start_before_first_event(services):
    async with services.client() as client:
        body = await start(client, {"say": "never", "sleep_ms": 5000})
        response = await client.post(f"/assistant/chat/{body['chat_id']}/cancel")
        assert response.status_code == 200
        frames = await read_frames(client, body["stream_url"])
    assert frames[-1]["type"] == "cancelled"


async def test_cancel_with_no_active_run_is_400(services):
    async with services.client() as client:
        body, _ = await run_turn(client, {"say": "x"})
        response = await client.post(f"/assistant/chat/{body['chat_id']}/cancel")
    assert response.status_code == 400
    assert response.json() == {"detail": "No active execution to cancel"}


async def test_cancel_of_paused_run_clears_question_and_flips_audit_row(services):
    async with services.client() as client:
        body, frames = await ask(client, "ask_user_yes_no", {"message": "ok?"})
        request_id = frames[-1]["data"]["request_id"]
        response = await client.post(f"/assistant/chat/{body['chat_id']}/cancel")
        assert response.status_code == 200
        status = (await client.get(f"/assistant/chat/{body['chat_id']}/status")).json()
        assert status["awaiting_input"] is False and status["running_id"] is None
        nxt = await client.post(
            "/assistant/chat", json={"message": "again", "chat_id": body["chat_id"]}
        )
        assert nxt.status_code == 200
        await read_frames(client, nxt.json()["stream_url"])
    async with services.orchestrator.servicer.sessions() as session:
        assert (await session.get(Interrupt, request_id)).outcome == "cancelled"


async def test_cancel_racing_natural_end_leaves_one_outcome(services):
    async with services.client() as client:
        for delay in (0.0, 0.01, 0.03, 0.05):
            body = await start(client, {"say": "quick", "sleep_ms": 30})
            await asyncio.sleep(delay)
            response = await client.post(f"/assistant/chat/{body['chat_id']}/cancel")
            frames = await read_frames(client, body["stream_url"])
            terminal = [f["type"] for f in frames if f["type"] in ("done", "cancelled")]
            assert len(terminal) == 1
            assert (response.status_code == 200) == (terminal[0] == "cancelled")


async def test_cancel_inside_a_tool_call_cancels_the_tool_and_thread_stays_valid(services):
    slow = {
        "tool": "execute_integration_tool",
        "input": {"integration": "loopline", "action": "wait", "parameters": {"seconds": 20}},
    }
    async with services.client() as client:
        body = await start(client, slow, {"say": "never"})
        await wait_for(
            lambda: any(
                e.WhichOneof("payload") == "tool_call"
                for e in services.orchestrator.runner.events.snapshot(body["run_id"])
            )
        )
        began = asyncio.get_running_loop().time()
        assert (await client.post(f"/assistant/chat/{body['chat_id']}/cancel")).status_code == 200
        assert asyncio.get_running_loop().time() - began < 1.0
        frames = await read_frames(client, body["stream_url"])
        assert frames[-1]["type"] == "cancelled"
        # the streamed tool_call gets its tool_result
        assert frames[-2]["type"] == "tool_result" and frames[-2]["data"]["output"] == {
            "error": "cancelled",
            "success": False,
        }
        _, again = await run_turn(client, {"say": "next turn fine"}, chat_id=body["chat_id"])
        assert again[-1]["type"] == "done"
    async with services.orchestrator.servicer.sessions() as session:
        rows = (
            (
                await session.execute(
                    select(Message).where(Message.chat_id == body["chat_id"]).order_by(Message.seq)
                )
            )
            .scalars()
            .all()
        )
    call_id = next(f for f in frames if f["type"] == "tool_call")["data"]["tool_call_id"]
    results = [r for r in rows if r.role == "tool" and r.extra["tool_call_id"] == call_id]
    assert len(results) == 1 and results[0].content == {"error": "cancelled", "success": False}


async def test_a_cancelled_question_gets_its_cancelled_result_in_the_thread_as_the_model_sees_it(
    services,
):
    # GET chat shows the question's tool call with the result the next model call is given
    # ({"error": "not completed"}), not without one
    async with services.client() as client:
        body, frames = await ask(client, "ask_user_yes_no", {"message": "ok?"})
        call_id = next(f for f in frames if f["type"] == "tool_call")["data"]["tool_call_id"]
        assert (await client.post(f"/assistant/chat/{body['chat_id']}/cancel")).status_code == 200
        messages = (await client.get(f"/assistant/chat/{body['chat_id']}")).json()["messages"]
        tool = [m for m in messages if m["role"] == "tool"]
        assert [(m["content"], m["thinking"]["tool_call_id"]) for m in tool] == [
            ({"error": "cancelled", "success": False}, call_id)
        ]
        _, more = await run_turn(client, {"say": "fresh start"}, chat_id=body["chat_id"])
        assert more[-1]["type"] == "done" and more[-1]["data"]["response"] == "fresh start"
    async with services.orchestrator.servicer.sessions() as session:
        sent = await thread.load_thread(
            session, body["chat_id"]
        )  # what the next model call is given
    assert [m["content"] for m in sent if m["role"] == "tool"] == [
        {"error": "cancelled", "success": False}
    ]


async def test_cancel_of_a_paused_run_appends_cancelled_to_its_stream(services):
    async with services.client() as client:
        body, frames = await ask(client, "ask_user_yes_no", {"message": "ok?"})
        assert (await client.post(f"/assistant/chat/{body['chat_id']}/cancel")).status_code == 200
        again = await read_frames(client, body["stream_url"])
    assert again[:-1] == frames
    assert again[-1] == {"type": "cancelled", "data": {"reason": "cancelled by user"}}


async def test_a_resume_and_a_cancel_sent_together_never_fail_and_leave_one_consistent_chat(
    services,
):
    """A resume and a cancel of a paused chat sent together never deadlock (PostgreSQL): every
    such transaction takes the chat's row first, then the question's; locked in opposite orders
    they deadlock and one answers 500."""
    # and (replicas) a cancel that comes while the resume commits cancels whichever run is active
    # when it acts, so it is always 200, never 400 "No active execution to cancel" while the
    # resumed run runs on
    async with services.client() as client:
        for _ in range(12):
            body, frames = await run_turn(
                client,
                {
                    "say": "One question.",
                    "tool": "ask_user_yes_no",
                    "input": {"message": "Proceed?"},
                },
                {"say": "Done after yes.", "sleep_ms": 2000},
            )
            request_id = frames[-2]["data"]["request_id"]
            resumed, cancelled = await asyncio.gather(
                client.post(
                    f"/assistant/chat/{body['chat_id']}/resume",
                    json={
                        "request_id": request_id,
                        "response": {"kind": "yes_no", "answer": True},
                        "llm": SCRIPTED,
                    },
                ),
                client.post(f"/assistant/chat/{body['chat_id']}/cancel"),
            )
            assert resumed.status_code in (200, 409), resumed.text
            assert cancelled.status_code == 200, cancelled.text
            if resumed.status_code == 200:
                rest = await read_frames(client, resumed.json()["stream_url"])
                assert rest[-1]["type"] == "cancelled", rest
            await wait_for(lambda chat_id=body["chat_id"]: _free(client, chat_id), timeout=10)


async def _free(client, chat_id: str) -> bool:
    status = (await client.get(f"/assistant/chat/{chat_id}/status")).json()
    return not status["is_running"] and not status["awaiting_input"]
