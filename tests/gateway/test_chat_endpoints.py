"""The chat reads the official SDK calls: get, list, status, delete (SDK
modulex/types/assistant.py)."""

from __future__ import annotations

import base64
import uuid
from typing import Any

from modulex import Modulex
from sqlalchemy import select

from services.orchestrator.models import Chat, Message
from tests.orchestrator.helpers import run_turn, start
from tests.sse_client import read_frames


async def test_get_chat_returns_messages_and_title(services):
    # the title: "the first 50 characters of the opening message" as sent (leading spaces kept)
    message = "   Tell me something about the weather in Paris tomorrow please, thanks a lot!"
    async with services.client() as client:
        body = (await client.post("/assistant/chat", json={"message": message})).json()
        await read_frames(client, body["stream_url"])
        details = (await client.get(f"/assistant/chat/{body['chat_id']}")).json()
    assert details["id"] == body["chat_id"]
    # the spec's shared chat object: its surface discriminator, and never bound to a workflow
    assert details["kind"] == "assistant" and details["workflow_id"] is None
    assert details["title"] == message[:50]
    assert details["running_id"] is None and details["pending_user_input_request"] is None
    assert [m["role"] for m in details["messages"]] == ["user", "assistant"]
    assert details["messages"][0]["content"] == message
    assert details["messages"][1]["running_status"] == "completed"


async def test_list_chats_newest_first_with_cursor(services):
    async with services.client() as client:
        ids = []
        for i in range(5):
            body, _ = await run_turn(client, {"say": f"chat {i}"})
            ids.append(body["chat_id"])
        first = (await client.get("/assistant/chats", params={"limit": 2})).json()
        second = (
            await client.get(
                "/assistant/chats", params={"limit": 2, "cursor": first["next_cursor"]}
            )
        ).json()
        third = (
            await client.get(
                "/assistant/chats", params={"limit": 2, "cursor": second["next_cursor"]}
            )
        ).json()
        assert (await client.get("/assistant/chats", params={"limit": 0})).status_code == 400
        assert (
            await client.get("/assistant/chats", params={"cursor": "garbage!"})
        ).status_code == 400
        # well-formed base64 of what the cursor is not: a NUL in the id (which PostgreSQL
        # cannot store), a naive time, another id
        chat = ids[0].encode()
        for forged in (
            b"2026-12-01T16:26:15.091253+00:00|a\x00b",
            b"2026-12-01T16:26:15.091253|" + chat,
            b"2026-12-01|z",
            b"0001-01-01T00:00:00+00:00|not-a-chat-id",
            b"0001-01-01T00:00:00+14:00|" + chat,
            b"9999-12-31T23:59:59-14:00|" + chat,  # overflow as UTC: 500 on PostgreSQL
            b"2026-12-01T16:45:28\x00+00:00|" + chat,
            b"2026-12-01T16:45:28+05:00|" + chat,
            b"2026-12-01T16:45:28Z|" + chat,
            b"2026-12-01T16:45:28+00:00|{" + chat + b"}",
        ):
            cursor = base64.urlsafe_b64encode(forged).decode()
            refused = await client.get("/assistant/chats", params={"cursor": cursor})
            assert refused.status_code == 400 and refused.json() == {
                "detail": "cursor is not valid"
            }, (forged, refused.text)
    listed = [c["id"] for page in (first, second, third) for c in page["items"]]
    assert listed == list(reversed(ids))
    assert third["next_cursor"] is None
    assert set(first["items"][0]) == {"id", "title", "created_at", "updated_at", "is_running"}


async def test_status_of_idle_and_running_chat(services):
    async with services.client() as client:
        body = await start(client, {"say": "slow", "sleep_ms": 3000})
        running = (await client.get(f"/assistant/chat/{body['chat_id']}/status")).json()
        assert running["is_running"] is True and running["running_id"] == body["run_id"]
        assert running["run_status"]["status"] == "running"
        await client.post(f"/assistant/chat/{body['chat_id']}/cancel")
        idle = (await client.get(f"/assistant/chat/{body['chat_id']}/status")).json()
    assert (
        idle["is_running"] is False
        and idle["awaiting_input"] is False
        and idle["running_id"] is None
    )
    assert idle["run_status"]["status"] == "cancelled"


async def test_delete_soft_then_permanent_and_in_flight_is_409(services):
    async with services.client() as client:
        busy = await start(client, {"say": "slow", "sleep_ms": 3000})
        assert (await client.delete(f"/assistant/chat/{busy['chat_id']}")).status_code == 409
        await client.post(f"/assistant/chat/{busy['chat_id']}/cancel")
        soft = await client.delete(f"/assistant/chat/{busy['chat_id']}")
        assert soft.json() == {"status": "deleted", "chat_id": busy["chat_id"], "permanent": False}
        assert (await client.get(f"/assistant/chat/{busy['chat_id']}")).status_code == 404
        async with services.orchestrator.servicer.sessions() as session:
            assert (await session.get(Chat, busy["chat_id"])) is not None
        other, _ = await run_turn(client, {"say": "x"})
        hard = await client.delete(
            f"/assistant/chat/{other['chat_id']}", params={"permanent": "true"}
        )
        assert hard.json()["permanent"] is True
        assert (await client.delete(f"/assistant/chat/{uuid.uuid4()}")).status_code == 404
    async with services.orchestrator.servicer.sessions() as session:
        assert (
            await session.execute(select(Chat).where(Chat.id == other["chat_id"]))
        ).scalars().first() is None


