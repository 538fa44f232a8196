"""The billing domain: admission, charge, release, expiry, token metering, admin operations.

Source of the rules: DESIGN.md "Billing", issue 5, and the comments of
`protos/loopline/billing/v1/billing.proto`.

Admission (`BillingCore.admit`) checks, in order, before anything is reserved:

1. rate   - moving window per (org, rate class) from the plan's `rate_limits`
            -> `rate_limited` (gRPC RESOURCE_EXHAUSTED + RetryInfo)
2. quota  - the plan's `max_runs_per_day` (usage type "run", UTC day)
            -> `quota_exceeded` (FAILED_PRECONDITION)
3. credit - the period allowance (plan's monthly run credits + granted credits)
            -> `credit_plan_exhausted` (FAILED_PRECONDITION) when the plan allows no
               wallet overage
4. wallet - when the allowance is spent and the plan allows overage, the prepaid wallet
            (credits x `wallet_price_minor`) -> `wallet_insufficient_funds` (FAILED_PRECONDITION)

Every denial is an `RpcError` in domain `billing.loopline.dev` whose reason is the code in
UPPER_SNAKE and whose details hold a `loopline.billing.v1.Denial`.

Idempotency: Admit by (org, turn_key) returns the existing reservation with
`replayed=True` and its current state, without counting the rate limit again (a
reused turn key with another usage type or credit amount is ALREADY_EXISTS /
TURN_KEY_REUSED); Charge posts ledger entry "charge:{reservation_id}" at most once;
Release and the expiry sweeper void a HELD reservation at most once; RecordUsage is
idempotent by (run_id, call_index) and posts "usage:{run_id}:{call_index}".

Concurrency: every balance change is a conditional UPDATE (`... WHERE used + reserved +
n <= allowance`, `... WHERE state = 'held'`) inside the transaction that writes the
matching reservation or ledger row, so balances never go negative and no reservation
is resolved twice, on SQLite (writers serialize) and on PostgreSQL (row locks, with the
WHERE re-checked after a concurrent update).

Auto-provisioning: an organization with no account gets one on its first Admit or
RecordUsage, on the configured default plan (`LOOPLINE_BILLING_DEFAULT_PLAN`,
"developer": 1000 run credits a month, wallet overage allowed, sync_exec 600/minute).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from sqlalchemy import and_, case, func, select, true, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loopline.billing.v1 import billing_pb2
from services.billing.models import (
    ALLOWANCE,
    CHARGED,
    EXPIRED,
    HELD,
    RELEASED,
    UNIT_CREDIT,
    UNIT_MILLICREDIT,
    UNIT_MINOR,
    WALLET,
    Account,
    LedgerEntry,
    Plan,
    Reservation,
    UsageRecord,
    utcnow,
)
from services.billing.pricing import PriceTable
from services.billing.rates import RateDecision, RateLimiter
from services.common import logging as loopline_logging
from services.common.errors import BILLING_DOMAIN, RpcError

log = logging.getLogger(__name__)

#: Credits reserved when AdmitRequest.credits is 0, per usage type.
DEFAULT_CREDITS = {"run": 1}
DEFAULT_USAGE_TYPE = "run"
DEFAULT_RATE_CLASS = "sync_exec"

#: Denial codes (Denial.code); the ErrorInfo reason is the same in UPPER_SNAKE.
RATE_LIMITED = "rate_limited"
QUOTA_EXCEEDED = "quota_exceeded"
CREDIT_PLAN_EXHAUSTED = "credit_plan_exhausted"
WALLET_INSUFFICIENT_FUNDS = "wallet_insufficient_funds"

STATE_TO_PB = {
    HELD: billing_pb2.RESERVATION_STATE_HELD,
    CHARGED: billing_pb2.RESERVATION_STATE_CHARGED,
    RELEASED: billing_pb2.RESERVATION_STATE_RELEASED,
    EXPIRED: billing_pb2.RESERVATION_STATE_EXPIRED,
}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def month_start(day: datetime.date) -> datetime.date:
    """The first day of `day`'s calendar month (billing periods are calendar months, UTC)."""
    return day.replace(day=1)


