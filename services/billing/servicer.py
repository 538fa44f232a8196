"""The billing servicer: `loopline.billing.v1.BillingService` over the admission and ledger rules.

Every handler goes through one wrapper (`unary`): a domain `RpcError` becomes a rich status.
"""

from __future__ import annotations

import datetime
from typing import Any

import grpc

from loopline.billing.v1 import billing_pb2, billing_pb2_grpc
from services.billing.admission import Admission
from services.billing.ledger import Ledger
from services.billing.models import CHARGED, EXPIRED, HELD, RELEASED, month_start
from services.billing.plans import PlanTerms
from services.billing.rates import RateDecision
from services.billing.store import BillingStore
from services.common import ids, pb
from services.common.errors import BILLING_DOMAIN, rpc_handler

STATE_TO_PB = {
    HELD: billing_pb2.RESERVATION_STATE_HELD,
    CHARGED: billing_pb2.RESERVATION_STATE_CHARGED,
    RELEASED: billing_pb2.RESERVATION_STATE_RELEASED,
    EXPIRED: billing_pb2.RESERVATION_STATE_EXPIRED,
}

# The one wrapper every handler goes through: RpcError -> rich status; other exceptions
# reach grpc as UNKNOWN and are logged with their traceback.
unary = rpc_handler(
    domain=BILLING_DOMAIN,
    check=ids.request_organization_check(BILLING_DOMAIN, "ORGANIZATION_ID_REQUIRED"),
)


def _rate_pb(rate: RateDecision) -> billing_pb2.RateLimitState:
    return billing_pb2.RateLimitState(
        limit=rate.limit, remaining=rate.remaining, reset_seconds=rate.reset_seconds
    )


def _midnight(day: datetime.date) -> datetime.datetime:
    return datetime.datetime(day.year, day.month, day.day, tzinfo=datetime.UTC)


def _next_month(day: datetime.date) -> datetime.date:
    """The first day of the month after `day`'s (the next period's start)."""
    return (day.replace(day=28) + datetime.timedelta(days=4)).replace(day=1)


async def usage_of(store: BillingStore, org_id: str) -> billing_pb2.GetUsageResponse:
    """`org_id`'s account in the current period, read as `admin show` reads it (never provisioned:
    `store.account(provision=False)`); without an account, found=false with the default plan's
    terms and zeros, so a client shows the allowance a first turn would get."""
    found = await store.account(org_id, provision=False)
    account: Any = None
    if found is None:
        plan: PlanTerms = await store.plan(store.default_plan)
        period = month_start(store.clock().date())
        allowance = plan.monthly_run_credits
        used = reserved = granted = usage = balance = held = 0
    else:
        account, plan = found
        period = account.period_start
        allowance, granted = account.period_allowance, account.granted_credits
        used, reserved = account.allowance_used, account.allowance_reserved
        usage = account.usage_millicredits
        balance, held = account.wallet_balance_minor, account.wallet_reserved_minor
    return billing_pb2.GetUsageResponse(
        found=account is not None,
        plan=plan.name,
        monthly_run_credits=plan.monthly_run_credits,
        period_start=pb.timestamp(_midnight(period)),
        period_end=pb.timestamp(_midnight(_next_month(period))),
        run_credits=billing_pb2.RunCredits(
            allowance=allowance,
            granted=granted,
            used=used,
            reserved=reserved,
            available=max(0, allowance - used - reserved),
        ),
        usage_millicredits=usage,
        wallet=billing_pb2.Wallet(
            balance_minor=balance, reserved_minor=held, available_minor=balance - held
        ),
    )


