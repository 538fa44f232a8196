"""The usage overview: the SDK's `dashboard.analytics_overview` (GET /dashboard/analytics/overview).

What an organization's console shows at a glance, in the SDK's shape (`modulex/types/dashboard.py`
AnalyticsOverviewResponse): its members, its integrations and credentials (the tools service), and
the run credits used this period against the period's allowance (billing's GetUsage, which never
provisions an account: an organization that has not run a turn yet is shown the default plan's
allowance and 0 used). Owner or admin, authenticated before anything is looked up, like every
route. The SDK's models keep fields they do not declare (`extra="allow"`), so the credit usage also
carries `usage_millicredits` (token and tool charges) and `plan`. Loopline keeps no log of
credential use: `credential_usage_logs` is always empty, and `limit`/`offset`, which the SDK sends
to page it, are checked and echoed in `meta`. A service that is down is the usual 503.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Awaitable
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ConfigDict, with_config
from sqlalchemy import func, select
from typing_extensions import TypedDict

from loopline.billing.v1 import billing_pb2, billing_pb2_grpc
from loopline.tools.v1 import tools_pb2
from services.common import pb
from services.gateway.context import context_of
from services.gateway.errors import BodyError
from services.gateway.identity import Principal
from services.gateway.models import Membership
from services.gateway.openapi import error_responses, keyed
from services.gateway.query import WholeNumber
from services.gateway.routes.fields import TIMEOUT_S, Who, tools_of
from services.gateway.routes.integrations import list_page, query_of

# `limit` and `offset` (of the always empty credential_usage_logs): the SDK sends 20 and 0.
MAX_LIMIT = 100
MAX_OFFSET = 2**31 - 1
# Credentials are read in pages of this many to count the integrations they cover (each may carry
# 16 KiB of metadata: a page stays under gRPC's 4 MiB message limit), at most MAX_CREDENTIAL_PAGES
# pages: past that many credentials the count covers the newest ones.
CREDENTIAL_PAGE = 100
MAX_CREDENTIAL_PAGES = 100

_DOCSTRINGS = ConfigDict(use_attribute_docstrings=True)


# ---- the answer (typed dicts: see services/gateway/schemas.py) -------------------------------


@with_config(_DOCSTRINGS)
class CreditUsage(TypedDict):
    """Run credits of the current billing period (a calendar month, UTC)."""

    used_credit: int
    """Run credits charged this period: one per started turn funded by the allowance."""
    max_credit: int
    """The period's allowance: the plan's monthly run credits plus credits granted this period."""
    next_reset_date: str
    """When the allowance resets: the first day of next month, 00:00 UTC (ISO 8601)."""
    usage_millicredits: int
    """Token usage and tool charges this period, in millicredits (they draw no run credits)."""
    plan: str
    """The billing plan's name (the default plan's while the organization has run no turn)."""


class SubscriptionPeriod(TypedDict):
    """The current billing period, ISO 8601 UTC."""

    current_period_start: str
    current_period_end: str


@with_config(_DOCSTRINGS)
class Overview(TypedDict):
    """The organization at a glance."""

    active_member_count: int
    """Members of the organization, every role."""
    configured_integrations_count: int
    """Integrations the organization has stored a credential for."""
    total_integrations_count: int
    """Integrations it can use: tools, model providers and the knowledge store."""
    total_credentials_count: int
    current_month_credit_usage: CreditUsage
    subscription: SubscriptionPeriod
    credential_usage_logs: list[dict[str, Any]]
    """Always empty: Loopline keeps no log of credential use."""


class OverviewData(TypedDict):
    overview: Overview


class OverviewMeta(TypedDict):
    timestamp: str
    limit: int
    offset: int


class AnalyticsOverview(TypedDict):
    """GET /dashboard/analytics/overview."""

    success: bool
    organization_id: str
    data: OverviewData
    meta: OverviewMeta


# ---- the reads --------------------------------------------------------------------------------


def billing_of(request: Request) -> billing_pb2_grpc.BillingServiceStub:
    """Billing's stub (this route is included only when the gateway has one)."""
    billing = context_of(request).billing
    assert billing is not None
    return billing


