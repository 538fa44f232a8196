"""The invariants billing's one-statement transactions (PostgreSQL) must keep.

Each test runs on the `server` fixture: SQLite by default, a fresh PostgreSQL database
under `make test-pg` (LOOPLINE_TEST_BACKEND=postgres), where Admit, Charge, Release,
RecordUsage(Batch) and RecordToolUsage are single statements on asyncpg that fall back to
the general transaction for replays, refusals and period rolls.
"""

from __future__ import annotations

import asyncio
import datetime

from sqlalchemy import func, select

from loopline.billing.v1 import billing_pb2 as pb
from services.billing.models import Account, LedgerEntry, UsageRecord
from tests.billing.helpers import admit_request, refusal
from tests.billing.test_usage import usage


async def _account(server, org: str) -> Account:
    async with server.store.sessions() as session:
        account = await session.get(Account, org)
    assert account is not None
    return account


async def _ledger(server, org: str) -> list[tuple[str, int]]:
    async with server.store.sessions() as session:
        rows = await session.execute(
            select(LedgerEntry.idempotency_key, LedgerEntry.amount).where(LedgerEntry.org_id == org)
        )
        return sorted((key, amount) for key, amount in rows)


async def test_twenty_parallel_charges_of_one_hold_post_one_entry_and_answer_it_to_all(
    server, stub, org
):
    await server.admin.set_plan(org, "seven")
    admitted = await stub.Admit(admit_request(org, "t1"))
    answers = await asyncio.gather(
        *(stub.Charge(pb.ChargeRequest(reservation_id=admitted.reservation_id)) for _ in range(20))
    )
    assert len({a.ledger_entry_id for a in answers}) == 1
    assert all(a.state == pb.RESERVATION_STATE_CHARGED for a in answers)
    assert await _ledger(server, org) == [(f"charge:{admitted.reservation_id}", -1)]
    account = await _account(server, org)
    assert (account.allowance_used, account.allowance_reserved) == (1, 0)


async def test_a_wallet_funded_hold_is_charged_in_minor_units_once(server, stub, org):
    await server.admin.set_plan(org, "wallet_only")
    await server.admin.top_up(org, 12, idempotency_key="w")
    first = await stub.Admit(admit_request(org, "w1"))
    second = await stub.Admit(admit_request(org, "w2"))
    denied = await _refusal(stub.Admit(admit_request(org, "w3")))
    assert denied.reason == "WALLET_INSUFFICIENT_FUNDS"
    for reservation in (first, second, first):
        await stub.Charge(pb.ChargeRequest(reservation_id=reservation.reservation_id))
    account = await _account(server, org)
    assert (
        account.wallet_balance_minor,
        account.wallet_reserved_minor,
        account.allowance_used,
    ) == (2, 0, 0)
    charges = [entry for entry in await _ledger(server, org) if entry[0].startswith("charge:")]
    assert sorted(amount for _, amount in charges) == [-5, -5]


async def test_release_gives_the_hold_and_the_quota_slot_back_once(server, stub, org):
    await server.admin.set_plan(org, "two_a_day")
    first = await stub.Admit(admit_request(org, "q1"))
    await stub.Admit(admit_request(org, "q2"))
    assert (await _refusal(stub.Admit(admit_request(org, "q3")))).reason == "QUOTA_EXCEEDED"
    answers = await asyncio.gather(
        *(
            stub.Release(pb.ReleaseRequest(reservation_id=first.reservation_id, reason="test"))
            for _ in range(5)
        )
    )
    assert all(a.state == pb.RESERVATION_STATE_RELEASED for a in answers)
    account = await _account(server, org)
    assert (account.allowance_reserved, account.runs_today) == (1, 1)
    await stub.Admit(admit_request(org, "q3"))
    assert (await _account(server, org)).runs_today == 2


async def test_a_hold_opened_last_month_is_charged_to_the_new_period(server, stub, org):
    await server.admin.set_plan(org, "seven")
    admitted = await stub.Admit(admit_request(org, "m1"))
    next_month = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=32)
    server.store.clock = lambda: next_month
    charged = await stub.Charge(pb.ChargeRequest(reservation_id=admitted.reservation_id))
    assert charged.state == pb.RESERVATION_STATE_CHARGED
    account = await _account(server, org)
    assert account.period_start == next_month.date().replace(day=1)
    assert (account.allowance_used, account.allowance_reserved) == (1, 0)


async def test_a_batch_repeating_a_key_records_it_once_and_its_replay_changes_nothing(
    server, stub, org
):
    calls = [
        usage(org, "runR", 0),
        usage(org, "runR", 1, output_tokens=1000),
        usage(org, "runR", 0),
    ]
    first = await stub.RecordUsageBatch(pb.RecordUsageBatchRequest(calls=calls))
    assert [(r.millicredits, r.replayed) for r in first.results] == [
        (20, False),
        (30, False),
        (20, True),
    ]
    assert first.results[2].usage_id == first.results[0].usage_id
    again = await stub.RecordUsageBatch(pb.RecordUsageBatchRequest(calls=calls))
    assert [r.usage_id for r in again.results] == [r.usage_id for r in first.results]
    assert all(r.replayed for r in again.results)
    assert (await _account(server, org)).usage_millicredits == 50
    assert await _ledger(server, org) == [("usage:runR:0", -20), ("usage:runR:1", -30)]
    async with server.store.sessions() as session:
        count = (
            await session.execute(
                select(func.count()).select_from(UsageRecord).where(UsageRecord.org_id == org)
            )
        ).scalar_one()
    assert count == 2


async def test_a_batch_of_two_organizations_adds_each_its_own_usage(server, stub, org):
    other = f"{org}_b"
    calls = [usage(org, "runO", 0), usage(other, "runP", 0, output_tokens=1000)]
    results = (await stub.RecordUsageBatch(pb.RecordUsageBatchRequest(calls=calls))).results
    assert [r.millicredits for r in results] == [20, 30]
    assert (await _account(server, org)).usage_millicredits == 20
    assert (await _account(server, other)).usage_millicredits == 30


async def test_usage_of_a_new_month_rolls_the_period_before_it_counts(server, stub, org):
    await stub.RecordUsage(usage(org, "runM", 0))
    next_month = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=32)
    server.store.clock = lambda: next_month
    server.store._accounts.clear()  # as after ACCOUNT_CACHE_TTL_S
    await stub.RecordUsageBatch(
        pb.RecordUsageBatchRequest(calls=[usage(org, "runM", 1, output_tokens=1000)])
    )
    account = await _account(server, org)
    assert (account.period_start, account.usage_millicredits) == (
        next_month.date().replace(day=1),
        30,
    )


async def test_parallel_tool_usage_replays_post_one_entry_and_count_once(server, stub, org):
    request = pb.RecordToolUsageRequest(
        organization_id=org,
        run_id="runT",
        tool_call_id="call1",
        tool="http",
        detail="GET",
        millicredits=7,
    )
    answers = await asyncio.gather(*(stub.RecordToolUsage(request) for _ in range(10)))
    assert len({a.ledger_entry_id for a in answers}) == 1
    assert sum(not a.replayed for a in answers) == 1
    assert (await _account(server, org)).usage_millicredits == 7
    assert await _ledger(server, org) == [("tool:runT:call1", -7)]


async def _refusal(call):
    try:
        await call
    except Exception as error:  # noqa: BLE001 - the refusal is the point
        return refusal(error)
    raise AssertionError("expected a refusal")
