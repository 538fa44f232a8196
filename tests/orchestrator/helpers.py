"""Helpers for driving turns through the HTTP API in tests."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.conftest import script
from tests.sse_client import read_frames


async def start(
    client, *steps: dict[str, Any], chat_id: str | None = None, message: str | None = None
) -> dict[str, Any]:
    """POST /assistant/chat with a scripted message; asserts 200 and returns the body."""
    body: dict[str, Any] = {"message": message if message is not None else script(*steps)}
    if chat_id:
        body["chat_id"] = chat_id
    response = await client.post("/assistant/chat", json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def run_turn(
    client, *steps: dict[str, Any], chat_id: str | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Start a scripted turn and read its whole stream; returns (start body, frames)."""
    body = await start(client, *steps, chat_id=chat_id)
    return body, await read_frames(client, body["stream_url"])


async def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02) -> None:
    """Poll `predicate()` (sync or async) until it is truthy; AssertionError after `timeout` s."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(interval)


async def billing_delivered(services, timeout: float = 10.0) -> None:
    """Wait until the billing calls the stack's turns stored are with billing: the run charges
    stored with their starts and the usage stored with their ends (the orchestrator's
    `billing_redeliveries` is empty; `StoredBatches` sends them ~0.2 s after their commit)."""
    from sqlalchemy import func, select

    from services.orchestrator.models import BillingRedelivery

    async def empty() -> bool:
        async with services.orchestrator.runner.sessions() as session:
            return not await session.scalar(select(func.count()).select_from(BillingRedelivery))

    await wait_for(empty, timeout=timeout)


def types(frames: list[dict[str, Any]]) -> list[str]:
    """The frame types in order."""
    return [f["type"] for f in frames]
