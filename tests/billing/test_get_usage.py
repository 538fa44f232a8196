"""GetUsage: an organization's plan, run credits, usage and wallet this period, read without
provisioning an account."""

from __future__ import annotations

import datetime

import grpc
import pytest

from loopline.billing.v1 import billing_pb2 as pb
from services.billing.plans import load_plans
from services.common.errors import status_details
from tests.billing.helpers import admit_request


async def _turn(stub, org: str, key: str) -> None:
    """Admit and charge one turn (one run credit)."""
    admitted = await stub.Admit(admit_request(org, key))
    await stub.Charge(pb.ChargeRequest(reservation_id=admitted.reservation_id))


async def test_get_usage_without_an_account_answers_the_default_plan_with_zeros(
    server, stub, settings, org
):
    usage = await stub.GetUsage(pb.GetUsageRequest(organization_id=org))
    default = load_plans(settings.billing_plans_path)[settings.billing_default_plan]
    assert not usage.found
    assert (usage.plan, usage.monthly_run_credits) == (default.name, default.monthly_run_credits)
    credits = usage.run_credits
    assert (credits.allowance, credits.available) == (default.monthly_run_credits,) * 2
    assert (credits.granted, credits.used, credits.reserved) == (0, 0, 0)
    assert usage.usage_millicredits == 0
    wallet = usage.wallet
    assert (wallet.balance_minor, wallet.reserved_minor, wallet.available_minor) == (0, 0, 0)


async def test_get_usage_never_provisions_an_account(server, stub, org):
    await stub.GetUsage(pb.GetUsageRequest(organization_id=org))
    await stub.GetUsage(pb.GetUsageRequest(organization_id=org))
    assert await server.store.account(org, provision=False) is None
    assert await server.admin.show(org) is None


async def test_get_usage_counts_charged_held_granted_tokens_and_wallet(server, stub, org):
    await server.admin.set_plan(org, "seven")
    await _turn(stub, org, "c:1")
    await _turn(stub, org, "c:2")
    await stub.Admit(admit_request(org, "c:held"))  # held, not charged
    await server.admin.grant_credits(org, 3)
    await server.admin.top_up(org, 250)
    recorded = await stub.RecordUsage(
        pb.RecordUsageRequest(
            organization_id=org,
            run_id="run1",
            call_index=0,
            chat_id="chat1",
            provider_id="scripted",
            model_id="scripted-1",
            input_tokens=1000,
            output_tokens=500,
        )
    )
    usage = await stub.GetUsage(pb.GetUsageRequest(organization_id=org))
    assert usage.found and usage.plan == "seven" and usage.monthly_run_credits == 7
    credits = usage.run_credits
    assert (credits.allowance, credits.granted, credits.used, credits.reserved) == (10, 3, 2, 1)
    assert credits.available == 10 - 2 - 1
    assert usage.usage_millicredits == recorded.millicredits > 0
    assert (usage.wallet.balance_minor, usage.wallet.available_minor) == (250, 250)
    assert (
        usage.run_credits
        == (await stub.GetUsage(pb.GetUsageRequest(organization_id=org))).run_credits
    )


async def test_get_usage_agrees_with_admin_show(server, stub, org):
    await _turn(stub, org, "c:1")
    await server.admin.top_up(org, 40)
    usage = await stub.GetUsage(pb.GetUsageRequest(organization_id=org))
    shown = await server.admin.show(org)
    assert shown is not None
    assert usage.plan == shown["plan"]["name"]
    assert shown["allowance"] == {
        "period_allowance": usage.run_credits.allowance,
        "granted_credits": usage.run_credits.granted,
        "used": usage.run_credits.used,
        "reserved": usage.run_credits.reserved,
        "available": usage.run_credits.available,
    }
    assert shown["wallet"] == {
        "balance_minor": usage.wallet.balance_minor,
        "reserved_minor": usage.wallet.reserved_minor,
        "available_minor": usage.wallet.available_minor,
    }
    assert shown["usage_millicredits_this_period"] == usage.usage_millicredits
    assert shown["period_start"] == usage.period_start.ToDatetime().date().isoformat()


@pytest.mark.parametrize("provisioned", [False, True])
async def test_get_usage_period_runs_from_this_month_start_to_the_next_across_a_year_end(
    server, stub, org, provisioned
):
    december = datetime.datetime(2031, 12, 31, 23, 59, tzinfo=datetime.UTC)
    server.store.clock = lambda: december
    if provisioned:
        await _turn(stub, org, "c:1")
    usage = await stub.GetUsage(pb.GetUsageRequest(organization_id=org))
    assert usage.found is provisioned
    start = usage.period_start.ToDatetime(tzinfo=datetime.UTC)
    end = usage.period_end.ToDatetime(tzinfo=datetime.UTC)
    assert (start, end) == (
        datetime.datetime(2031, 12, 1, tzinfo=datetime.UTC),
        datetime.datetime(2032, 1, 1, tzinfo=datetime.UTC),
    )


async def test_get_usage_of_an_account_from_last_month_starts_the_new_period_at_zero(
    server, stub, org
):
    await _turn(stub, org, "c:1")
    next_month = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=32)
    server.store.clock = lambda: next_month
    usage = await stub.GetUsage(pb.GetUsageRequest(organization_id=org))
    assert usage.found and usage.run_credits.used == 0
    assert usage.period_start.ToDatetime().date() == next_month.date().replace(day=1)


@pytest.mark.parametrize(
    ("org_id", "reason"),
    [("", "ORGANIZATION_ID_REQUIRED"), ("bad org\x00", "INVALID_ORGANIZATION_ID")],
)
async def test_get_usage_without_a_valid_organization_is_invalid_argument(stub, org_id, reason):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.GetUsage(pb.GetUsageRequest(organization_id=org_id))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert status_details(caught.value).reason == reason