def denial_error(
    code: str,
    layer: str,
    reason: str,
    *,
    key: str | None = None,
    current: int | None = None,
    limit: int | None = None,
    rate: RateDecision | None = None,
) -> RpcError:
    """The RpcError of a refused admission.

    Status RESOURCE_EXHAUSTED for layer "rate" (with RetryInfo = `rate.reset_seconds`),
    FAILED_PRECONDITION otherwise; ErrorInfo reason = `code.upper()`, domain
    BILLING_DOMAIN, metadata {"layer": layer}; details = [Denial].
    """
    denial = billing_pb2.Denial(code=code, layer=layer, reason=reason)
    if key is not None:
        denial.key = key
    if current is not None:
        denial.current = current
    if limit is not None:
        denial.limit = limit
    retry_after: float | None = None
    if rate is not None:
        denial.retry_after_seconds = rate.reset_seconds
        denial.rate_limit.CopyFrom(
            billing_pb2.RateLimitState(limit=rate.limit, remaining=rate.remaining, reset_seconds=rate.reset_seconds)
        )
        retry_after = float(rate.reset_seconds)
    return RpcError(
        code=grpc.StatusCode.RESOURCE_EXHAUSTED if layer == "rate" else grpc.StatusCode.FAILED_PRECONDITION,
        reason=code.upper(),
        message=reason,
        domain=BILLING_DOMAIN,
        metadata={"layer": layer, "code": code},
        details=[denial],
        retry_after_s=retry_after,
    )


def not_found(reservation_id: str) -> RpcError:
    """NOT_FOUND / RESERVATION_NOT_FOUND for an unknown reservation id."""
    return RpcError(
        grpc.StatusCode.NOT_FOUND,
        "RESERVATION_NOT_FOUND",
        f"reservation {reservation_id!r} not found",
        domain=BILLING_DOMAIN,
    )


def invalid(reason: str, message: str) -> RpcError:
    """INVALID_ARGUMENT with `reason` (UPPER_SNAKE)."""
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, reason, message, domain=BILLING_DOMAIN)


@dataclass(frozen=True)
class Admission:
    """The result of Admit: the reservation row, whether it was a replay, the rate state."""

    reservation: Reservation
    replayed: bool
    rate: RateDecision


@dataclass(frozen=True)
class ChargeResult:
    """The result of Charge: final state ("charged"), the ledger entry id, replay flag."""

    state: str
    ledger_entry_id: str
    replayed: bool


@dataclass(frozen=True)
class UsageResult:
    """The result of RecordUsage: usage record id, millicredits charged, replay flag."""

    usage_id: str
    millicredits: int
    replayed: bool


class _Denied(Exception):
    def __init__(self, layer: str) -> None:
        super().__init__(layer)
        self.layer = layer


