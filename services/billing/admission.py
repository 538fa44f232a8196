"""Admission: whether a turn (or another billed action) may start, and the hold that reserves it.

`Admission.admit` checks, in order, before anything is reserved:

1. rate   - moving window per (org, rate class) from the plan's `rate_limits`
            -> `rate_limited` (gRPC RESOURCE_EXHAUSTED + RetryInfo)
2. quota  - the plan's `max_runs_per_day` (usage type "run", UTC day)
            -> `quota_exceeded` (FAILED_PRECONDITION)
3. credit - the period allowance (plan's monthly run credits + granted credits)
            -> `credit_plan_exhausted` (FAILED_PRECONDITION) when the plan allows no
               wallet overage
4. wallet - when the allowance is spent and the plan allows overage, the prepaid wallet
            (credits x `wallet_price_minor`) -> `wallet_insufficient_funds` (FAILED_PRECONDITION)

(org, turn_key) identifies an admission: a repeat returns the existing reservation with
`replayed=True` and its current state, counting no rate limit (another usage type or credit
amount is ALREADY_EXISTS / TURN_KEY_REUSED). An organization with no account gets one on its
first admission, on the default plan. The layers run as conditional UPDATEs in the store
(`BillingStore.admit`), so concurrent admissions never overspend.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import grpc
from sqlalchemy.exc import IntegrityError

from services.billing.errors import (
    CREDIT_PLAN_EXHAUSTED,
    QUOTA_EXCEEDED,
    RATE_LIMITED,
    WALLET_INSUFFICIENT_FUNDS,
    denial_error,
    invalid,
)
from services.billing.models import ALLOWANCE, HELD, WALLET, month_start, new_id
from services.billing.plans import PlanTerms
from services.billing.rates import RateDecision, RateLimiter
from services.billing.store import BillingStore, Refusal
from services.common import logging as loopline_logging
from services.common import metrics
from services.common.errors import BILLING_DOMAIN, RpcError

log = logging.getLogger(__name__)

#: Credits reserved when AdmitRequest.credits is 0, per usage type.
DEFAULT_CREDITS = {"run": 1}
DEFAULT_USAGE_TYPE = "run"
DEFAULT_RATE_CLASS = "sync_exec"


@dataclass(frozen=True)
class AdmitResult:
    """The result of Admit: the reservation (row or values), replay flag, the rate state."""

    reservation: Any
    replayed: bool
    rate: RateDecision


def _checked(
    org_id: str, turn_key: str, usage_type: str, rate_class: str, credits: int
) -> tuple[str, str, int]:
    """(usage type, rate class, credits) with their defaults; RpcError INVALID_ARGUMENT."""
    if not org_id:
        raise invalid("ORGANIZATION_ID_REQUIRED", "organization_id is required")
    if not turn_key:
        raise invalid("TURN_KEY_REQUIRED", "turn_key is required")
    if len(turn_key) > 255 or len(org_id) > 128:
        raise invalid("KEY_TOO_LONG", "organization_id or turn_key is too long")
    usage_type = usage_type or DEFAULT_USAGE_TYPE
    rate_class = rate_class or DEFAULT_RATE_CLASS
    if credits < 0:
        raise invalid("CREDITS_NEGATIVE", "credits must not be negative")
    if credits == 0:
        if usage_type not in DEFAULT_CREDITS:
            raise invalid("CREDITS_REQUIRED", f"credits are required for usage type {usage_type!r}")
        credits = DEFAULT_CREDITS[usage_type]
    return usage_type, rate_class, credits


class Admission:
    """The admission rules over a store and the rate limiter.

    Args:
        store: the billing store.
        rates: the rate limiter (memory or Redis).
        hold_seconds: how long a reservation stays HELD before the sweeper may expire it.
    """

    def __init__(self, store: BillingStore, rates: RateLimiter, *, hold_seconds: int) -> None:
        self.store = store
        self.rates = rates
        self.hold_seconds = hold_seconds

    async def admit(
        self,
        org_id: str,
        turn_key: str,
        usage_type: str = "",
        rate_class: str = "",
        credits: int = 0,
    ) -> AdmitResult:
        """Check rate -> quota -> credit -> wallet and hold `credits` for `turn_key`.

        Args:
            org_id, turn_key: required; (org_id, turn_key) is the idempotency key.
            usage_type: "" means "run". rate_class: "" means "sync_exec".
            credits: run credits to hold; 0 means DEFAULT_CREDITS[usage_type].

        Returns an AdmitResult (a replay returns the existing reservation in its current state).
        Raises RpcError: INVALID_ARGUMENT on a bad request, ALREADY_EXISTS/TURN_KEY_REUSED,
        or a denial (see `denial_error`), with nothing reserved.
        """
        usage_type, rate_class, credits = _checked(
            org_id, turn_key, usage_type, rate_class, credits
        )
        store = self.store
        with loopline_logging.bind(org_id=org_id):
            now = store.clock()
            period = month_start(now.date())
            today = now.date().isoformat()
            values = {
                "id": new_id("res"),
                "org_id": org_id,
                "turn_key": turn_key,
                "usage_type": usage_type,
                "rate_class": rate_class,
                "credits": credits,
                "funding": ALLOWANCE,
                "wallet_minor": 0,
                "quota_day": today if usage_type == "run" else "",
                "state": HELD,
                "created_at": now,
                "expires_at": now + datetime.timedelta(seconds=self.hold_seconds),
                "resolved_at": None,
                "release_reason": None,
            }
            try:
                kind, detail, row, plan = await store.admit(
                    values, store.known(org_id, period), period, today, self.rates
                )
            except IntegrityError as taken:
                # A concurrent Admit with the same turn key won the insert; ours rolled back.
                return await self._replay_taken(taken, values, period)
            if row is not None:
                store.remember(org_id, row.plan, row.period_start)
            if kind == "admitted":
                rate, fresh = detail
                if fresh is not None:  # the slow path re-read the account
                    store.remember(org_id, *fresh)
                metrics.admission("wallet" if values["funding"] == WALLET else "credit", "admitted")
                if log.isEnabledFor(logging.DEBUG):
                    log.debug(
                        "admitted",
                        extra={
                            "fields": {
                                "reservation_id": values["id"],
                                "usage_type": usage_type,
                                "credits": credits,
                                "funding": values["funding"],
                            }
                        },
                    )
                return AdmitResult(SimpleNamespace(**values), False, rate)
            if kind == "replay":
                return await self._replay(
                    detail, usage_type, credits, plan.rate_limits.get(rate_class)
                )
            raise self._denial(kind, detail, plan, rate_class, credits, today)

    async def _replay_taken(
        self, taken: IntegrityError, values: dict[str, Any], period: datetime.date
    ) -> AdmitResult:
        """The replay of the reservation a concurrent Admit inserted first (else `taken`)."""
        org_id, turn_key = values["org_id"], values["turn_key"]
        known = self.store.known(org_id, period)
        existing, row = await self.store.find_reservation(org_id, turn_key, known is None)
        if existing is None:
            raise taken
        name = row.plan if row is not None else known
        assert name is not None  # the account was read when not cached
        plan = await self.store.plan(name)
        return await self._replay(
            existing,
            values["usage_type"],
            values["credits"],
            plan.rate_limits.get(values["rate_class"]),
        )

    async def _replay(
        self, existing: Any, usage_type: str, credits: int, rate_limit: str | None
    ) -> AdmitResult:
        if existing.usage_type != usage_type or existing.credits != credits:
            raise RpcError(
                grpc.StatusCode.ALREADY_EXISTS,
                "TURN_KEY_REUSED",
                "turn key already admitted with another usage type or credit amount",
                domain=BILLING_DOMAIN,
            )
        rate = await self.rates.peek(existing.org_id, existing.rate_class, rate_limit)
        metrics.admission("none", "replayed")
        log.info(
            "admission replayed",
            extra={"fields": {"reservation_id": existing.id, "state": existing.state}},
        )
        return AdmitResult(existing, True, rate)

    @staticmethod
    def _denial(
        kind: str, detail: Any, plan: PlanTerms, rate_class: str, credits: int, today: str
    ) -> RpcError:
        """The denial of a refused admission: the rate layer's (`detail` = its RateDecision) or,
        for kind "denied", the refusing layer's with the account figures read in the store."""
        if kind == "rate":
            metrics.admission("rate", "denied")
            log.info(
                "admission denied", extra={"fields": {"layer": "rate", "rate_class": rate_class}}
            )
            return denial_error(
                RATE_LIMITED,
                "rate",
                f"rate limit {plan.rate_limits.get(rate_class)} exceeded for {rate_class}; "
                f"retry in {detail.reset_seconds} s",
                key=rate_class,
                current=detail.limit - detail.remaining,
                limit=detail.limit,
                rate=detail,
            )
        refused: Refusal = detail
        metrics.admission(refused.layer, "denied")
        log.info("admission denied", extra={"fields": {"layer": refused.layer}})
        return _layer_denial(refused, credits, today)


