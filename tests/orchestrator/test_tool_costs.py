"""Integration actions are charged their catalogue cost with billing, once per tool call."""

from __future__ import annotations

import grpc
from sqlalchemy import select

from loopline.billing.v1 import billing_pb2, billing_pb2_grpc
from loopline.tools.v1 import tools_pb2, tools_pb2_grpc
from services.billing.models import LedgerEntry
from tests.orchestrator.helpers import run_turn


async def test_integration_action_cost_is_charged_once(services_with_private_network):
    async with grpc.aio.insecure_channel(
        f"127.0.0.1:{services_with_private_network.tools.port}"
    ) as channel:
        await tools_pb2_grpc.ToolsServiceStub(channel).CreateCredential(
            tools_pb2.CreateCredentialRequest(
                organization_id=services_with_private_network.org_id,
                integration_name="postgresql",
                auth_data={"dsn": "postgresql://postgres@127.0.0.1:5432/test?sslmode=disable"},
            )
        )
    call = {
        "tool": "execute_integration_tool",
        "input": {"integration": "postgresql", "action": "list_schemas", "parameters": {}},
        "tool_call_id": "call_pg1",
    }
    free = {
        "tool": "execute_integration_tool",
        "input": {"integration": "loopline", "action": "echo", "parameters": {"message": "hi"}},
    }
    async with services_with_private_network.client() as client:
        body, frames = await run_turn(client, call, free, {"say": "done"})
    results = [f["data"]["output"] for f in frames if f["type"] == "tool_result"]
    assert results[0].get("success") is not False, results[0]
    async with services_with_private_network.billing.store.sessions() as session:
        entries = (
            (
                await session.execute(
                    select(LedgerEntry).where(
                        LedgerEntry.org_id == services_with_private_network.org_id,
                        LedgerEntry.kind == "tool_usage",
                    )
                )
            )
            .scalars()
            .all()
        )
    assert [(e.idempotency_key, e.amount, e.unit) for e in entries] == [
        (f"tool:{body['run_id']}:call_pg1", -100, "millicredit")
    ]
    assert "postgresql.list_schemas" in entries[0].note
    async with grpc.aio.insecure_channel(
        f"127.0.0.1:{services_with_private_network.billing.port}"
    ) as channel:
        replay = await billing_pb2_grpc.BillingServiceStub(channel).RecordToolUsage(
            billing_pb2.RecordToolUsageRequest(
                organization_id=services_with_private_network.org_id,
                run_id=body["run_id"],
                tool_call_id="call_pg1",
                tool="execute_integration_tool",
                millicredits=100,
            )
        )
    assert replay.replayed is True and replay.ledger_entry_id == entries[0].id


async def test_a_stalled_billing_holds_a_run_up_seconds_not_a_deadline_per_call_and_loses_nothing(
    services_with_private_network, monkeypatch
):
    """With billing stalled, a run is held up seconds, not a deadline per billing call, as
    the README promises: the quick attempts of a call take 2 s in all, the tool charge is sent
    beside the run (which waits for it at its end, with its usage records), and what billing
    does not take is stored and sent once billing answers again."""
    import asyncio
    import time

    from sqlalchemy import func

    from services.billing.models import UsageRecord
    from services.orchestrator.models import BillingRedelivery
    from tests.orchestrator.helpers import wait_for

    async with grpc.aio.insecure_channel(
        f"127.0.0.1:{services_with_private_network.tools.port}"
    ) as channel:
        await tools_pb2_grpc.ToolsServiceStub(channel).CreateCredential(
            tools_pb2.CreateCredentialRequest(
                organization_id=services_with_private_network.org_id,
                integration_name="postgresql",
                auth_data={"dsn": "postgresql://postgres@127.0.0.1:5432/test?sslmode=disable"},
            )
        )
    stalled = asyncio.Event()

    async def hang(*_args, **_kwargs):
        await stalled.wait()

    ledger = services_with_private_network.billing.ledger
    monkeypatch.setattr(ledger, "record_usage_batch", hang)
    monkeypatch.setattr(ledger, "record_tool_usage", hang)
    call = {
        "say": "looking",
        "tool": "execute_integration_tool",
        "tool_call_id": "call_pg2",
        "input": {"integration": "postgresql", "action": "list_schemas", "parameters": {}},
    }
    started = time.monotonic()
    async with services_with_private_network.client() as client:
        body, frames = await run_turn(client, call, {"say": "done"})
    held = time.monotonic() - started
    assert frames[-1]["type"] == "done"
    # two model calls and a tool charge: ~2 s (the quick attempts of each, side by side), not the
    # sum of every attempt's deadline (> 30 s)
    assert held < 8, held
    async with services_with_private_network.orchestrator.runner.sessions() as session:
        stored = sorted((await session.execute(select(BillingRedelivery.method))).scalars().all())
    assert stored == ["RecordToolUsage", "RecordUsageBatch"] or stored == [
        "RecordToolUsage",
        "RecordUsageBatch",
        "RecordUsageBatch",
    ]
    monkeypatch.undo()  # billing answers again: the stored calls are sent in the background

    async def delivered() -> bool:
        async with services_with_private_network.billing.store.sessions() as session:
            tool = await session.scalar(
                select(func.count())
                .select_from(LedgerEntry)
                .where(LedgerEntry.idempotency_key == f"tool:{body['run_id']}:call_pg2")
            )
            usage = await session.scalar(
                select(func.count())
                .select_from(UsageRecord)
                .where(UsageRecord.run_id == body["run_id"])
            )
        return tool == 1 and usage == 2

    await wait_for(delivered, timeout=15)
    stalled.set()