async def test_a_permanent_delete_removes_the_runs_events_outside_the_database_too(services):
    # after DELETE ?permanent=true the run's Redis stream must not keep its text (for 24 h)
    async with services.client() as client:
        body, _ = await run_turn(
            client, {"tool": "ask_user_yes_no", "input": {"message": "secret question?"}}
        )  # paused: two runs' logs
        await client.post(f"/assistant/chat/{body['chat_id']}/cancel")
        nxt, _ = await run_turn(client, {"say": "secret data"}, chat_id=body["chat_id"])
        events = services.orchestrator.runner.events
        assert await events.events_of(body["run_id"]) and await events.events_of(nxt["run_id"])
        hard = await client.delete(
            f"/assistant/chat/{body['chat_id']}", params={"permanent": "true"}
        )
        assert hard.status_code == 200
        assert (
            await events.events_of(body["run_id"]) == []
            and await events.events_of(nxt["run_id"]) == []
        )
        assert (await client.get(nxt["stream_url"])).status_code == 404


async def test_a_soft_deleted_chat_can_still_be_purged_and_only_by_its_organization(services):
    # ?permanent=true purges a soft-deleted chat too (a 404 would leave it unpurgeable)
    async with services.client() as client:
        body, _ = await run_turn(client, {"say": "x"})
        chat_id = body["chat_id"]
        assert (await client.delete(f"/assistant/chat/{chat_id}")).status_code == 200
        assert (
            await client.delete(f"/assistant/chat/{chat_id}")
        ).status_code == 404  # soft again: gone
        stranger = await services.member("owner", org_id="org_stranger")
        headers = services.headers(api_key=stranger["api_key"], org_id="org_stranger")
        assert (
            await client.delete(
                f"/assistant/chat/{chat_id}", params={"permanent": "true"}, headers=headers
            )
        ).status_code == 404
        purged = await client.delete(f"/assistant/chat/{chat_id}", params={"permanent": "true"})
        assert purged.status_code == 200 and purged.json() == {
            "status": "deleted",
            "chat_id": chat_id,
            "permanent": True,
        }
        assert (
            await client.delete(f"/assistant/chat/{chat_id}", params={"permanent": "true"})
        ).status_code == 404
    async with services.orchestrator.servicer.sessions() as session:
        assert await session.get(Chat, chat_id) is None
        assert (
            await session.execute(select(Message).where(Message.chat_id == chat_id))
        ).scalars().first() is None


async def test_composer_chat_is_404_on_every_assistant_endpoint(services):
    chat_id = str(uuid.uuid4())
    async with services.orchestrator.servicer.sessions() as session, session.begin():
        session.add(
            Chat(
                id=chat_id,
                organization_id=services.org_id,
                user_id=services.user_id,
                kind="composer",
                title="c",
            )
        )
    async with services.client() as client:
        run_id = str(uuid.uuid4())
        requests: list[tuple[str, str, dict[str, Any]]] = [
            ("POST", "/assistant/chat", {"json": {"message": "hi", "chat_id": chat_id}}),
            ("GET", f"/assistant/chat/{chat_id}", {}),
            ("GET", f"/assistant/chat/{chat_id}/status", {}),
            ("GET", f"/assistant/chat/{chat_id}/listen/{run_id}", {}),
            ("POST", f"/assistant/chat/{chat_id}/cancel", {}),
            (
                "POST",
                f"/assistant/chat/{chat_id}/resume",
                {"json": {"request_id": "x", "response": {"kind": "skipped"}}},
            ),
            ("DELETE", f"/assistant/chat/{chat_id}", {}),
        ]
        for method, path, kwargs in requests:
            response = await client.request(method, path, **kwargs)
            assert response.status_code == 404, (path, response.text)
            assert response.json() == {"detail": "Chat not found"}


async def test_sdk_reads_match_its_models(services):
    client = Modulex(
        api_key=services.api_key, organization_id=services.org_id, base_url=services.base_url
    )
    turn = await client.assistant.chat("hello there")
    assert turn.chat_id is not None and turn.run_id is not None
    async with client.assistant.listen(turn.chat_id, turn.run_id) as stream:
        names = [event.event async for event in stream]
    assert names[-1] == "done"
    chat = await client.assistant.get(turn.chat_id)
    assert chat.id == turn.chat_id and len(chat.messages) == 2
    listing = await client.assistant.list(limit=10)
    assert listing.items[0].id == turn.chat_id
    status = await client.assistant.status(turn.chat_id)
    assert status.is_running is False
    deleted = await client.assistant.delete(turn.chat_id)
    assert deleted.status == "deleted"


async def test_paused_chat_is_not_listed_as_running(services):
    async with services.client() as client:
        body, frames = await run_turn(
            client, {"tool": "ask_user_yes_no", "input": {"message": "ok?"}}
        )
        assert frames[-1]["type"] == "interrupted"
        listing = (await client.get("/assistant/chats")).json()
        item = next(i for i in listing["items"] if i["id"] == body["chat_id"])
        status = (await client.get(f"/assistant/chat/{body['chat_id']}/status")).json()
    assert (
        item["is_running"] is False
        and status["is_running"] is False
        and status["awaiting_input"] is True
    )
    assert item["updated_at"] >= item["created_at"]
