"""RecordUsageBatch: several model calls' usage in one call, each exactly as RecordUsage."""

from __future__ import annotations

from sqlalchemy import select

from loopline.billing.v1 import billing_pb2 as pb
from services.billing.models import LedgerEntry
from tests.billing.test_usage import usage


async def test_batch_records_each_call_once_in_order_and_replays(server, stub, org):
    calls = [
        usage(org, "runA", 0),
        usage(org, "runA", 1, output_tokens=1000),
        usage(org, "runB", 0),
    ]
    first = await stub.RecordUsageBatch(pb.RecordUsageBatchRequest(calls=calls))
    assert [(r.millicredits, r.replayed) for r in first.results] == [
        (20, False),
        (30, False),
        (20, False),
    ]
    single = await stub.RecordUsage(usage(org, "runA", 1, output_tokens=1000))
    assert (single.usage_id, single.replayed) == (first.results[1].usage_id, True)
    again = await stub.RecordUsageBatch(pb.RecordUsageBatchRequest(calls=calls))
    assert [r.usage_id for r in again.results] == [r.usage_id for r in first.results]
    assert all(r.replayed for r in again.results)
    async with server.store.sessions() as session:
        keys = sorted(
            (
                await session.execute(
                    select(LedgerEntry.idempotency_key).where(LedgerEntry.org_id == org)
                )
            ).scalars()
        )
    assert keys == ["usage:runA:0", "usage:runA:1", "usage:runB:0"]


async def test_empty_batch_is_an_empty_result(stub):
    assert list((await stub.RecordUsageBatch(pb.RecordUsageBatchRequest())).results) == []


async def test_a_batch_is_one_transaction_on_sqlite(server, stub, org, monkeypatch):
    """Seventh round (docs/performance.md): a SQLite batch ran each call as its own transaction
    (gathered), so the batches of stored run ends (~15 runs' records) cost ~30 transactions."""
    store = server.store
    if store.db.dialect == "postgresql":
        return  # PostgreSQL: one statement per organization (test_single_statements.py)
    await stub.RecordUsage(
        usage(org, "first", 0)
    )  # the account exists (its own transaction, once per process)
    transactions = []
    run = store.db.run

    async def counted(fn, *args, **kwargs):
        transactions.append(fn)
        return await run(fn, *args, **kwargs)

    monkeypatch.setattr(store.db, "run", counted)
    calls = [usage(org, f"run{n}", i) for n in range(5) for i in range(2)]
    answer = await stub.RecordUsageBatch(pb.RecordUsageBatchRequest(calls=calls))
    assert len(answer.results) == 10 and not any(r.replayed for r in answer.results)
    assert len(transactions) == 1
    again = await stub.RecordUsageBatch(
        pb.RecordUsageBatchRequest(calls=calls[:1] + [usage(org, "runX", 0)])
    )
    assert [r.replayed for r in again.results] == [True, False] and again.results[
        0
    ].usage_id == answer.results[0].usage_id
