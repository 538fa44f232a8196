"""Integration actions are charged their catalogue cost with billing, once per tool call (issue 5)."""

from __future__ import annotations

import grpc
import pytest
from sqlalchemy import select

from loopline.billing.v1 import billing_pb2, billing_pb2_grpc
from loopline.tools.v1 import tools_pb2, tools_pb2_grpc
from services.billing.models import LedgerEntry
from tests.conftest import start_stack, stop_stack
from tests.orchestrator.helpers import run_turn


@pytest.fixture
async def stack(tmp_path):
    """A stack whose operator allows private addresses (the test database is on loopback)."""
    running = await start_stack(tmp_path, tools={"tools_allow_private_network": True})
    try:
        yield running
    finally:
        await stop_stack(running)


async def test_integration_action_cost_is_charged_once(stack):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.tools.port}") as channel:
        await tools_pb2_grpc.ToolsServiceStub(channel).CreateCredential(tools_pb2.CreateCredentialRequest(
            organization_id=stack.org_id, integration_name="postgresql", auth_data={"dsn": "postgresql://postgres@127.0.0.1:5432/test"}))
    call = {"tool": "execute_integration_tool", "input": {"integration": "postgresql", "action": "list_schemas", "parameters": {}}, "tool_call_id": "call_pg1"}
    free = {"tool": "execute_integration_tool", "input": {"integration": "loopline", "action": "echo", "parameters": {"message": "hi"}}}
    async with stack.client() as client:
        body, frames = await run_turn(client, call, free, {"say": "done"})
    results = [f["data"]["output"] for f in frames if f["type"] == "tool_result"]
    assert results[0].get("success") is not False, results[0]
    async with stack.billing.core.sessions() as session:
        entries = (await session.execute(select(LedgerEntry).where(LedgerEntry.org_id == stack.org_id, LedgerEntry.kind == "tool_usage"))).scalars().all()
    assert [(e.idempotency_key, e.amount, e.unit) for e in entries] == [(f"tool:{body['run_id']}:call_pg1", -100, "millicredit")]
    assert "postgresql.list_schemas" in entries[0].note
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.billing.port}") as channel:
        replay = await billing_pb2_grpc.BillingServiceStub(channel).RecordToolUsage(billing_pb2.RecordToolUsageRequest(
            organization_id=stack.org_id, run_id=body["run_id"], tool_call_id="call_pg1", tool="execute_integration_tool", millicredits=100))
    assert replay.replayed is True and replay.ledger_entry_id == entries[0].id
