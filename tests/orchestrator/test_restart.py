"""State survives restarts: pending questions, completed runs and their events (issues 4 and 8)."""

from __future__ import annotations

from services.billing.config import BillingSettings
from services.billing.server import BillingServer
from services.gateway.server import GatewayServer
from services.orchestrator.server import OrchestratorServer
from services.tools.config import ToolsSettings
from services.tools.server import ToolsServer
from tests.orchestrator.helpers import run_turn
from tests.sse_client import read_frames


async def _restart_all(stack) -> None:
    """Stop every service of the stack and start it again on the same databases (new ports)."""
    orchestrator_settings = stack.orchestrator.settings
    gateway_settings = stack.gateway.settings
    await stack.gateway.stop(1)
    await stack.orchestrator.stop(1)
    await stack.tools.stop(1)
    await stack.billing.stop(1)
    common = {k: getattr(orchestrator_settings, k) for k in ("data_dir", "host", "redis_url", "log_level", "shutdown_grace_s")}
    stack.billing = await BillingServer.start(BillingSettings(**common, billing_port=0, auto_migrate=False))
    stack.tools = await ToolsServer.start(ToolsSettings(**common, tools_port=0, auto_migrate=False))
    stack.orchestrator = await OrchestratorServer.start(orchestrator_settings.model_copy(update={
        "billing_addr": f"127.0.0.1:{stack.billing.port}", "tools_addr": f"127.0.0.1:{stack.tools.port}"}))
    stack.gateway = await GatewayServer.start(gateway_settings.model_copy(update={
        "orchestrator_addr": f"127.0.0.1:{stack.orchestrator.port}", "tools_addr": f"127.0.0.1:{stack.tools.port}"}))


async def test_pending_question_and_finished_runs_survive_a_restart_of_every_service(stack):
    if stack.orchestrator.settings.redis_url or "postgresql" in stack.orchestrator.settings.database_url:
        import pytest

        pytest.skip("restarts the embedded backend in place")
    async with stack.client() as client:
        done_body, done_frames = await run_turn(client, {"say": "finished before the restart", "tool": "get_available_integrations", "input": {}}, {"say": "ok"})
        body, frames = await run_turn(client, {"tool": "ask_user_yes_no", "input": {"message": "Proceed?"}}, {"say": "resumed after restart"})
        request_id = frames[-1]["data"]["request_id"]
    await _restart_all(stack)
    async with stack.client() as client:
        status = (await client.get(f"/assistant/chat/{body['chat_id']}/status")).json()
        assert status["awaiting_input"] is True and status["pending_request_id"] == request_id
        details = (await client.get(f"/assistant/chat/{body['chat_id']}")).json()
        assert details["pending_user_input_request"]["request_id"] == request_id
        assert await read_frames(client, done_body["stream_url"]) == done_frames
        assert await read_frames(client, body["stream_url"]) == frames
        resumed = await client.post(f"/assistant/chat/{body['chat_id']}/resume", json={"request_id": request_id, "response": {"kind": "yes_no", "answer": True}})
        assert resumed.status_code == 200, resumed.text
        rest = await read_frames(client, resumed.json()["stream_url"])
    assert rest[-1]["type"] == "done" and rest[-1]["data"]["response"] == "resumed after restart"
