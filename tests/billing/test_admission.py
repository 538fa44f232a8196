"""Admit / Charge / Release over a real grpc.aio server (DESIGN.md "Billing")."""

from __future__ import annotations

import asyncio
import datetime
import uuid

import grpc
import pytest
from sqlalchemy import func, select

from loopline.billing.v1 import billing_pb2, billing_pb2_grpc
from services.billing.models import Account, LedgerEntry, Reservation
from services.billing.server import BillingServer
from services.common.errors import BILLING_DOMAIN, status_details
from tests.billing.helpers import admit_request, make_settings, refusal

pb = billing_pb2


async def _account(server: BillingServer, org: str) -> Account:
    async with server.store.sessions() as session:
        account = await session.get(Account, org)
    assert account is not None
    return account


async def _reservation_count(server: BillingServer, org: str) -> int:
    async with server.store.sessions() as session:
        return (
            await session.execute(
                select(func.count()).select_from(Reservation).where(Reservation.org_id == org)
            )
        ).scalar_one()


async def _denial(stub: billing_pb2_grpc.BillingServiceStub, request: pb.AdmitRequest) -> tuple:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Admit(request)
    details = status_details(caught.value)
    denial = details.unpack(pb.Denial)
    assert denial is not None
    return caught.value.code(), details, denial


async def test_admit_charge_happy_path_posts_one_run_credit(server, stub, org):
    admitted = await stub.Admit(admit_request(org, "chat1:run1"))
    assert admitted.state == pb.RESERVATION_STATE_HELD
    assert admitted.credits == 1 and not admitted.replayed
    assert admitted.reservation_id.startswith("res_")
    assert admitted.rate_limit.limit == 600 and admitted.rate_limit.remaining == 599

    account = await _account(server, org)
    assert (account.plan, account.allowance_reserved, account.allowance_used) == ("developer", 1, 0)

    charged = await stub.Charge(pb.ChargeRequest(reservation_id=admitted.reservation_id))
    assert charged.state == pb.RESERVATION_STATE_CHARGED
    account = await _account(server, org)
    assert (account.allowance_reserved, account.allowance_used) == (0, 1)
    async with server.store.sessions() as session:
        entry = await session.get(LedgerEntry, charged.ledger_entry_id)
    assert entry is not None
    assert (entry.idempotency_key, entry.kind, entry.unit, entry.amount) == (
        f"charge:{admitted.reservation_id}",
        "run_charge",
        "credit",
        -1,
    )


async def test_unknown_org_is_auto_provisioned_on_the_default_plan(server, stub, org):
    assert await server.admin.show(org) is None
    await stub.Admit(admit_request(org, "c:r"))
    view = await server.admin.show(org)
    assert view["plan"]["name"] == "developer"
    assert view["allowance"]["period_allowance"] == 1000
    assert view["plan"]["wallet_overage"] is True
    assert view["plan"]["rate_limits"] == {"sync_exec": "600/minute"}


async def test_admit_replay_returns_the_same_reservation_without_counting_the_rate_limit(
    server, stub, org
):
    await server.admin.set_plan(org, "three_a_minute")
    first = await stub.Admit(admit_request(org, "chat:run"))
    again = await stub.Admit(admit_request(org, "chat:run"))
    assert again.replayed and not first.replayed
    assert (again.reservation_id, again.credits, again.state) == (
        first.reservation_id,
        1,
        pb.RESERVATION_STATE_HELD,
    )
    assert again.rate_limit.remaining == first.rate_limit.remaining == 2
    assert await _reservation_count(server, org) == 1
    assert (await _account(server, org)).allowance_reserved == 1

    await stub.Charge(pb.ChargeRequest(reservation_id=first.reservation_id))
    after_charge = await stub.Admit(admit_request(org, "chat:run"))
    assert after_charge.replayed and after_charge.state == pb.RESERVATION_STATE_CHARGED
    assert (await _account(server, org)).allowance_used == 1