async def _member_count(request: Request, organization_id: str) -> int:
    async with context_of(request).authenticator.sessions() as session:
        count = await session.scalar(
            select(func.count())
            .select_from(Membership)
            .where(Membership.organization_id == organization_id)
        )
    return int(count or 0)


async def _credential_counts(request: Request, organization_id: str) -> tuple[int, int]:
    """(credentials in all, distinct integrations among them), paging ListCredentials."""
    integrations: set[str] = set()
    total = offset = 0
    for _ in range(MAX_CREDENTIAL_PAGES):
        page = await tools_of(request).ListCredentials(
            tools_pb2.ListCredentialsRequest(
                organization_id=organization_id, limit=CREDENTIAL_PAGE, offset=offset
            ),
            timeout=TIMEOUT_S,
        )
        total = page.total
        integrations.update(c.integration_name for c in page.credentials)
        offset += len(page.credentials)
        if not page.credentials or offset >= total:
            break
    return total, len(integrations)


async def _integration_count(request: Request, who: Principal) -> int:
    """How many integrations the organization sees (one ListIntegrations of one item)."""
    return (await list_page(request, await query_of(request, who, ""), 0, 1)).total_size


async def _usage(request: Request, organization_id: str) -> billing_pb2.GetUsageResponse:
    return await billing_of(request).GetUsage(
        billing_pb2.GetUsageRequest(organization_id=organization_id), timeout=TIMEOUT_S
    )


async def _settled(*reads: Awaitable[Any]) -> list[Any]:
    """The results of `reads`, run at once; once all have ended, the first failure (in their
    order) is raised: an AioRpcError becomes the error table's answer (503 for a service that is
    down), and no read is left running behind the answer."""
    results = await asyncio.gather(*reads, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def _iso(ts: Any) -> str:
    return pb.iso(ts) or ""


# ---- the route --------------------------------------------------------------------------------

router = APIRouter(responses=error_responses())


@router.get(
    "/dashboard/analytics/overview",
    summary="The organization at a glance: members, integrations, credits used this period",
    tags=["dashboard"],
    response_model=AnalyticsOverview,
    openapi_extra=keyed(),
)
async def analytics_overview(
    request: Request,
    who: Principal = Who,
    limit: Annotated[WholeNumber, Query(ge=1, le=MAX_LIMIT)] = 20,
    offset: Annotated[WholeNumber, Query(ge=0, le=MAX_OFFSET)] = 0,
) -> Response:
    if not 1 <= limit <= MAX_LIMIT:
        raise BodyError(400, f"limit must be between 1 and {MAX_LIMIT}")
    if not 0 <= offset <= MAX_OFFSET:
        raise BodyError(400, f"offset must be between 0 and {MAX_OFFSET}")
    org = who.organization_id
    results = await _settled(
        _usage(request, org),
        _credential_counts(request, org),
        _integration_count(request, who),
        _member_count(request, org),
    )
    usage: billing_pb2.GetUsageResponse = results[0]
    credentials, configured = results[1]
    integrations: int = results[2]
    members: int = results[3]
    start, end = _iso(usage.period_start), _iso(usage.period_end)
    answer: AnalyticsOverview = {
        "success": True,
        "organization_id": org,
        "data": {
            "overview": {
                "active_member_count": members,
                "configured_integrations_count": configured,
                "total_integrations_count": integrations,
                "total_credentials_count": credentials,
                "current_month_credit_usage": {
                    "used_credit": usage.run_credits.used,
                    "max_credit": usage.run_credits.allowance,
                    "next_reset_date": end,
                    "usage_millicredits": usage.usage_millicredits,
                    "plan": usage.plan,
                },
                "subscription": {"current_period_start": start, "current_period_end": end},
                "credential_usage_logs": [],
            }
        },
        "meta": {
            "timestamp": datetime.datetime.now(datetime.UTC).isoformat(),
            "limit": limit,
            "offset": offset,
        },
    }
    return JSONResponse(answer)
