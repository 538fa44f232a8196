"""GET /dashboard/analytics/overview: the SDK's `dashboard.analytics_overview`, with the run credits
used this period from billing (GetUsage), members, integrations and credentials."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from modulex import Modulex
from modulex.types.dashboard import (
    AnalyticsOverviewResponse,
    CurrentMonthCreditUsage,
    OverviewData,
)

from services.billing.plans import PlanTerms
from tests.conftest import Stack, cleanup_backend, start_stack
from tests.orchestrator.helpers import run_turn, wait_for
from tests.tools.tools_stack import PG_DSN

OVERVIEW = "/dashboard/analytics/overview"


def _sdk(stack: Stack) -> Modulex:
    return Modulex(api_key=stack.api_key, organization_id=stack.org_id, base_url=stack.base_url)


async def _default_plan(stack: Stack) -> PlanTerms:
    """The plan billing gives an organization on its first turn."""
    return await stack.billing.store.plan(stack.billing.store.default_plan)


def _month_starts(now: datetime.datetime) -> tuple[str, str]:
    """(this month's first day, next month's), 00:00 UTC, ISO 8601 as the route writes them."""
    start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    end = (start + datetime.timedelta(days=32)).replace(day=1)
    return start.isoformat(), end.isoformat()


async def _answer(stack: Stack, limit: int = 20, offset: int = 0) -> AnalyticsOverviewResponse:
    async with _sdk(stack) as client:
        return await client.dashboard.analytics_overview(limit=limit, offset=offset)


async def _overview(stack: Stack) -> OverviewData:
    answer = await _answer(stack)
    assert answer.data is not None and answer.data.overview is not None
    return answer.data.overview


async def _usage(stack: Stack) -> CurrentMonthCreditUsage:
    usage = (await _overview(stack)).current_month_credit_usage
    assert usage is not None
    return usage


async def test_overview_through_the_sdk_counts_each_turn_as_one_credit_used(services):
    async with services.client() as http:
        for _ in range(2):
            _, frames = await run_turn(http, {"say": "hi"})
            assert frames[-1]["type"] == "done"

    async def two_used() -> bool:
        usage = await _usage(services)
        return usage.used_credit == 2 and usage["usage_millicredits"] > 0

    await wait_for(two_used, timeout=10, interval=0.1)  # charges reach billing within ~0.2 s
    answer = await _answer(services)
    assert answer.success and answer.organization_id == services.org_id
    assert answer.data is not None and answer.data.overview is not None
    overview = answer.data.overview
    usage, period = overview.current_month_credit_usage, overview.subscription
    assert usage is not None and period is not None
    plan = await _default_plan(services)
    assert (usage.used_credit, usage.max_credit) == (2, plan.monthly_run_credits)
    assert usage["plan"] == plan.name
    start, end = _month_starts(datetime.datetime.now(datetime.UTC))
    assert usage.next_reset_date == end
    assert (period.current_period_start, period.current_period_end) == (start, end)
    assert overview.credential_usage_logs == []
    assert answer.meta is not None and answer.meta.timestamp
    assert (answer.meta.limit, answer.meta.offset) == (20, 0)


async def test_overview_before_any_turn_shows_the_default_allowance_and_provisions_nothing(
    services,
):
    usage = await _usage(services)
    plan = await _default_plan(services)
    assert (usage.used_credit, usage.max_credit, usage["usage_millicredits"]) == (
        0,
        plan.monthly_run_credits,
        0,
    )
    assert usage["plan"] == plan.name
    assert await services.billing.store.account(services.org_id, provision=False) is None


async def test_overview_counts_members_credentials_and_the_integrations_they_cover(services):
    await services.member("admin")
    await services.member("member")
    async with services.client() as http:
        bodies = [
            {"integration_name": "http", "auth_type": "bearer_token", "auth_data": {"token": t}}
            for t in ("tok-1234567890", "tok-0987654321")
        ] + [{"integration_name": "postgresql", "auth_data": {"dsn": PG_DSN}}]
        for body in bodies:
            created = await http.post("/credentials", json=body)
            assert created.status_code == 201, created.text
        browse = await http.get("/integrations/browse", params={"page_size": 1})
        assert browse.status_code == 200, browse.text
    overview = await _overview(services)
    assert overview.active_member_count == 3
    assert (overview.total_credentials_count, overview.configured_integrations_count) == (3, 2)
    assert overview.total_integrations_count == browse.json()["total"] > 0


async def test_overview_counts_integrations_over_several_pages_of_credentials(
    services, monkeypatch
):
    from services.gateway.routes import dashboard

    monkeypatch.setattr(dashboard, "CREDENTIAL_PAGE", 2)
    async with services.client() as http:
        bodies: list[dict[str, Any]] = [
            {
                "integration_name": "http",
                "auth_type": "bearer_token",
                "auth_data": {"token": f"tok-{index:012d}"},
            }
            for index in range(4)
        ]
        bodies.append({"integration_name": "postgresql", "auth_data": {"dsn": PG_DSN}})
        for body in bodies:
            assert (await http.post("/credentials", json=body)).status_code == 201
    overview = await _overview(services)
    assert (overview.total_credentials_count, overview.configured_integrations_count) == (5, 2)


async def test_overview_is_refused_to_a_member_role_with_403(services):
    member = await services.member("member")
    async with services.client() as http:
        response = await http.get(OVERVIEW, headers=services.headers(api_key=member["api_key"]))
    assert response.status_code == 403
    assert response.json() == {
        "detail": "This requires the owner or admin role in this organization"
    }


@pytest.mark.parametrize(
    "params",
    [
        {"limit": "0"},
        {"limit": "101"},
        {"limit": "ten"},
        {"limit": "1.5"},
        {"offset": "-1"},
        {"offset": str(2**31)},
    ],
)
async def test_overview_paging_values_out_of_range_are_400(services, params):
    async with services.client() as http:
        response = await http.get(OVERVIEW, params=params)
    assert response.status_code == 400, response.text
    assert set(response.json()) == {"detail"} and next(iter(params)) in response.json()["detail"]


async def test_overview_echoes_its_paging_values_in_meta(services):
    answer = await _answer(services, limit=100, offset=7)
    assert answer.meta is not None
    assert (answer.meta.limit, answer.meta.offset) == (100, 7)


async def test_overview_with_billing_down_is_503_with_retry_after(tmp_path):
    stack = await start_stack(tmp_path)
    try:
        await stack.billing.stop(0)
        async with stack.client() as http:
            response = await http.get(OVERVIEW)
        assert response.status_code == 503, response.text
        assert response.json() == {"detail": "Service temporarily unavailable; try again"}
        assert response.headers["retry-after"] == "1"
    finally:
        await stack.gateway.stop(1)
        await stack.orchestrator.stop(1)
        await stack.tools.stop(1)
        await cleanup_backend(stack.extra.get("cleanup", {}))


async def test_overview_reads_at_most_its_page_bound_of_credentials_newest_first(
    services, monkeypatch
):
    from services.gateway.routes import dashboard

    monkeypatch.setattr(dashboard, "CREDENTIAL_PAGE", 1)
    monkeypatch.setattr(dashboard, "MAX_CREDENTIAL_PAGES", 2)
    async with services.client() as http:
        oldest = {"integration_name": "postgresql", "auth_data": {"dsn": PG_DSN}}
        assert (await http.post("/credentials", json=oldest)).status_code == 201
        for token in ("tok-1234567890", "tok-0987654321"):
            body = {
                "integration_name": "http",
                "auth_type": "bearer_token",
                "auth_data": {"token": token},
            }
            assert (await http.post("/credentials", json=body)).status_code == 201
    overview = await _overview(services)
    # the total is the tools service's count; the integrations those of the two newest
    assert (overview.total_credentials_count, overview.configured_integrations_count) == (3, 1)
