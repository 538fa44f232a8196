"""A request the gateway's graceful shutdown cuts off is answered 503 with Retry-After."""

from __future__ import annotations

import asyncio

from services.orchestrator.servicer import AssistantServicer
from tests.conftest import start_stack


async def test_a_turn_start_still_unanswered_when_the_grace_runs_out_is_503_json_with_retry_after(
    tmp_path, monkeypatch
):
    """With the orchestrator stalled, a POST in flight when the gateway stops is answered 503
    JSON with Retry-After once the grace runs out, not uvicorn's plain-text 500."""
    stalled = asyncio.Event()

    async def start_turn(self, request, context):  # noqa: ANN001
        await stalled.wait()

    monkeypatch.setattr(AssistantServicer, "StartTurn", start_turn)
    stack = await start_stack(tmp_path, gateway={"shutdown_grace_s": 1.0})
    try:
        async with stack.client() as client:
            posting = asyncio.create_task(client.post("/assistant/chat", json={"message": "hi"}))
            await asyncio.sleep(0.5)
            await stack.gateway.stop(1)
            response = await asyncio.wait_for(posting, 10)
        assert response.status_code == 503, (response.status_code, response.headers, response.text)
        assert (
            response.headers["content-type"] == "application/json"
            and response.headers["retry-after"] == "1"
        )
        assert response.json() == {"detail": "Service temporarily unavailable; try again"}
    finally:
        stalled.set()
        await stack.orchestrator.stop(1)
        await stack.tools.stop(1)
        await stack.billing.stop(1)