def _layer_denial(refused: Refusal, credits: int, today: str) -> RpcError:
    """The denial of the quota, credit or wallet layer, with the figures read when it refused."""
    layer, account, plan = refused.layer, refused.account, refused.plan
    if layer == "quota":
        current = account.runs_today if account.quota_day == today else 0
        return denial_error(
            QUOTA_EXCEEDED,
            "quota",
            f"daily run quota of plan {plan.name} reached "
            f"({current} of {plan.max_runs_per_day} runs today)",
            key="runs_per_day",
            current=current,
            limit=plan.max_runs_per_day,
        )
    if layer == "credit":
        used = account.allowance_used + account.allowance_reserved
        return denial_error(
            CREDIT_PLAN_EXHAUSTED,
            "credit",
            f"run credit allowance of plan {plan.name} is exhausted "
            f"({used} of {account.period_allowance} used)",
            key="run_credits",
            current=used,
            limit=account.period_allowance,
        )
    available = account.wallet_balance_minor - account.wallet_reserved_minor
    cost = credits * plan.wallet_price_minor
    return denial_error(
        WALLET_INSUFFICIENT_FUNDS,
        "wallet",
        f"run credit allowance is exhausted and the wallet cannot cover {credits} credit(s): "
        f"{available} minor units available, {cost} needed",
        key="wallet_minor_units",
        current=available,
        limit=cost,
    )
