"""GET /assistant/chat/{id} pages its messages (AIP-158) so that a long chat stays readable."""

from __future__ import annotations

from sqlalchemy import select

from services.orchestrator.models import Message
from tests.orchestrator.helpers import run_turn
from tests.sse_client import read_frames


async def _turns(client, chat_id: str | None, count: int, size: int) -> str:
    for index in range(count):
        body = {"message": f"{index} " + "word " * (size // 5)}
        if chat_id:
            body["chat_id"] = chat_id
        started = await client.post("/assistant/chat", json=body)
        assert started.status_code == 200, started.text
        chat_id = started.json()["chat_id"]
        await read_frames(client, started.json()["stream_url"])
    assert chat_id is not None  # `count` is at least 1
    return chat_id


async def test_a_chat_larger_than_a_page_is_read_page_by_page_and_nothing_is_lost(services):
    """The newest messages come first within 3 MiB; next_page_token leads to the older ones.
    So a chat of many large turns (9 of ~950 KB) stays readable: in one answer it would pass
    the gRPC message limit and GET /assistant/chat/{id} would be 500 for good."""
    async with services.client() as client:
        chat_id = await _turns(client, None, 5, 900_000)
        first = await client.get(f"/assistant/chat/{chat_id}")
        assert first.status_code == 200, first.text
        page = first.json()
        assert "next_page_token" in page and 0 < len(page["messages"]) < 10
        assert len(first.content) < 4 * 1024 * 1024
        messages = page["messages"]
        while "next_page_token" in page:
            older = await client.get(
                f"/assistant/chat/{chat_id}", params={"page_token": page["next_page_token"]}
            )
            assert older.status_code == 200, older.text
            page = older.json()
            messages = page["messages"] + messages
    async with services.orchestrator.servicer.sessions() as session:
        stored = (
            (
                await session.execute(
                    select(Message.id)
                    .where(Message.chat_id == chat_id, Message.role.not_in(("marker", "system")))
                    .order_by(Message.seq)
                )
            )
            .scalars()
            .all()
        )
    assert [m["id"] for m in messages] == stored  # every message once, oldest first
    assert [m["content"].split(" ", 1)[0] for m in messages if m["role"] == "user"] == [
        "0",
        "1",
        "2",
        "3",
        "4",
    ]


async def test_page_size_pages_a_small_chat_and_a_chat_that_fits_has_no_token(services):
    async with services.client() as client:
        body, _ = await run_turn(client, {"say": "one"})
        _, _ = await run_turn(client, {"say": "two"}, chat_id=body["chat_id"])
        whole = (await client.get(f"/assistant/chat/{body['chat_id']}")).json()
        assert "next_page_token" not in whole and len(whole["messages"]) == 4
        newest = (
            await client.get(f"/assistant/chat/{body['chat_id']}", params={"page_size": 3})
        ).json()
        assert newest["messages"] == whole["messages"][1:] and newest["next_page_token"]
        rest = (
            await client.get(
                f"/assistant/chat/{body['chat_id']}",
                params={"page_size": 3, "page_token": newest["next_page_token"]},
            )
        ).json()
        assert rest["messages"] == whole["messages"][:1] and "next_page_token" not in rest
        other, _ = await run_turn(client, {"say": "elsewhere"})
        for params in (
            {"page_token": "bm9wZQ"},
            {"page_token": newest["next_page_token"], "x": "1"},
            {"page_size": 1001},
            {"page_size": -1},
        ):
            target = other["chat_id"] if "x" in params else body["chat_id"]
            params = {k: v for k, v in params.items() if k != "x"}
            refused = await client.get(f"/assistant/chat/{target}", params=params)
            assert refused.status_code == 400, (params, refused.text)