class BillingCore:
    """The billing rules over one database and one rate-limit storage.

    Args:
        sessions: async session factory of the billing database (migrated, plans synced).
        rates: the rate limiter (memory or Redis).
        prices: the token price table.
        default_plan: plan name given to auto-provisioned accounts (must exist in `plans`).
        hold_seconds: how long a reservation stays HELD before the sweeper may expire it.
        clock: returns the current aware UTC time (tests may replace it).
    """

    def __init__(
        self,
        sessions: async_sessionmaker,
        rates: RateLimiter,
        prices: PriceTable,
        *,
        default_plan: str,
        hold_seconds: int,
        clock: Any = utcnow,
    ) -> None:
        self.sessions = sessions
        self.rates = rates
        self.prices = prices
        self.default_plan = default_plan
        self.hold_seconds = hold_seconds
        self.clock = clock
        bind = sessions.kw.get("bind")
        # SQLite allows one writer at a time; queueing writers on an asyncio.Lock instead of
        # SQLite's sleeping busy handler keeps admissions fast under contention. Correctness
        # never depends on it (the conditional UPDATEs do), so other processes are safe too.
        self._sqlite_writer = asyncio.Lock() if bind is not None and bind.dialect.name == "sqlite" else None

    @contextlib.asynccontextmanager
    async def _writer(self) -> AsyncIterator[None]:
        """Serialize this process's write transactions on SQLite (no-op elsewhere)."""
        if self._sqlite_writer is None:
            yield
            return
        async with self._sqlite_writer:
            yield

    # ------------------------------------------------------------------ accounts

    @staticmethod
    def _roll_period_stmt(org_id: str, period: datetime.date) -> Any:
        """UPDATE starting period `period` for `org_id` if its period is older (else no row)."""
        monthly = select(Plan.monthly_run_credits).where(Plan.name == Account.plan).scalar_subquery()
        return (
            update(Account)
            .where(Account.org_id == org_id, Account.period_start < period)
            .values(
                period_start=period,
                period_allowance=monthly,
                granted_credits=0,
                allowance_used=0,
                usage_millicredits=0,
            )
            .execution_options(synchronize_session=False)
        )

    async def _insert_account_if_absent(self, session: AsyncSession, org_id: str, plan: Plan) -> bool:
        """INSERT the account unless it exists (race-safe ON CONFLICT DO NOTHING); True if inserted."""
        values = {
            "org_id": org_id,
            "plan": plan.name,
            "period_start": month_start(self.clock().date()),
            "period_allowance": plan.monthly_run_credits,
            "granted_credits": 0,
            "allowance_used": 0,
            "allowance_reserved": 0,
            "wallet_balance_minor": 0,
            "wallet_reserved_minor": 0,
            "usage_millicredits": 0,
            "quota_day": "",
            "runs_today": 0,
            "created_at": self.clock(),
        }
        dialect = session.bind.dialect.name
        insert = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}[dialect]
        result = await session.execute(
            insert(Account).values(**values).on_conflict_do_nothing(index_elements=["org_id"])
        )
        return result.rowcount == 1

    async def account(self, org_id: str, *, provision: bool = True) -> tuple[Account, Plan] | None:
        """The account of `org_id` and its plan, rolled into the current period.

        Provisions it on the default plan when absent and `provision` (else returns None).
        Raises RuntimeError when the default plan is not in the `plans` table.
        """
        period = month_start(self.clock().date())
        async with self.sessions() as session:
            row = (await session.execute(select(Account, Plan).join(Plan).where(Account.org_id == org_id))).first()
            if row is not None and row[0].period_start >= period:
                return row[0], row[1]
        if row is None and not provision:
            return None
        async with self.sessions() as session:
            async with self._writer(), session.begin():
                if row is None:
                    plan = await session.get(Plan, self.default_plan)
                    if plan is None:
                        raise RuntimeError(f"default plan {self.default_plan!r} is not in the plans table")
                    if await self._insert_account_if_absent(session, org_id, plan):
                        log.info("account provisioned", extra={"fields": {"org_id": org_id, "plan": plan.name}})
                else:
                    await session.execute(self._roll_period_stmt(org_id, period))
            row = (
                await session.execute(
                    select(Account, Plan)
                    .join(Plan)
                    .where(Account.org_id == org_id)
                    .execution_options(populate_existing=True)
                )
            ).one()
            return row[0], row[1]

    # ------------------------------------------------------------------ admit

    async def _find_reservation(self, org_id: str, turn_key: str) -> Reservation | None:
        async with self.sessions() as session:
            return (
                await session.execute(
                    select(Reservation).where(Reservation.org_id == org_id, Reservation.turn_key == turn_key)
                )
            ).scalar_one_or_none()

    async def _replay(self, existing: Reservation, usage_type: str, credits: int, rate_limit: str | None) -> Admission:
        if existing.usage_type != usage_type or existing.credits != credits:
            raise RpcError(
                grpc.StatusCode.ALREADY_EXISTS,
                "TURN_KEY_REUSED",
                "turn key already admitted with another usage type or credit amount",
                domain=BILLING_DOMAIN,
            )
        rate = await self.rates.peek(existing.org_id, existing.rate_class, rate_limit)
        log.info("admission replayed", extra={"fields": {"reservation_id": existing.id, "state": existing.state}})
        return Admission(existing, True, rate)

    async def admit(
        self, org_id: str, turn_key: str, usage_type: str = "", rate_class: str = "", credits: int = 0
    ) -> Admission:
        """Check rate -> quota -> credit -> wallet and hold `credits` for `turn_key`.

        Args:
            org_id, turn_key: required; (org_id, turn_key) is the idempotency key.
            usage_type: "" means "run". rate_class: "" means "sync_exec".
            credits: run credits to hold; 0 means DEFAULT_CREDITS[usage_type].

        Returns an Admission (a replay returns the existing reservation in its current state).
        Raises RpcError: INVALID_ARGUMENT on a bad request, ALREADY_EXISTS/TURN_KEY_REUSED,
        or a denial (see `denial_error`), with nothing reserved.
        """
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

        with loopline_logging.bind(org_id=org_id):
            account_plan = await self.account(org_id)
            assert account_plan is not None
            _, plan = account_plan
            rate_limit = plan.rate_limits.get(rate_class)
            existing = await self._find_reservation(org_id, turn_key)
            if existing is not None:
                return await self._replay(existing, usage_type, credits, rate_limit)

            rate = await self.rates.hit(org_id, rate_class, rate_limit)
            if not rate.allowed:
                log.info("admission denied", extra={"fields": {"layer": "rate", "rate_class": rate_class}})
                raise denial_error(
                    RATE_LIMITED,
                    "rate",
                    f"rate limit {rate_limit} exceeded for {rate_class}; retry in {rate.reset_seconds} s",
                    key=rate_class,
                    current=rate.limit - rate.remaining,
                    limit=rate.limit,
                    rate=rate,
                )

            now = self.clock()
            today = now.date().isoformat()
            counts_runs = usage_type == "run"
            reservation = Reservation(
                id=_new_id("res"),
                org_id=org_id,
                turn_key=turn_key,
                usage_type=usage_type,
                rate_class=rate_class,
                credits=credits,
                funding=ALLOWANCE,
                wallet_minor=0,
                quota_day=today if counts_runs else "",
                state=HELD,
                created_at=now,
                expires_at=now + datetime.timedelta(seconds=self.hold_seconds),
            )
            try:
                async with self._writer(), self.sessions() as session, session.begin():
                    await self._reserve(session, reservation, plan, today, counts_runs)
            except _Denied as denied:
                raise await self._denial(denied.layer, org_id, plan, credits, today) from None
            except IntegrityError:
                # A concurrent Admit with the same turn key won the insert; ours rolled back.
                existing = await self._find_reservation(org_id, turn_key)
                if existing is None:
                    raise
                return await self._replay(existing, usage_type, credits, rate_limit)
            log.info(
                "admitted",
                extra={
                    "fields": {
                        "reservation_id": reservation.id,
                        "usage_type": usage_type,
                        "credits": credits,
                        "funding": reservation.funding,
                    }
                },
            )
            return Admission(reservation, False, rate)

    async def _reserve(
        self, session: AsyncSession, reservation: Reservation, plan: Plan, today: str, counts_runs: bool
    ) -> None:
        """Quota, allowance and wallet as conditional UPDATEs, then the reservation row.

        Raises _Denied(layer) (the enclosing transaction rolls everything back).
        """
        org_id, credits = reservation.org_id, reservation.credits
        if counts_runs:
            allowed: Any = true()
            if plan.max_runs_per_day is not None:
                runs = case((Account.quota_day == today, Account.runs_today), else_=0)
                allowed = runs + 1 <= plan.max_runs_per_day
            result = await session.execute(
                update(Account)
                .where(Account.org_id == org_id, allowed)
                .values(
                    runs_today=case((Account.quota_day == today, Account.runs_today + 1), else_=1),
                    quota_day=today,
                )
                .execution_options(synchronize_session=False)
            )
            if result.rowcount != 1:
                raise _Denied("quota")
        result = await session.execute(
            update(Account)
            .where(
                Account.org_id == org_id,
                Account.allowance_used + Account.allowance_reserved + credits <= Account.period_allowance,
            )
            .values(allowance_reserved=Account.allowance_reserved + credits)
            .execution_options(synchronize_session=False)
        )
        if result.rowcount != 1:
            if not plan.wallet_overage:
                raise _Denied("credit")
            cost = credits * plan.wallet_price_minor
            result = await session.execute(
                update(Account)
                .where(
                    Account.org_id == org_id,
                    Account.wallet_balance_minor - Account.wallet_reserved_minor >= cost,
                )
                .values(wallet_reserved_minor=Account.wallet_reserved_minor + cost)
                .execution_options(synchronize_session=False)
            )
            if result.rowcount != 1:
                raise _Denied("wallet")
            reservation.funding, reservation.wallet_minor = WALLET, cost
        session.add(reservation)
        await session.flush()

    async def _denial(self, layer: str, org_id: str, plan: Plan, credits: int, today: str) -> RpcError:
        """Build the denial of `layer` with the account's current figures."""
        async with self.sessions() as session:
            account = await session.get(Account, org_id)
        assert account is not None
        log.info("admission denied", extra={"fields": {"layer": layer}})
        if layer == "quota":
            current = account.runs_today if account.quota_day == today else 0
            return denial_error(
                QUOTA_EXCEEDED,
                "quota",
                f"daily run quota of plan {plan.name} reached ({current} of {plan.max_runs_per_day} runs today)",
                key="runs_per_day",
                current=current,
                limit=plan.max_runs_per_day,
            )
        if layer == "credit":
            used = account.allowance_used + account.allowance_reserved
            return denial_error(
                CREDIT_PLAN_EXHAUSTED,
                "credit",
                f"run credit allowance of plan {plan.name} is exhausted ({used} of {account.period_allowance} used)",
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

    # ------------------------------------------------------------------ charge / release / expire

    async def charge(self, reservation_id: str) -> ChargeResult:
        """Post a HELD reservation to the ledger, exactly once.

        Moves the hold into `allowance_used` (or debits the wallet) and appends ledger entry
        "charge:{reservation_id}" in one transaction. A second call returns the same entry
        (replayed=True). Raises RpcError NOT_FOUND for an unknown id, FAILED_PRECONDITION
        RESERVATION_RELEASED / RESERVATION_EXPIRED when the hold was voided.
        """
        if not reservation_id:
            raise invalid("RESERVATION_ID_REQUIRED", "reservation_id is required")
        now = self.clock()
        async with self.sessions() as session:
            async with self._writer(), session.begin():
                result = await session.execute(
                    update(Reservation)
                    .where(Reservation.id == reservation_id, Reservation.state == HELD)
                    .values(state=CHARGED, resolved_at=now)
                    .execution_options(synchronize_session=False)
                )
                if result.rowcount == 1:
                    reservation = await session.get(Reservation, reservation_id, populate_existing=True)
                    assert reservation is not None
                    await session.execute(self._roll_period_stmt(reservation.org_id, month_start(now.date())))
                    if reservation.funding == WALLET:
                        values = {
                            "wallet_reserved_minor": Account.wallet_reserved_minor - reservation.wallet_minor,
                            "wallet_balance_minor": Account.wallet_balance_minor - reservation.wallet_minor,
                        }
                        unit, amount = UNIT_MINOR, -reservation.wallet_minor
                    else:
                        values = {
                            "allowance_reserved": Account.allowance_reserved - reservation.credits,
                            "allowance_used": Account.allowance_used + reservation.credits,
                        }
                        unit, amount = UNIT_CREDIT, -reservation.credits
                    await session.execute(
                        update(Account)
                        .where(Account.org_id == reservation.org_id)
                        .values(**values)
                        .execution_options(synchronize_session=False)
                    )
                    entry = LedgerEntry(
                        id=_new_id("led"),
                        idempotency_key=f"charge:{reservation_id}",
                        org_id=reservation.org_id,
                        kind="run_charge",
                        unit=unit,
                        amount=amount,
                        reservation_id=reservation_id,
                        note=f"{reservation.usage_type} {reservation.credits} credit(s) via {reservation.funding}",
                        created_at=now,
                    )
                    session.add(entry)
                    with loopline_logging.bind(org_id=reservation.org_id):
                        log.info(
                            "charged",
                            extra={"fields": {"reservation_id": reservation_id, "ledger_entry_id": entry.id}},
                        )
                    return ChargeResult(CHARGED, entry.id, False)
            reservation = await session.get(Reservation, reservation_id)
            if reservation is None:
                raise not_found(reservation_id)
            if reservation.state == CHARGED:
                entry_id = (
                    await session.execute(
                        select(LedgerEntry.id).where(LedgerEntry.idempotency_key == f"charge:{reservation_id}")
                    )
                ).scalar_one()
                return ChargeResult(CHARGED, entry_id, True)
            raise RpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"RESERVATION_{reservation.state.upper()}",
                f"reservation {reservation_id} is {reservation.state} and cannot be charged",
                domain=BILLING_DOMAIN,
            )

    async def _void(self, session: AsyncSession, reservation_id: str, state: str, reason: str) -> Reservation | None:
        """Move a HELD reservation to `state` (released/expired) and return its hold; None if not HELD."""
        result = await session.execute(
            update(Reservation)
            .where(Reservation.id == reservation_id, Reservation.state == HELD)
            .values(state=state, resolved_at=self.clock(), release_reason=reason[:255] or None)
            .execution_options(synchronize_session=False)
        )
        if result.rowcount != 1:
            return None
        reservation = await session.get(Reservation, reservation_id, populate_existing=True)
        assert reservation is not None
        if reservation.funding == WALLET:
            values = {"wallet_reserved_minor": Account.wallet_reserved_minor - reservation.wallet_minor}
        else:
            values = {"allowance_reserved": Account.allowance_reserved - reservation.credits}
        await session.execute(
            update(Account)
            .where(Account.org_id == reservation.org_id)
            .values(**values)
            .execution_options(synchronize_session=False)
        )
        if reservation.quota_day:
            # Give the voided run back to the daily quota (only if still the same day).
            await session.execute(
                update(Account)
                .where(
                    Account.org_id == reservation.org_id,
                    Account.quota_day == reservation.quota_day,
                    Account.runs_today > 0,
                )
                .values(runs_today=Account.runs_today - 1)
                .execution_options(synchronize_session=False)
            )
        return reservation

    async def release(self, reservation_id: str, reason: str = "") -> str:
        """Void a HELD reservation at most once; returns the state after the call.

        Returns "released" (now or earlier), "charged" (no-op: a charged reservation is
        never voided) or "expired". Raises RpcError NOT_FOUND for an unknown id.
        """
        if not reservation_id:
            raise invalid("RESERVATION_ID_REQUIRED", "reservation_id is required")
        async with self.sessions() as session:
            async with self._writer(), session.begin():
                voided = await self._void(session, reservation_id, RELEASED, reason)
            if voided is not None:
                with loopline_logging.bind(org_id=voided.org_id):
                    log.info("released", extra={"fields": {"reservation_id": reservation_id, "reason": reason[:255]}})
                return RELEASED
            reservation = await session.get(Reservation, reservation_id)
            if reservation is None:
                raise not_found(reservation_id)
            return reservation.state

    async def expire_holds(self, now: datetime.datetime | None = None, batch: int = 500) -> int:
        """Expire every HELD reservation whose `expires_at` <= `now` (default: the clock).

        Each is voided in its own transaction (a concurrent Charge or Release wins or loses
        cleanly). Returns how many were expired.
        """
        now = now or self.clock()
        expired = 0
        while True:
            async with self.sessions() as session:
                ids = (
                    await session.execute(
                        select(Reservation.id)
                        .where(Reservation.state == HELD, Reservation.expires_at <= now)
                        .order_by(Reservation.expires_at)
                        .limit(batch)
                    )
                ).scalars().all()
            if not ids:
                return expired
            for reservation_id in ids:
                async with self._writer(), self.sessions() as session, session.begin():
                    if await self._void(session, reservation_id, EXPIRED, "hold expired") is not None:
                        expired += 1
            if len(ids) < batch:
                if expired:
                    log.info("expired holds", extra={"fields": {"count": expired}})
                return expired

    # ------------------------------------------------------------------ usage

    async def record_usage(self, request: billing_pb2.RecordUsageRequest) -> UsageResult:
        """Record one model call's token usage, idempotent by (run_id, call_index).

        Millicredits come from the price table (0 when `byok`); a non-zero amount is
        posted as ledger entry "usage:{run_id}:{call_index}" (unit millicredit) and added
        to the account's `usage_millicredits`, in the same transaction. Raises RpcError
        INVALID_ARGUMENT on missing ids or negative counts, ALREADY_EXISTS /
        USAGE_KEY_REUSED when the (run_id, call_index) belongs to another organization.
        """
        r = request
        if not r.organization_id or not r.run_id:
            raise invalid("USAGE_KEY_REQUIRED", "organization_id and run_id are required")
        if r.call_index < 0 or min(r.input_tokens, r.output_tokens, r.cache_read_tokens, r.cache_write_tokens) < 0:
            raise invalid("USAGE_NEGATIVE", "call_index and token counts must not be negative")
        millicredits = self.prices.millicredits(
            r.provider_id,
            r.model_id,
            input_tokens=r.input_tokens,
            output_tokens=r.output_tokens,
            cache_read_tokens=r.cache_read_tokens,
            cache_write_tokens=r.cache_write_tokens,
            byok=r.byok,
        )
        with loopline_logging.bind(org_id=r.organization_id, run_id=r.run_id, chat_id=r.chat_id):
            existing = await self._find_usage(r.run_id, r.call_index)
            if existing is not None:
                return self._usage_replay(existing, r.organization_id)
            await self.account(r.organization_id)
            now = self.clock()
            record = UsageRecord(
                id=_new_id("use"),
                org_id=r.organization_id,
                run_id=r.run_id,
                call_index=r.call_index,
                chat_id=r.chat_id,
                provider_id=r.provider_id,
                model_id=r.model_id,
                input_tokens=r.input_tokens,
                output_tokens=r.output_tokens,
                cache_read_tokens=r.cache_read_tokens,
                cache_write_tokens=r.cache_write_tokens,
                byok=r.byok,
                estimated=r.estimated,
                millicredits=millicredits,
                created_at=now,
            )
            try:
                async with self._writer(), self.sessions() as session, session.begin():
                    session.add(record)
                    await session.flush()
                    if millicredits:
                        session.add(
                            LedgerEntry(
                                id=_new_id("led"),
                                idempotency_key=f"usage:{r.run_id}:{r.call_index}",
                                org_id=r.organization_id,
                                kind="token_usage",
                                unit=UNIT_MILLICREDIT,
                                amount=-millicredits,
                                usage_id=record.id,
                                note=f"{r.provider_id}/{r.model_id}"[:255],
                                created_at=now,
                            )
                        )
                        await session.execute(
                            update(Account)
                            .where(Account.org_id == r.organization_id)
                            .values(usage_millicredits=Account.usage_millicredits + millicredits)
                            .execution_options(synchronize_session=False)
                        )
            except IntegrityError:
                existing = await self._find_usage(r.run_id, r.call_index)
                if existing is None:
                    raise
                return self._usage_replay(existing, r.organization_id)
            log.info(
                "usage recorded",
                extra={
                    "fields": {
                        "usage_id": record.id,
                        "call_index": r.call_index,
                        "millicredits": millicredits,
                        "byok": r.byok,
                    }
                },
            )
            return UsageResult(record.id, millicredits, False)

    async def record_tool_usage(self, request: billing_pb2.RecordToolUsageRequest) -> tuple[str, bool]:
        """Charge one tool call's catalogue cost; idempotent by (run_id, tool_call_id).

        Posts ledger entry "tool:{run_id}:{tool_call_id}" (unit millicredit, kind tool_usage)
        and adds it to the account's `usage_millicredits` in the same transaction. Returns
        (ledger entry id, replayed); ("", False) for a zero cost. Raises RpcError
        INVALID_ARGUMENT on missing ids or a negative cost, ALREADY_EXISTS / USAGE_KEY_REUSED
        when the key belongs to another organization.
        """
        r = request
        if not r.organization_id or not r.run_id or not r.tool_call_id:
            raise invalid("USAGE_KEY_REQUIRED", "organization_id, run_id and tool_call_id are required")
        if r.millicredits < 0:
            raise invalid("USAGE_NEGATIVE", "millicredits must not be negative")
        if r.millicredits == 0:
            return "", False
        key = f"tool:{r.run_id}:{r.tool_call_id}"

        async def existing() -> tuple[str, bool] | None:
            async with self.sessions() as session:
                entry = (await session.execute(select(LedgerEntry).where(LedgerEntry.idempotency_key == key))).scalar_one_or_none()
            if entry is None:
                return None
            if entry.org_id != r.organization_id:
                raise RpcError(grpc.StatusCode.ALREADY_EXISTS, "USAGE_KEY_REUSED",
                               "this (run_id, tool_call_id) was recorded for another organization", domain=BILLING_DOMAIN)
            return entry.id, True

        with loopline_logging.bind(org_id=r.organization_id, run_id=r.run_id, chat_id=r.chat_id):
            found = await existing()
            if found is not None:
                return found
            await self.account(r.organization_id)
            entry_id = _new_id("led")
            try:
                async with self._writer(), self.sessions() as session, session.begin():
                    session.add(LedgerEntry(id=entry_id, idempotency_key=key, org_id=r.organization_id, kind="tool_usage",
                                            unit=UNIT_MILLICREDIT, amount=-r.millicredits,
                                            note=f"{r.tool} {r.detail}".strip()[:255], created_at=self.clock()))
                    await session.flush()
                    await session.execute(
                        update(Account).where(Account.org_id == r.organization_id)
                        .values(usage_millicredits=Account.usage_millicredits + r.millicredits)
                        .execution_options(synchronize_session=False)
                    )
            except IntegrityError:
                found = await existing()
                if found is None:
                    raise
                return found
            return entry_id, False

    async def _find_usage(self, run_id: str, call_index: int) -> UsageRecord | None:
        async with self.sessions() as session:
            return (
                await session.execute(
                    select(UsageRecord).where(UsageRecord.run_id == run_id, UsageRecord.call_index == call_index)
                )
            ).scalar_one_or_none()

    @staticmethod
    def _usage_replay(existing: UsageRecord, org_id: str) -> UsageResult:
        if existing.org_id != org_id:
            raise RpcError(
                grpc.StatusCode.ALREADY_EXISTS,
                "USAGE_KEY_REUSED",
                "this (run_id, call_index) was recorded for another organization",
                domain=BILLING_DOMAIN,
            )
        return UsageResult(existing.id, existing.millicredits, True)

    # ------------------------------------------------------------------ admin

    async def set_plan(self, org_id: str, plan_name: str) -> None:
        """Move `org_id` (provisioned if absent) to `plan_name` from now on.

        The period allowance becomes the new plan's monthly credits + credits granted this
        period (it may fall below what is already used: further runs then draw on the
        wallet or are denied). Raises ValueError for an unknown plan.
        """
        async with self.sessions() as session:
            plan = await session.get(Plan, plan_name)
        if plan is None:
            raise ValueError(f"unknown plan {plan_name!r}")
        await self.account(org_id)
        async with self._writer(), self.sessions() as session, session.begin():
            await session.execute(
                update(Account)
                .where(Account.org_id == org_id)
                .values(plan=plan_name, period_allowance=Account.granted_credits + plan.monthly_run_credits)
                .execution_options(synchronize_session=False)
            )
        log.info("plan set", extra={"fields": {"org_id": org_id, "plan": plan_name}})

    async def grant_credits(self, org_id: str, credits: int, idempotency_key: str = "", note: str = "") -> str:
        """Add `credits` (> 0) run credits to `org_id`'s allowance for the current period.

        Posts ledger entry kind "grant" (unit credit); idempotent by `idempotency_key`
        (default: a fresh one). Returns the ledger entry id. Raises ValueError if credits <= 0.
        """
        if credits <= 0:
            raise ValueError("credits must be positive")
        await self.account(org_id)
        key = idempotency_key or f"grant:{uuid.uuid4().hex}"
        return await self._post_admin(
            org_id,
            key,
            "grant",
            UNIT_CREDIT,
            credits,
            note,
            {
                "granted_credits": Account.granted_credits + credits,
                "period_allowance": Account.period_allowance + credits,
            },
        )

    async def top_up(self, org_id: str, minor_units: int, idempotency_key: str = "", note: str = "") -> str:
        """Add `minor_units` (> 0) to `org_id`'s prepaid wallet.

        Posts ledger entry kind "top_up" (unit minor); idempotent by `idempotency_key`.
        Returns the ledger entry id. Raises ValueError if minor_units <= 0.
        """
        if minor_units <= 0:
            raise ValueError("minor_units must be positive")
        await self.account(org_id)
        key = idempotency_key or f"topup:{uuid.uuid4().hex}"
        return await self._post_admin(
            org_id,
            key,
            "top_up",
            UNIT_MINOR,
            minor_units,
            note,
            {"wallet_balance_minor": Account.wallet_balance_minor + minor_units},
        )

    async def _post_admin(
        self, org_id: str, key: str, kind: str, unit: str, amount: int, note: str, values: dict[str, Any]
    ) -> str:
        async with self.sessions() as session:
            existing = (
                await session.execute(select(LedgerEntry.id).where(LedgerEntry.idempotency_key == key))
            ).scalar_one_or_none()
        if existing is not None:
            return existing
        async with self.sessions() as session:
            entry = LedgerEntry(
                id=_new_id("led"),
                idempotency_key=key,
                org_id=org_id,
                kind=kind,
                unit=unit,
                amount=amount,
                note=note[:255] or None,
                created_at=self.clock(),
            )
            try:
                async with self._writer(), session.begin():
                    session.add(entry)
                    await session.flush()
                    await session.execute(
                        update(Account)
                        .where(Account.org_id == org_id)
                        .values(**values)
                        .execution_options(synchronize_session=False)
                    )
            except IntegrityError:
                async with self.sessions() as again:
                    return (
                        await again.execute(select(LedgerEntry.id).where(LedgerEntry.idempotency_key == key))
                    ).scalar_one()
        log.info("ledger posted", extra={"fields": {"org_id": org_id, "kind": kind, "amount": amount, "unit": unit}})
        return entry.id

    async def show(self, org_id: str, entries: int = 20) -> dict[str, Any] | None:
        """A JSON-ready view of `org_id`: account, plan terms, balances, recent ledger entries.

        Returns None when the organization has no account (nothing is provisioned).
        """
        found = await self.account(org_id, provision=False)
        if found is None:
            return None
        account, plan = found
        async with self.sessions() as session:
            rows = (
                await session.execute(
                    select(LedgerEntry)
                    .where(LedgerEntry.org_id == org_id)
                    .order_by(LedgerEntry.created_at.desc(), LedgerEntry.id)
                    .limit(entries)
                )
            ).scalars().all()
            held = (
                await session.execute(
                    select(func.count()).select_from(Reservation).where(
                        and_(Reservation.org_id == org_id, Reservation.state == HELD)
                    )
                )
            ).scalar_one()
        return {
            "organization_id": account.org_id,
            "plan": {
                "name": plan.name,
                "monthly_run_credits": plan.monthly_run_credits,
                "max_runs_per_day": plan.max_runs_per_day,
                "rate_limits": plan.rate_limits,
                "wallet_overage": plan.wallet_overage,
                "wallet_price_minor": plan.wallet_price_minor,
            },
            "period_start": account.period_start.isoformat(),
            "allowance": {
                "period_allowance": account.period_allowance,
                "granted_credits": account.granted_credits,
                "used": account.allowance_used,
                "reserved": account.allowance_reserved,
                "available": max(0, account.period_allowance - account.allowance_used - account.allowance_reserved),
            },
            "wallet": {
                "balance_minor": account.wallet_balance_minor,
                "reserved_minor": account.wallet_reserved_minor,
                "available_minor": account.wallet_balance_minor - account.wallet_reserved_minor,
            },
            "usage_millicredits_this_period": account.usage_millicredits,
            "runs_today": account.runs_today if account.quota_day == self.clock().date().isoformat() else 0,
            "held_reservations": held,
            "recent_ledger_entries": [
                {
                    "id": e.id,
                    "created_at": e.created_at.isoformat(),
                    "kind": e.kind,
                    "unit": e.unit,
                    "amount": e.amount,
                    "idempotency_key": e.idempotency_key,
                    "reservation_id": e.reservation_id,
                    "usage_id": e.usage_id,
                    "note": e.note,
                }
                for e in rows
            ],
        }