async def test_concurrent_admissions_with_one_turn_key_create_one_reservation(server, stub, org):
    results = await asyncio.gather(*(stub.Admit(admit_request(org, "same:key")) for _ in range(20)))
    assert len({r.reservation_id for r in results}) == 1
    assert sum(not r.replayed for r in results) == 1
    assert await _reservation_count(server, org) == 1
    assert (await _account(server, org)).allowance_reserved == 1


async def test_turn_key_reused_with_other_credits_is_already_exists(server, stub, org):
    await stub.Admit(admit_request(org, "k"))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Admit(admit_request(org, "k", credits=3))
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert status_details(caught.value).reason == "TURN_KEY_REUSED"


async def test_charge_twice_posts_once_and_returns_the_same_entry(server, stub, org):
    admitted = await stub.Admit(admit_request(org, "c:r"))
    first = await stub.Charge(pb.ChargeRequest(reservation_id=admitted.reservation_id))
    second = await stub.Charge(pb.ChargeRequest(reservation_id=admitted.reservation_id))
    assert first.ledger_entry_id == second.ledger_entry_id
    assert second.state == pb.RESERVATION_STATE_CHARGED
    async with server.store.sessions() as session:
        entries = (
            (await session.execute(select(LedgerEntry).where(LedgerEntry.org_id == org)))
            .scalars()
            .all()
        )
    assert len(entries) == 1
    assert (await _account(server, org)).allowance_used == 1


async def test_parallel_charges_of_one_reservation_post_once(server, stub, org):
    admitted = await stub.Admit(admit_request(org, "c:r"))
    results = await asyncio.gather(
        *(stub.Charge(pb.ChargeRequest(reservation_id=admitted.reservation_id)) for _ in range(10))
    )
    assert len({r.ledger_entry_id for r in results}) == 1
    account = await _account(server, org)
    assert (account.allowance_used, account.allowance_reserved) == (1, 0)


async def test_release_returns_the_hold_and_is_at_most_once(server, stub, org):
    admitted = await stub.Admit(admit_request(org, "c:r"))
    released = await stub.Release(
        pb.ReleaseRequest(reservation_id=admitted.reservation_id, reason="persist failed")
    )
    assert released.state == pb.RESERVATION_STATE_RELEASED
    again = await stub.Release(pb.ReleaseRequest(reservation_id=admitted.reservation_id))
    assert again.state == pb.RESERVATION_STATE_RELEASED
    account = await _account(server, org)
    assert (account.allowance_reserved, account.allowance_used, account.runs_today) == (0, 0, 0)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Charge(pb.ChargeRequest(reservation_id=admitted.reservation_id))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert status_details(caught.value).reason == "RESERVATION_RELEASED"


async def test_release_after_charge_is_a_noop_reporting_charged(server, stub, org):
    admitted = await stub.Admit(admit_request(org, "c:r"))
    await stub.Charge(pb.ChargeRequest(reservation_id=admitted.reservation_id))
    released = await stub.Release(pb.ReleaseRequest(reservation_id=admitted.reservation_id))
    assert released.state == pb.RESERVATION_STATE_CHARGED
    account = await _account(server, org)
    assert (account.allowance_used, account.allowance_reserved) == (1, 0)


