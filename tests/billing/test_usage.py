"""RecordUsage: token usage per model call, priced by the table, idempotent, BYOK free."""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import grpc
import pytest
from sqlalchemy import select

from loopline.billing.v1 import billing_pb2 as pb
from services.billing.models import Account, LedgerEntry, UsageRecord
from services.billing.pricing import PriceTable
from services.common.errors import status_details

SHIPPED_PRICES = (
    pathlib.Path(__file__).resolve().parents[2] / "services" / "billing" / "prices.toml"
)


def usage(
    org: str, run_id: str = "run1", call_index: int = 0, **fields: Any
) -> pb.RecordUsageRequest:
    values: dict[str, Any] = {
        "organization_id": org,
        "run_id": run_id,
        "call_index": call_index,
        "chat_id": "chat1",
        "provider_id": "scripted",
        "model_id": "scripted-1",
        "input_tokens": 1000,
        "output_tokens": 500,
    }
    values.update(fields)
    return pb.RecordUsageRequest(**values)


def test_price_table_looks_up_exact_then_provider_then_default_and_rounds_up():
    table = PriceTable.load(SHIPPED_PRICES)
    assert table.price("openai", "gpt-4o-mini").input == 15
    assert table.price("anthropic", "claude-anything") == table.models[("anthropic", "*")]
    assert table.price("nobody", "nothing") == table.default
    # scripted: 10 mc/1k input, 20 mc/1k output, 1 mc/1k cache read, 10 mc/1k cache write
    assert table.millicredits("scripted", "x", input_tokens=1000, output_tokens=500) == 20
    assert table.millicredits("scripted", "x", input_tokens=1, output_tokens=0) == 1  # 0.01 -> 1
    assert (
        table.millicredits(
            "scripted",
            "x",
            input_tokens=0,
            output_tokens=0,
            cache_read_tokens=2000,
            cache_write_tokens=1000,
        )
        == 12
    )
    assert (
        table.millicredits("openai", "gpt-4o", input_tokens=10**6, output_tokens=10**6, byok=True)
        == 0
    )


async def test_record_usage_prices_the_call_and_posts_it_once(server, stub, org):
    first = await stub.RecordUsage(usage(org))
    assert (first.millicredits, first.replayed) == (20, False)
    again = await stub.RecordUsage(usage(org))
    assert (again.usage_id, again.millicredits, again.replayed) == (first.usage_id, 20, True)
    async with server.store.sessions() as session:
        entries = (
            (await session.execute(select(LedgerEntry).where(LedgerEntry.org_id == org)))
            .scalars()
            .all()
        )
        account = await session.get(Account, org)
    assert [(e.idempotency_key, e.kind, e.unit, e.amount, e.usage_id) for e in entries] == [
        ("usage:run1:0", "token_usage", "millicredit", -20, first.usage_id)
    ]
    assert account.usage_millicredits == 20
    assert account.allowance_used == 0  # token usage is independent of the run credit


async def test_parallel_duplicate_usage_reports_record_once(server, stub, org):
    results = await asyncio.gather(*(stub.RecordUsage(usage(org, call_index=3)) for _ in range(10)))
    assert len({r.usage_id for r in results}) == 1
    assert sum(not r.replayed for r in results) == 1
    async with server.store.sessions() as session:
        account = await session.get(Account, org)
    assert account.usage_millicredits == 20


async def test_byok_usage_is_recorded_with_zero_credits(server, stub, org):
    result = await stub.RecordUsage(
        usage(
            org,
            provider_id="openai",
            model_id="gpt-4o",
            input_tokens=5000,
            cache_read_tokens=100,
            byok=True,
            estimated=True,
        )
    )
    assert result.millicredits == 0
    async with server.store.sessions() as session:
        record = await session.get(UsageRecord, result.usage_id)
        entries = (
            (await session.execute(select(LedgerEntry).where(LedgerEntry.org_id == org)))
            .scalars()
            .all()
        )
        account = await session.get(Account, org)
    assert (record.byok, record.estimated, record.input_tokens, record.cache_read_tokens) == (
        True,
        True,
        5000,
        100,
    )
    assert (record.provider_id, record.model_id, record.chat_id) == ("openai", "gpt-4o", "chat1")
    assert entries == [] and account.usage_millicredits == 0


async def test_usage_key_of_another_org_is_already_exists(stub, org):
    await stub.RecordUsage(usage(org, run_id="shared"))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.RecordUsage(usage("someone-else", run_id="shared"))
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert status_details(caught.value).reason == "USAGE_KEY_REUSED"


async def test_counts_and_costs_past_their_bounds_are_refused_and_later_charges_still_post(
    server, stub, org
):
    """One call's token counts are at most 10**9 (the orchestrator's own clamp) and one tool
    call's cost at most 10**12 millicredits. Larger values (2**63-1) would overflow the bigint
    usage sum on PostgreSQL, failing every later charge of the organization, and SQLite."""
    too_large = [
        stub.RecordUsage(usage(org, run_id="big-tokens", input_tokens=10**9 + 1)),
        stub.RecordUsage(usage(org, run_id="huge-tokens", output_tokens=2**63 - 1)),
        stub.RecordToolUsage(
            pb.RecordToolUsageRequest(
                organization_id=org, run_id="r", tool_call_id="c1", tool="t", millicredits=2**63 - 1
            )
        ),
        stub.RecordUsageBatch(
            pb.RecordUsageBatchRequest(
                calls=[usage(org, run_id="in-batch", cache_read_tokens=10**10)]
            )
        ),
    ]
    for call in too_large:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert status_details(caught.value).reason == "USAGE_TOO_LARGE"
    assert (
        await stub.RecordUsage(usage(org, run_id="at-the-bound", input_tokens=10**9))
    ).millicredits > 0
    posted = await stub.RecordToolUsage(
        pb.RecordToolUsageRequest(
            organization_id=org, run_id="r", tool_call_id="c2", tool="t", millicredits=10**12
        )
    )
    assert posted.ledger_entry_id
    later = await stub.RecordToolUsage(
        pb.RecordToolUsageRequest(
            organization_id=org, run_id="r", tool_call_id="c3", tool="t", millicredits=100
        )
    )
    assert later.ledger_entry_id


async def test_negative_token_counts_are_invalid_argument(stub, org):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.RecordUsage(usage(org, input_tokens=-1))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