class BillingServicer(billing_pb2_grpc.BillingServiceServicer):
    """`loopline.billing.v1.BillingService`: Admit over `Admission`, the rest over `Ledger`."""

    def __init__(self, admission: Admission, ledger: Ledger) -> None:
        self.admission = admission
        self.ledger = ledger

    @unary
    async def Admit(  # noqa: N802
        self, request: billing_pb2.AdmitRequest, context: grpc.aio.ServicerContext
    ) -> billing_pb2.AdmitResponse:
        """Admit (or replay) a turn; denials are rich errors carrying a Denial detail."""
        admitted = await self.admission.admit(
            request.organization_id,
            request.turn_key,
            request.usage_type,
            request.rate_class,
            request.credits,
        )
        r = admitted.reservation
        return billing_pb2.AdmitResponse(
            reservation_id=r.id,
            state=STATE_TO_PB[r.state],
            credits=r.credits,
            rate_limit=_rate_pb(admitted.rate),
            replayed=admitted.replayed,
        )

    @unary
    async def Charge(  # noqa: N802
        self, request: billing_pb2.ChargeRequest, context: grpc.aio.ServicerContext
    ) -> billing_pb2.ChargeResponse:
        """Charge a held reservation exactly once (a replay returns the same ledger entry)."""
        result = await self.ledger.charge(request.reservation_id)
        return billing_pb2.ChargeResponse(
            state=STATE_TO_PB[result.state], ledger_entry_id=result.ledger_entry_id
        )

    @unary
    async def ChargeBatch(  # noqa: N802
        self, request: billing_pb2.ChargeBatchRequest, context: grpc.aio.ServicerContext
    ) -> billing_pb2.ChargeBatchResponse:
        """Charge several reservations, each as Charge, an expired hold charged late and a charge
        that cannot be posted answered in its result (`Ledger.charge_batch`); results in order."""
        results = await self.ledger.charge_batch(
            [charge.reservation_id for charge in request.charges]
        )
        return billing_pb2.ChargeBatchResponse(
            results=[
                billing_pb2.ChargeResponse()
                if r is None
                else billing_pb2.ChargeResponse(
                    state=STATE_TO_PB[r.state], ledger_entry_id=r.ledger_entry_id
                )
                for r in results
            ]
        )

    @unary
    async def Release(  # noqa: N802
        self, request: billing_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> billing_pb2.ReleaseResponse:
        """Release a held reservation at most once; a charged one is left charged."""
        state = await self.ledger.release(request.reservation_id, request.reason)
        return billing_pb2.ReleaseResponse(state=STATE_TO_PB[state])

    @unary
    async def RecordUsage(  # noqa: N802
        self, request: billing_pb2.RecordUsageRequest, context: grpc.aio.ServicerContext
    ) -> billing_pb2.RecordUsageResponse:
        """Record one model call's token usage, idempotent by (run_id, call_index)."""
        result = await self.ledger.record_usage(request)
        return billing_pb2.RecordUsageResponse(
            usage_id=result.usage_id, millicredits=result.millicredits, replayed=result.replayed
        )

    @unary
    async def RecordUsageBatch(  # noqa: N802
        self, request: billing_pb2.RecordUsageBatchRequest, context: grpc.aio.ServicerContext
    ) -> billing_pb2.RecordUsageBatchResponse:
        """Record several model calls' usage, each as RecordUsage; results in the order of the calls
        (`Ledger.record_usage_batch`); an error fails the call, and a retry replays what was
        recorded."""
        results = await self.ledger.record_usage_batch(list(request.calls))
        return billing_pb2.RecordUsageBatchResponse(
            results=[
                billing_pb2.RecordUsageResponse(
                    usage_id=r.usage_id, millicredits=r.millicredits, replayed=r.replayed
                )
                for r in results
            ]
        )

    @unary
    async def RecordToolUsage(  # noqa: N802
        self, request: billing_pb2.RecordToolUsageRequest, context: grpc.aio.ServicerContext
    ) -> billing_pb2.RecordToolUsageResponse:
        """Charge one tool call's catalogue cost, idempotent by (run_id, tool_call_id)."""
        entry_id, replayed = await self.ledger.record_tool_usage(request)
        return billing_pb2.RecordToolUsageResponse(ledger_entry_id=entry_id, replayed=replayed)

    @unary
    async def GetUsage(  # noqa: N802
        self, request: billing_pb2.GetUsageRequest, context: grpc.aio.ServicerContext
    ) -> billing_pb2.GetUsageResponse:
        """The organization's plan, run credits, usage and wallet this period (`usage_of`); never
        provisions an account."""
        return await usage_of(self.ledger.store, request.organization_id)