@pytest.mark.parametrize("rpc", ["Charge", "Release"])
async def test_unknown_reservation_is_not_found(stub, rpc):
    request = (
        pb.ChargeRequest(reservation_id="res_nope")
        if rpc == "Charge"
        else pb.ReleaseRequest(reservation_id="res_nope")
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await getattr(stub, rpc)(request)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    details = status_details(caught.value)
    assert (details.reason, details.domain) == ("RESERVATION_NOT_FOUND", BILLING_DOMAIN)


async def test_admit_without_turn_key_is_invalid_argument(stub, org):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Admit(pb.AdmitRequest(organization_id=org, usage_type="run"))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert status_details(caught.value).reason == "TURN_KEY_REQUIRED"


# ---------------------------------------------------------------- denial layers


async def test_credit_layer_denial_is_failed_precondition_with_a_full_denial(server, stub, org):
    await server.admin.set_plan(org, "seven")
    for i in range(7):
        await stub.Admit(admit_request(org, f"c:{i}"))
    code, details, denial = await _denial(stub, admit_request(org, "c:8"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert (details.domain, details.reason) == (BILLING_DOMAIN, "CREDIT_PLAN_EXHAUSTED")
    assert (denial.code, denial.layer, denial.key, denial.current, denial.limit) == (
        "credit_plan_exhausted",
        "credit",
        "run_credits",
        7,
        7,
    )
    assert "exhausted" in denial.reason
    assert not denial.HasField("retry_after_seconds") and details.retry_after_s is None
    assert await _reservation_count(server, org) == 7


async def test_wallet_layer_denial_when_allowance_spent_and_wallet_short(server, stub, org):
    await server.admin.set_plan(org, "wallet_only")
    await server.admin.top_up(org, 7)
    paid = await stub.Admit(admit_request(org, "c:1"))
    account = await _account(server, org)
    assert (account.wallet_reserved_minor, account.allowance_reserved) == (5, 0)
    code, details, denial = await _denial(stub, admit_request(org, "c:2"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert details.reason == "WALLET_INSUFFICIENT_FUNDS"
    assert (denial.code, denial.layer, denial.key, denial.current, denial.limit) == (
        "wallet_insufficient_funds",
        "wallet",
        "wallet_minor_units",
        2,
        5,
    )
    assert denial.reason
    await stub.Charge(pb.ChargeRequest(reservation_id=paid.reservation_id))
    account = await _account(server, org)
    assert (account.wallet_balance_minor, account.wallet_reserved_minor) == (2, 0)


async def test_quota_layer_denial_after_the_daily_run_quota(server, stub, org):
    await server.admin.set_plan(org, "two_a_day")
    await stub.Admit(admit_request(org, "c:1"))
    await stub.Admit(admit_request(org, "c:2"))
    code, details, denial = await _denial(stub, admit_request(org, "c:3"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert details.reason == "QUOTA_EXCEEDED"
    assert (denial.code, denial.layer, denial.key, denial.current, denial.limit) == (
        "quota_exceeded",
        "quota",
        "runs_per_day",
        2,
        2,
    )
    assert denial.reason
    assert await _reservation_count(server, org) == 2


async def test_rate_layer_denial_is_resource_exhausted_with_retry_info(server, stub, org):
    await server.admin.set_plan(org, "three_a_minute")
    for i in range(3):
        await stub.Admit(admit_request(org, f"c:{i}"))
    code, details, denial = await _denial(stub, admit_request(org, "c:4"))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (details.domain, details.reason) == (BILLING_DOMAIN, "RATE_LIMITED")
    assert (denial.code, denial.layer, denial.key, denial.current, denial.limit) == (
        "rate_limited",
        "rate",
        "sync_exec",
        3,
        3,
    )
    assert denial.reason
    assert 1 <= denial.retry_after_seconds <= 60
    assert details.retry_after_s == float(denial.retry_after_seconds)
    assert (denial.rate_limit.limit, denial.rate_limit.remaining) == (3, 0)
    assert denial.rate_limit.reset_seconds == denial.retry_after_seconds
    assert await _reservation_count(server, org) == 3


async def test_layers_are_checked_rate_then_quota_then_credit(server, stub, org):
    await server.admin.set_plan(org, "all_closed")
    _, _, first = await _denial(stub, admit_request(org, "c:1"))
    assert first.layer == "quota"  # rate passed (1/minute), quota 0 refused before credit
    _, _, second = await _denial(stub, admit_request(org, "c:2"))
    assert second.layer == "rate"  # the rate layer refuses before the others
    assert await _reservation_count(server, org) == 0
    account = await _account(server, org)
    assert (account.runs_today, account.allowance_reserved) == (0, 0)


# ---------------------------------------------------------------- concurrency


async def _hundred_against_seven(stub: billing_pb2_grpc.BillingServiceStub, org: str) -> list:
    results = await asyncio.gather(
        *(stub.Admit(admit_request(org, f"chat:{i}")) for i in range(100)), return_exceptions=True
    )
    admitted = [r for r in results if isinstance(r, pb.AdmitResponse)]
    denied = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(admitted) + len(denied) == 100, [
        r for r in results if not isinstance(r, (pb.AdmitResponse, grpc.aio.AioRpcError))
    ]
    assert {status_details(e).reason for e in denied} <= {
        "CREDIT_PLAN_EXHAUSTED",
        "WALLET_INSUFFICIENT_FUNDS",
    }
    return admitted


async def test_hundred_parallel_admissions_against_seven_credits_admit_exactly_seven(
    server, stub, org
):
    await server.admin.set_plan(org, "seven")
    admitted = await _hundred_against_seven(stub, org)
    assert len(admitted) == 7
    account = await _account(server, org)
    assert (account.allowance_reserved, account.allowance_used) == (7, 0)
    assert await _reservation_count(server, org) == 7


async def test_hundred_parallel_admissions_against_a_seven_credit_wallet_admit_exactly_seven(
    server, stub, org
):
    await server.admin.set_plan(org, "wallet_only")
    await server.admin.top_up(org, 35)
    admitted = await _hundred_against_seven(stub, org)
    assert len(admitted) == 7
    account = await _account(server, org)
    assert (account.wallet_balance_minor, account.wallet_reserved_minor) == (35, 35)


async def test_hundred_parallel_admissions_on_postgresql_admit_exactly_seven(
    tmp_path, postgres_url, org
):
    server = await BillingServer.start(make_settings(tmp_path, billing_database_url=postgres_url))
    try:
        await server.admin.set_plan(org, "seven")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = billing_pb2_grpc.BillingServiceStub(channel)
            admitted = await _hundred_against_seven(stub, org)
            assert len(admitted) == 7
            # Charges and releases racing each other resolve every hold exactly once.
            ids = [a.reservation_id for a in admitted]
            outcomes = await asyncio.gather(
                *(stub.Charge(pb.ChargeRequest(reservation_id=i)) for i in ids),
                *(stub.Release(pb.ReleaseRequest(reservation_id=i)) for i in ids),
                return_exceptions=True,
            )
            # A charge that lost to its release is refused; nothing else fails.
            errors = [o for o in outcomes if isinstance(o, BaseException)]
            assert all(refusal(e).reason == "RESERVATION_RELEASED" for e in errors), errors
        account = await _account(server, org)
        assert account.allowance_reserved == 0
        async with server.store.sessions() as session:
            charged = (
                await session.execute(
                    select(func.count()).select_from(LedgerEntry).where(LedgerEntry.org_id == org)
                )
            ).scalar_one()
        assert account.allowance_used == charged <= 7
    finally:
        await server.stop(0)


async def test_period_rollover_resets_the_allowance(server, stub, org):
    await server.admin.set_plan(org, "seven")
    for i in range(7):
        admitted = await stub.Admit(admit_request(org, f"c:{i}"))
        await stub.Charge(pb.ChargeRequest(reservation_id=admitted.reservation_id))
    await _denial(stub, admit_request(org, "c:next"))
    next_month = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=32)
    server.store.clock = lambda: next_month
    admitted = await stub.Admit(admit_request(org, f"c:{uuid.uuid4().hex}"))
    assert not admitted.replayed
    account = await _account(server, org)
    assert (account.allowance_used, account.allowance_reserved, account.period_allowance) == (
        0,
        1,
        7,
    )
