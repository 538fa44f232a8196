"""Questions that expire: the chat is free again, a late answer is 409, a cancel is 400 and adds
nothing, and the question's tool call gets its "expired" result in the thread.
"""

from __future__ import annotations

import datetime

from sqlalchemy import select, update

from services.orchestrator import thread
from services.orchestrator.models import Interrupt, Message, Run
from tests.orchestrator.helpers import run_turn
from tests.orchestrator.questions import ask
from tests.sse_client import read_frames


async def test_expired_question_frees_the_chat_and_late_resume_is_409(services):
    async with services.client() as client:
        body, frames = await ask(client, "ask_user_yes_no", {"message": "ok?"})
        request_id = frames[-1]["data"]["request_id"]
        async with services.orchestrator.servicer.sessions() as session, session.begin():
            await session.execute(
                update(Interrupt)
                .where(Interrupt.id == request_id)
                .values(
                    expires_at=datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=1)
                )
            )
        late = await client.post(
            f"/assistant/chat/{body['chat_id']}/resume",
            json={"request_id": request_id, "response": {"kind": "yes_no", "answer": True}},
        )
        assert late.status_code == 409 and "expired" in late.json()["detail"].lower()
        nxt = await client.post(
            "/assistant/chat", json={"message": "new turn", "chat_id": body["chat_id"]}
        )
        assert nxt.status_code == 200
        await read_frames(client, nxt.json()["stream_url"])
    async with services.orchestrator.servicer.sessions() as session:
        assert (await session.get(Interrupt, request_id)).outcome == "expired"


async def _expire(services, request_id: str) -> None:
    async with services.orchestrator.servicer.sessions() as session, session.begin():
        await session.execute(
            update(Interrupt)
            .where(Interrupt.id == request_id)
            .values(expires_at=datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=1))
        )


async def test_the_chat_list_shows_a_chat_whose_question_expired_as_free(services):
    # GET /assistant/chats says is_running: false without waiting for a status, get or resume
    # to look at the chat
    async with services.client() as client:
        body, frames = await ask(client, "ask_user_yes_no", {"message": "ok?"})
        await _expire(services, frames[-1]["data"]["request_id"])
        listed = next(
            c
            for c in (await client.get("/assistant/chats")).json()["items"]
            if c["id"] == body["chat_id"]
        )
        assert listed["is_running"] is False
        status = (await client.get(f"/assistant/chat/{body['chat_id']}/status")).json()
        assert status["is_running"] is False and status["awaiting_input"] is False
    async with services.orchestrator.servicer.sessions() as session:
        assert (await session.get(Interrupt, frames[-1]["data"]["request_id"])).outcome == "expired"
        assert (await session.get(Run, body["run_id"])).status == "expired"


async def test_cancel_of_a_run_whose_question_expired_is_400_and_adds_nothing(services):
    """A cancel of a chat whose question has expired is the spec's 400, also when it is the
    first to look at the chat: the run stays expired and its ended stream gets no `cancelled`
    frame, the same answer as after a status look."""
    async with services.client() as client:
        body, frames = await ask(client, "ask_user_yes_no", {"message": "ok?"})
        await _expire(services, frames[-1]["data"]["request_id"])
        cancel = await client.post(f"/assistant/chat/{body['chat_id']}/cancel")
        assert cancel.status_code == 400 and cancel.json() == {
            "detail": "No active execution to cancel"
        }
        again = await read_frames(client, body["stream_url"])
    assert again == frames
    async with services.orchestrator.servicer.sessions() as session:
        assert (await session.get(Interrupt, frames[-1]["data"]["request_id"])).outcome == "expired"
        assert (await session.get(Run, body["run_id"])).status == "expired"
        rows = (
            (
                await session.execute(
                    select(Message).where(
                        Message.chat_id == body["chat_id"], Message.role == "tool"
                    )
                )
            )
            .scalars()
            .all()
        )
    assert [r.content for r in rows] == [thread.cut_off_result("expired")]


async def test_an_expired_question_gets_its_tool_result_in_the_thread(services):
    # the assistant message's ask_user_yes_no call gets a tool message after it, as a cancel
    # gives one
    async with services.client() as client:
        body, frames = await ask(client, "ask_user_yes_no", {"message": "ok?"})
        call_id = next(f for f in frames if f["type"] == "tool_call")["data"]["tool_call_id"]
        await _expire(services, frames[-1]["data"]["request_id"])
        nxt, _ = await run_turn(client, {"say": "fine"}, chat_id=body["chat_id"])
        messages = (await client.get(f"/assistant/chat/{body['chat_id']}")).json()["messages"]
    calls = [
        m
        for m in messages
        if m["role"] == "tool" and m["content"] == thread.cut_off_result("expired")
    ]
    assert len(calls) == 1
    roles = [m["role"] for m in messages]
    assert roles.index("tool") == roles.index("assistant") + 1  # right after the call
    async with services.orchestrator.servicer.sessions() as session:
        rows = (
            (
                await session.execute(
                    select(Message).where(
                        Message.chat_id == body["chat_id"], Message.role == "tool"
                    )
                )
            )
            .scalars()
            .all()
        )
    assert [r.extra["tool_call_id"] for r in rows] == [call_id]
