"""ChargeBatch: the run charges the orchestrator stored with its turns, each as Charge, an
expired hold charged late and a charge that cannot be posted answered in its result
(billing.proto, README "Decisions")."""

from __future__ import annotations

import datetime

import grpc
import pytest
from sqlalchemy import select

from loopline.billing.v1 import billing_pb2 as pb
from services.billing.models import Account, LedgerEntry
from services.common.errors import status_details
from tests.billing.helpers import admit_request


def _later() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=901)


async def _account(server, org: str) -> Account:
    async with server.store.sessions() as session:
        return await session.get(Account, org)


async def _charges(server, org: str) -> list[LedgerEntry]:
    async with server.store.sessions() as session:
        return list(
            (
                await session.scalars(
                    select(LedgerEntry)
                    .where(LedgerEntry.org_id == org, LedgerEntry.kind == "run_charge")
                    .order_by(LedgerEntry.created_at)
                )
            ).all()
        )


async def test_a_batch_charges_each_hold_once_and_a_retry_replays(server, stub, org):
    held = [await stub.Admit(admit_request(org, f"c:{i}")) for i in range(3)]
    request = pb.ChargeBatchRequest(
        charges=[pb.ChargeRequest(reservation_id=h.reservation_id) for h in held]
    )
    first = await stub.ChargeBatch(request)
    assert [r.state for r in first.results] == [pb.RESERVATION_STATE_CHARGED] * 3
    assert len({r.ledger_entry_id for r in first.results}) == 3
    again = await stub.ChargeBatch(request)
    assert [r.ledger_entry_id for r in again.results] == [r.ledger_entry_id for r in first.results]
    account = await _account(server, org)
    assert (account.allowance_reserved, account.allowance_used) == (0, 3)
    assert len(await _charges(server, org)) == 3
    assert list((await stub.ChargeBatch(pb.ChargeBatchRequest())).results) == []


async def test_an_expired_hold_is_charged_late_and_only_once(server, stub, org):
    """The turn was committed while the hold stood; its stored charge came after the sweeper
    voided the hold (billing or the orchestrator away longer than the hold). Before, the charge
    was refused (RESERVATION_EXPIRED) and the persisted turn cost nothing."""
    held = await stub.Admit(admit_request(org, "c:late"))
    assert await server.ledger.expire_holds(now=_later()) == 1
    account = await _account(server, org)
    assert (account.allowance_reserved, account.allowance_used) == (0, 0)

    request = pb.ChargeBatchRequest(charges=[pb.ChargeRequest(reservation_id=held.reservation_id)])
    first = await stub.ChargeBatch(request)
    assert (
        first.results[0].state == pb.RESERVATION_STATE_CHARGED and first.results[0].ledger_entry_id
    )
    replay = await stub.ChargeBatch(request)
    assert replay.results[0].ledger_entry_id == first.results[0].ledger_entry_id
    account = await _account(server, org)
    assert (account.allowance_reserved, account.allowance_used) == (0, 1)
    [entry] = await _charges(server, org)
    assert (
        entry.amount == -1
        and entry.reservation_id == held.reservation_id
        and entry.note is not None
        and "after its hold expired" in entry.note
    )
    released = await stub.Release(pb.ReleaseRequest(reservation_id=held.reservation_id))
    assert released.state == pb.RESERVATION_STATE_CHARGED  # charged now: a Release leaves it alone


async def test_a_late_charge_debits_the_wallet(server, stub, org):
    await server.admin.set_plan(org, "wallet_only")
    await server.admin.top_up(org, 7)
    paid = await stub.Admit(admit_request(org, "c:1"))
    assert await server.ledger.expire_holds(now=_later()) == 1
    account = await _account(server, org)
    assert (account.wallet_balance_minor, account.wallet_reserved_minor) == (7, 0)
    answer = await stub.ChargeBatch(
        pb.ChargeBatchRequest(charges=[pb.ChargeRequest(reservation_id=paid.reservation_id)])
    )
    assert answer.results[0].state == pb.RESERVATION_STATE_CHARGED
    account = await _account(server, org)
    assert (account.wallet_balance_minor, account.wallet_reserved_minor) == (2, 0)


async def test_a_released_or_unknown_reservation_is_answered_in_its_result(server, stub, org):
    released = await stub.Admit(admit_request(org, "c:released"))
    await stub.Release(
        pb.ReleaseRequest(reservation_id=released.reservation_id, reason="turn not started")
    )
    held = await stub.Admit(admit_request(org, "c:held"))
    answer = await stub.ChargeBatch(
        pb.ChargeBatchRequest(
            charges=[
                pb.ChargeRequest(reservation_id=released.reservation_id),
                pb.ChargeRequest(reservation_id="res_nope"),
                pb.ChargeRequest(reservation_id=held.reservation_id),
            ]
        )
    )
    assert [(r.state, bool(r.ledger_entry_id)) for r in answer.results] == [
        (pb.RESERVATION_STATE_RELEASED, False),
        (pb.RESERVATION_STATE_UNSPECIFIED, False),
        (pb.RESERVATION_STATE_CHARGED, True),
    ]
    account = await _account(server, org)
    assert (account.allowance_reserved, account.allowance_used) == (0, 1)


async def test_an_empty_reservation_id_fails_the_batch_before_anything_is_written(
    server, stub, org
):
    held = await stub.Admit(admit_request(org, "c:1"))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.ChargeBatch(
            pb.ChargeBatchRequest(
                charges=[pb.ChargeRequest(reservation_id=held.reservation_id), pb.ChargeRequest()]
            )
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert status_details(caught.value).reason == "RESERVATION_ID_REQUIRED"
    assert await _charges(server, org) == []


async def test_charge_alone_still_refuses_an_expired_hold(server, stub, org):
    held = await stub.Admit(admit_request(org, "c:1"))
    assert await server.ledger.expire_holds(now=_later()) == 1
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Charge(pb.ChargeRequest(reservation_id=held.reservation_id))
    assert status_details(caught.value).reason == "RESERVATION_EXPIRED"


async def test_a_late_charge_counts_its_run_in_the_daily_quota_again(server, stub, org):
    """An expired hold gives its run back to the daily quota; its late charge takes it again, so
    runs_today never falls below the runs charged (which would let that many more turns in)."""
    await server.admin.set_plan(org, "two_a_day")
    held = await stub.Admit(admit_request(org, "c:1"))
    assert (await _account(server, org)).runs_today == 1
    assert await server.ledger.expire_holds(now=_later()) == 1
    assert (await _account(server, org)).runs_today == 0
    await stub.ChargeBatch(
        pb.ChargeBatchRequest(charges=[pb.ChargeRequest(reservation_id=held.reservation_id)])
    )
    assert (await _account(server, org)).runs_today == 1
    await stub.Admit(admit_request(org, "c:2"))
    code = None
    try:
        await stub.Admit(admit_request(org, "c:3"))
    except grpc.aio.AioRpcError as denied:
        code = status_details(denied).reason
    assert code == "QUOTA_EXCEEDED"  # two runs today: the late-charged one and c:2
