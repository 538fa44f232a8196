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
import datetime
import logging
import os
import time
import uuid
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import grpc
from sqlalchemy import Date, and_, bindparam, case, func, insert, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import async_sessionmaker

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
    UTCDateTime,
    utcnow,
)
from services.billing.plans import PlanTerms
from services.billing.pricing import PriceTable
from services.billing.rates import RateDecision, RateLimiter
from services.common import db
from services.common import logging as loopline_logging
from services.common.errors import BILLING_DOMAIN, RpcError
from services.common.txn import TxnRunner

log = logging.getLogger(__name__)

#: Credits reserved when AdmitRequest.credits is 0, per usage type.
DEFAULT_CREDITS = {"run": 1}
DEFAULT_USAGE_TYPE = "run"
DEFAULT_RATE_CLASS = "sync_exec"
USAGE_INLINE_RECORDS = 20  # a usage or charge batch of more records is written on the SQLite worker thread (txn.py: inline)

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
    """`prefix` + "_" + 32 random hex digits (128 bits from os.urandom, like uuid4().hex)."""
    return f"{prefix}_{os.urandom(16).hex()}"


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
            billing_pb2.RateLimitState(
                limit=rate.limit, remaining=rate.remaining, reset_seconds=rate.reset_seconds
            )
        )
        retry_after = float(rate.reset_seconds)
    return RpcError(
        code=grpc.StatusCode.RESOURCE_EXHAUSTED
        if layer == "rate"
        else grpc.StatusCode.FAILED_PRECONDITION,
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


# Bounds of what one usage call may record (fresh-eyes test: 2**63-1 millicredits was posted on
# PostgreSQL, after which every charge of the organization overflowed its bigint sum and failed).
MAX_TOKENS_PER_CALL = (
    10**9
)  # per token count of one model call (the orchestrator clamps to the same)
MAX_TOOL_MILLICREDITS = 10**12  # one tool call's cost (catalogue costs are hundreds)


def invalid(reason: str, message: str) -> RpcError:
    """INVALID_ARGUMENT with `reason` (UPPER_SNAKE)."""
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, reason, message, domain=BILLING_DOMAIN)


@dataclass(frozen=True)
class Admission:
    """The result of Admit: the reservation (row or values), whether it was a replay, the rate state."""

    reservation: Any
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
    """A layer refused inside the reserve transaction; carries the figures for the denial."""

    def __init__(self, layer: str, account: Any, plan: PlanTerms) -> None:
        super().__init__(layer)
        self.layer = layer
        self.account = account
        self.plan = plan


# ---------------------------------------------------------------------- prebuilt statements
#
# Built once at import (SQLAlchemy Core, bound parameters named p_*), executed on a plain
# Connection: no ORM session, no per-call statement construction. Each call is one
# transaction (`TxnRunner.run`).

_A = Account.__table__
_R = Reservation.__table__
_L = LedgerEntry.__table__
_U = UsageRecord.__table__
_P = Plan.__table__


def _bp(name: str, type_: Any = None) -> Any:
    return bindparam(name, type_=type_)


_DATETIME = UTCDateTime()
_DATE = Date()

_SEL_ACCOUNT = select(_A).where(_A.c.org_id == _bp("p_org"))
_SEL_PLANS = select(_P)
_SEL_RESERVATION = select(_R).where(_R.c.org_id == _bp("p_org"), _R.c.turn_key == _bp("p_turn_key"))
_INS_RESERVATION = insert(_R)
_INS_LEDGER = insert(_L)

_ROLL_PERIOD = (
    update(_A)
    .where(_A.c.org_id == _bp("p_org"), _A.c.period_start < _bp("p_period", _DATE))
    .values(
        period_start=_bp("p_period", _DATE),
        period_allowance=select(_P.c.monthly_run_credits)
        .where(_P.c.name == _A.c.plan)
        .scalar_subquery(),
        granted_credits=0,
        allowance_used=0,
        usage_millicredits=0,
    )
)

_RUNS_TODAY = case((_A.c.quota_day == _bp("p_today"), _A.c.runs_today), else_=0)
_QUOTA_VALUES = {
    "runs_today": case((_A.c.quota_day == _bp("p_today"), _A.c.runs_today + 1), else_=1),
    "quota_day": _bp("p_today"),
}
_ALLOWANCE_FITS = (
    _A.c.allowance_used + _A.c.allowance_reserved + _bp("p_credits") <= _A.c.period_allowance
)


def _fast_reserve_stmt(counts_runs: bool, has_quota: bool) -> Any:
    """The merged quota + allowance UPDATE of the common admission (plan and period as cached)."""
    where = [
        _A.c.org_id == _bp("p_org"),
        _A.c.plan == _bp("p_plan"),
        _A.c.period_start >= _bp("p_period", _DATE),
        _ALLOWANCE_FITS,
    ]
    values: dict[str, Any] = {"allowance_reserved": _A.c.allowance_reserved + _bp("p_credits")}
    if counts_runs:
        if has_quota:
            where.append(_RUNS_TODAY + 1 <= _bp("p_max_runs"))
        values.update(_QUOTA_VALUES)
    return update(_A).where(*where).values(**values)


_FAST_RESERVE = {(c, q): _fast_reserve_stmt(c, q) for c in (False, True) for q in (False, True)}
_QUOTA_UPDATE = {
    False: update(_A).where(_A.c.org_id == _bp("p_org")).values(**_QUOTA_VALUES),
    True: update(_A)
    .where(_A.c.org_id == _bp("p_org"), _RUNS_TODAY + 1 <= _bp("p_max_runs"))
    .values(**_QUOTA_VALUES),
}
_ALLOWANCE_UPDATE = (
    update(_A)
    .where(_A.c.org_id == _bp("p_org"), _ALLOWANCE_FITS)
    .values(allowance_reserved=_A.c.allowance_reserved + _bp("p_credits"))
)
_WALLET_UPDATE = (
    update(_A)
    .where(
        _A.c.org_id == _bp("p_org"),
        _A.c.wallet_balance_minor - _A.c.wallet_reserved_minor >= _bp("p_cost"),
    )
    .values(wallet_reserved_minor=_A.c.wallet_reserved_minor + _bp("p_cost"))
)

_RESOLVED = (
    _R.c.org_id,
    _R.c.credits,
    _R.c.funding,
    _R.c.wallet_minor,
    _R.c.usage_type,
    _R.c.quota_day,
)
_CHARGE_RESERVATION = (
    update(_R)
    .where(_R.c.id == _bp("p_id"), _R.c.state == HELD)
    .values(state=CHARGED, resolved_at=_bp("p_now", _DATETIME))
    .returning(*_RESOLVED)
)
# A late charge (ChargeBatch): the hold had expired, so its credits were given back; they are
# taken from the allowance or the wallet as they stand (`BillingCore._charge_txn`).
_CHARGE_EXPIRED = (
    update(_R)
    .where(_R.c.id == _bp("p_id"), _R.c.state == EXPIRED)
    .values(state=CHARGED, resolved_at=_bp("p_now", _DATETIME))
    .returning(*_RESOLVED)
)
_VOID_RESERVATION = (
    update(_R)
    .where(_R.c.id == _bp("p_id"), _R.c.state == HELD)
    .values(
        state=_bp("p_state"), resolved_at=_bp("p_now", _DATETIME), release_reason=_bp("p_reason")
    )
    .returning(*_RESOLVED)
)
_IN_PERIOD = (_A.c.org_id == _bp("p_org"), _A.c.period_start >= _bp("p_period", _DATE))
_CHARGE_ALLOWANCE = (
    update(_A)
    .where(*_IN_PERIOD)
    .values(
        allowance_reserved=_A.c.allowance_reserved - _bp("p_n"),
        allowance_used=_A.c.allowance_used + _bp("p_n"),
    )
)
_CHARGE_WALLET = (
    update(_A)
    .where(*_IN_PERIOD)
    .values(
        wallet_reserved_minor=_A.c.wallet_reserved_minor - _bp("p_n"),
        wallet_balance_minor=_A.c.wallet_balance_minor - _bp("p_n"),
    )
)
_CHARGE_ALLOWANCE_LATE = (
    update(_A).where(*_IN_PERIOD).values(allowance_used=_A.c.allowance_used + _bp("p_n"))
)
# the run an expired hold gave back to the daily quota counts again (only if still that day)
_RETAKE_QUOTA = (
    update(_A)
    .where(_A.c.org_id == _bp("p_org"), _A.c.quota_day == _bp("p_quota_day"))
    .values(runs_today=_A.c.runs_today + 1)
)
_CHARGE_WALLET_LATE = (
    update(_A)
    .where(*_IN_PERIOD)
    .values(wallet_balance_minor=_A.c.wallet_balance_minor - _bp("p_n"))
)
_VOID_ACCOUNT = (
    update(_A)
    .where(_A.c.org_id == _bp("p_org"))
    .values(
        allowance_reserved=_A.c.allowance_reserved - _bp("p_allowance"),
        wallet_reserved_minor=_A.c.wallet_reserved_minor - _bp("p_wallet"),
        # Give the voided run back to the daily quota (only if still the same day).
        runs_today=case(
            (and_(_A.c.quota_day == _bp("p_quota_day"), _A.c.runs_today > 0), _A.c.runs_today - 1),
            else_=_A.c.runs_today,
        ),
    )
)
_SET_PLAN = (
    update(_A)
    .where(_A.c.org_id == _bp("p_org"))
    .values(plan=_bp("p_plan"), period_allowance=_A.c.granted_credits + _bp("p_credits"))
)
_GRANT_CREDITS = (
    update(_A)
    .where(_A.c.org_id == _bp("p_org"))
    .values(
        granted_credits=_A.c.granted_credits + _bp("p_n"),
        period_allowance=_A.c.period_allowance + _bp("p_n"),
    )
)
_TOP_UP = (
    update(_A)
    .where(_A.c.org_id == _bp("p_org"))
    .values(wallet_balance_minor=_A.c.wallet_balance_minor + _bp("p_n"))
)
_ADD_USAGE = (
    update(_A).where(*_IN_PERIOD).values(usage_millicredits=_A.c.usage_millicredits + _bp("p_n"))
)
_SEL_CHARGE_STATE = (
    select(_R.c.state, _L.c.id)
    .select_from(_R.outerjoin(_L, _L.c.idempotency_key == _bp("p_key")))
    .where(_R.c.id == _bp("p_id"))
)
_SEL_RESERVATION_STATE = select(_R.c.state).where(_R.c.id == _bp("p_id"))
_SEL_USAGE = select(_U.c.id, _U.c.org_id, _U.c.millicredits).where(
    _U.c.run_id == _bp("p_run"), _U.c.call_index == _bp("p_call")
)
_SEL_LEDGER_BY_KEY = select(_L.c.id, _L.c.org_id, _L.c.kind, _L.c.amount).where(
    _L.c.idempotency_key == _bp("p_key")
)
_SEL_EXPIRED = (
    select(_R.c.id)
    .where(_R.c.state == HELD, _R.c.expires_at <= _bp("p_now", _DATETIME))
    .order_by(_R.c.expires_at)
    .limit(_bp("p_batch"))
)


def _insert_if_absent(conn: Connection, table: Any, conflict: tuple[str, ...]) -> Any:
    """INSERT ... ON CONFLICT (conflict) DO NOTHING for `table` on this connection's dialect."""
    return db.insert_ignoring(conn.dialect.name, table, conflict)


def _plan_terms(row: Any) -> PlanTerms:
    return PlanTerms(
        name=row.name,
        monthly_run_credits=row.monthly_run_credits,
        max_runs_per_day=row.max_runs_per_day,
        wallet_overage=row.wallet_overage,
        wallet_price_minor=row.wallet_price_minor,
        rate_limits=dict(row.rate_limits or {}),
    )


def _load_plans(conn: Connection) -> dict[str, PlanTerms]:
    return {row.name: _plan_terms(row) for row in conn.execute(_SEL_PLANS)}


def _roll_and_retry(conn: Connection, stmt: Any, params: dict[str, Any]) -> None:
    """Run an in-period account UPDATE; when the account is in an older period, roll it first."""
    if conn.execute(stmt, params).rowcount != 1:
        conn.execute(_ROLL_PERIOD, params)
        if conn.execute(stmt, params).rowcount != 1:
            raise RuntimeError(f"billing account {params['p_org']!r} is missing")


class BillingCore:
    """The billing rules over one database and one rate-limit storage.

    Args:
        sessions: async session factory of the billing database (migrated, plans synced);
            the hot paths run as one synchronous transaction each through `TxnRunner`
            over the same database, `sessions` stays for reads and tests.
        rates: the rate limiter (memory or Redis).
        prices: the token price table.
        default_plan: plan name given to auto-provisioned accounts (must exist in `plans`).
        hold_seconds: how long a reservation stays HELD before the sweeper may expire it.
        clock: returns the current aware UTC time (tests may replace it).

    Caches (process memory, never trusted for a balance): the plan catalogue (`plans`,
    loaded by `load_plans()` after every sync and reloaded when an unknown plan name
    shows up) and, per organization, the plan name and period start last read
    (`_accounts`). The admission fast path puts both in its WHERE clause, so a stale
    entry only sends the call down the slow path, which reads the account again.
    """

    #: Bound on the per-organization cache (cleared when exceeded).
    ACCOUNT_CACHE_SIZE = 100_000
    ACCOUNT_CACHE_TTL_S = 1.0

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
        self.db = TxnRunner(sessions.kw["bind"], thread_name="billing-db")
        # PostgreSQL: the hot transactions as one statement each on asyncpg (services/billing/pg.py)
        self.pg: Any = None
        if self.db.dialect == "postgresql":
            # loaded only on PostgreSQL (asyncpg, the PG dialect)
            from services.billing.pg import PgBilling

            engine = sessions.kw["bind"]  # the engine's pool size and timeout
            self.pg = PgBilling(
                engine.url, max_size=engine.pool.size(), timeout_s=engine.pool.timeout()
            )
        self.plans: dict[str, PlanTerms] = {}
        self._accounts: dict[str, tuple[str, datetime.date, float]] = {}

    def close(self) -> None:
        """Release the transaction runner (worker thread) and the asyncpg pool (PostgreSQL)."""
        self.db.close()
        if self.pg is not None:
            self.pg.close()

    # ------------------------------------------------------------------ plans

    async def load_plans(self) -> dict[str, PlanTerms]:
        """(Re)load the plan catalogue from the `plans` table into memory; call after every sync."""
        self.plans = await self.db.run(_load_plans)
        return self.plans

    async def _plan(self, name: str) -> PlanTerms:
        plan = self.plans.get(name)
        if plan is None:
            plan = (await self.load_plans()).get(name)
            if plan is None:
                raise RuntimeError(f"plan {name!r} is not in the plans table")
        return plan

    # ------------------------------------------------------------------ accounts

    def _remember(self, org_id: str, plan: str, period_start: datetime.date) -> None:
        if len(self._accounts) >= self.ACCOUNT_CACHE_SIZE:
            self._accounts.clear()
        self._accounts[org_id] = (plan, period_start, time.monotonic())

    def _known(self, org_id: str, period: datetime.date) -> str | None:
        """The cached plan name of `org_id` if its account exists, is in `period`, and was read less
        than ACCOUNT_CACHE_TTL_S ago — a plan changed by another process (the admin command, another
        replica) applies to every layer, the rate layer included, within that time."""
        known = self._accounts.get(org_id)
        if (
            known is None
            or known[1] < period
            or time.monotonic() - known[2] > self.ACCOUNT_CACHE_TTL_S
        ):
            return None
        return known[0]

    def _account_txn(self, conn: Connection, org_id: str, provision: bool) -> Any:
        """SELECT the account; provision it or roll it into the current period as needed."""
        now = self.clock()
        period = month_start(now.date())
        row = conn.execute(_SEL_ACCOUNT, {"p_org": org_id}).first()
        if row is not None and row.period_start >= period:
            return row
        if row is None:
            if not provision:
                return None
            plan = self.plans.get(self.default_plan) or _load_plans(conn).get(self.default_plan)
            if plan is None:
                raise RuntimeError(f"default plan {self.default_plan!r} is not in the plans table")
            result = conn.execute(
                _insert_if_absent(conn, _A, ("org_id",)),
                {
                    "org_id": org_id,
                    "plan": plan.name,
                    "period_start": period,
                    "period_allowance": plan.monthly_run_credits,
                    "granted_credits": 0,
                    "allowance_used": 0,
                    "allowance_reserved": 0,
                    "wallet_balance_minor": 0,
                    "wallet_reserved_minor": 0,
                    "usage_millicredits": 0,
                    "quota_day": "",
                    "runs_today": 0,
                    "created_at": now,
                },
            )
            if result.rowcount == 1:
                log.info(
                    "account provisioned", extra={"fields": {"org_id": org_id, "plan": plan.name}}
                )
        else:
            conn.execute(_ROLL_PERIOD, {"p_org": org_id, "p_period": period})
        return conn.execute(_SEL_ACCOUNT, {"p_org": org_id}).one()

    async def account(self, org_id: str, *, provision: bool = True) -> tuple[Any, PlanTerms] | None:
        """The account row of `org_id` and its plan terms, rolled into the current period.

        Provisions it on the default plan when absent and `provision` (else returns None).
        Raises RuntimeError when the default plan is not in the `plans` table.
        """
        row = await self.db.run(self._account_txn, org_id, provision)
        if row is None:
            return None
        self._remember(org_id, row.plan, row.period_start)
        return row, await self._plan(row.plan)

    async def _ensure_account(self, org_id: str) -> None:
        """Make sure `org_id` has an account (skipped when this process already knows it)."""
        if self._known(org_id, month_start(self.clock().date())) is None:
            await self.account(org_id)

    # ------------------------------------------------------------------ admit

    def _prepare_txn(
        self, conn: Connection, org_id: str, turn_key: str, need_account: bool
    ) -> tuple[Any, Any]:
        """(existing reservation or None, account row if `need_account` or None)."""
        existing = conn.execute(_SEL_RESERVATION, {"p_org": org_id, "p_turn_key": turn_key}).first()
        if not need_account:
            return existing, None
        return existing, self._account_txn(conn, org_id, True)

    def _plan_in_txn(self, conn: Connection, name: str) -> PlanTerms:
        plan = self.plans.get(name)
        if plan is None:
            self.plans = _load_plans(conn)  # one reference swap: safe to read from the loop
            plan = self.plans.get(name)
            if plan is None:
                raise RuntimeError(f"plan {name!r} is not in the plans table")
        return plan

    async def _replay(
        self, existing: Any, usage_type: str, credits: int, rate_limit: str | None
    ) -> Admission:
        if existing.usage_type != usage_type or existing.credits != credits:
            raise RpcError(
                grpc.StatusCode.ALREADY_EXISTS,
                "TURN_KEY_REUSED",
                "turn key already admitted with another usage type or credit amount",
                domain=BILLING_DOMAIN,
            )
        rate = await self.rates.peek(existing.org_id, existing.rate_class, rate_limit)
        log.info(
            "admission replayed",
            extra={"fields": {"reservation_id": existing.id, "state": existing.state}},
        )
        return Admission(existing, True, rate)

    async def admit(
        self,
        org_id: str,
        turn_key: str,
        usage_type: str = "",
        rate_class: str = "",
        credits: int = 0,
    ) -> Admission:
        """Check rate -> quota -> credit -> wallet and hold `credits` for `turn_key`.

        Args:
            org_id, turn_key: required; (org_id, turn_key) is the idempotency key.
            usage_type: "" means "run". rate_class: "" means "sync_exec".
            credits: run credits to hold; 0 means DEFAULT_CREDITS[usage_type].

        Returns an Admission (a replay returns the existing reservation in its current state).
        Raises RpcError: INVALID_ARGUMENT on a bad request, ALREADY_EXISTS/TURN_KEY_REUSED,
        or a denial (see `denial_error`), with nothing reserved.

        The replay check comes first, so a replay neither counts the rate limit nor runs a
        layer. With memory rate counters (`RateLimiter.synchronous`) everything is one
        transaction, one database call (`_admit_txn`: replay check, rate, reservation).
        With Redis counters, two: a read (`_prepare_txn`), the rate hit on the loop, then
        the reservation (`_reserve_txn`).
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
                raise invalid(
                    "CREDITS_REQUIRED", f"credits are required for usage type {usage_type!r}"
                )
            credits = DEFAULT_CREDITS[usage_type]

        with loopline_logging.bind(org_id=org_id):
            now = self.clock()
            period = month_start(now.date())
            today = now.date().isoformat()
            values = {
                "id": _new_id("res"),
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
            plan_name = self._known(org_id, period)
            try:
                if self.pg is not None:
                    kind, detail, row, plan = await self._admit_pg(values, plan_name, period, today)
                elif self.rates.synchronous:
                    kind, detail, row, plan = await self.db.run(
                        self._admit_txn, values, plan_name, period, today
                    )
                else:
                    kind, detail, row, plan = await self._admit_two_step(
                        values, plan_name, period, today
                    )
            except IntegrityError:
                # A concurrent Admit with the same turn key won the insert; ours rolled back.
                known = self._known(org_id, period)
                existing, row = await self.db.run(
                    self._prepare_txn, org_id, turn_key, known is None
                )
                if existing is None:
                    raise
                plan = await self._plan(row.plan if row is not None else known)  # type: ignore[arg-type]
                return await self._replay(
                    existing, usage_type, credits, plan.rate_limits.get(rate_class)
                )
            if row is not None:
                self._remember(org_id, row.plan, row.period_start)
            if kind == "replay":
                return await self._replay(
                    detail, usage_type, credits, plan.rate_limits.get(rate_class)
                )
            if kind == "rate":
                rate_limit = plan.rate_limits.get(rate_class)
                log.info(
                    "admission denied",
                    extra={"fields": {"layer": "rate", "rate_class": rate_class}},
                )
                raise denial_error(
                    RATE_LIMITED,
                    "rate",
                    f"rate limit {rate_limit} exceeded for {rate_class}; retry in {detail.reset_seconds} s",
                    key=rate_class,
                    current=detail.limit - detail.remaining,
                    limit=detail.limit,
                    rate=detail,
                )
            if kind == "denied":
                log.info("admission denied", extra={"fields": {"layer": detail.layer}})
                raise self._denial(detail, credits, today)
            rate, fresh = detail
            if fresh is not None:  # the slow path re-read the account
                self._remember(org_id, *fresh)
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
            return Admission(SimpleNamespace(**values), False, rate)

    def _admit_txn(
        self,
        conn: Connection,
        values: dict[str, Any],
        plan_name: str | None,
        period: datetime.date,
        today: str,
    ) -> tuple[str, Any, Any, PlanTerms]:
        """The whole admission in one transaction (memory rate counters, any thread).

        Returns (kind, detail, account row read here or None, plan) with kind
        "replay" (detail = the existing reservation), "rate" (detail = the refusing
        RateDecision; nothing reserved), "denied" (detail = _Denied; the layers' updates
        are rolled back, an account provisioned here is kept) or "admitted" (detail =
        (RateDecision, `_reserve_txn`'s result)). Mutates `values` (funding, wallet_minor).
        """
        org_id = values["org_id"]
        existing = conn.execute(
            _SEL_RESERVATION, {"p_org": org_id, "p_turn_key": values["turn_key"]}
        ).first()
        row = None
        if plan_name is None:
            row = self._account_txn(conn, org_id, True)
            plan_name = row.plan
        plan = self._plan_in_txn(conn, plan_name)
        if existing is not None:
            return "replay", existing, row, plan
        rate = self.rates.hit_now(
            org_id, values["rate_class"], plan.rate_limits.get(values["rate_class"])
        )
        if not rate.allowed:
            return "rate", rate, row, plan
        try:
            fresh = self._reserve_txn(
                conn, values, plan, period, today, values["usage_type"] == "run"
            )
        except _Denied as denied:
            return "denied", denied, row, plan
        return "admitted", (rate, fresh), row, plan

    async def _admit_pg(
        self, values: dict[str, Any], plan_name: str | None, period: datetime.date, today: str
    ) -> tuple[str, Any, Any, PlanTerms]:
        """`_admit_txn`'s outcome on PostgreSQL, with no transaction open across round trips.

        An account not cached is read (provisioned, rolled) in its own transaction first;
        then one SELECT for a replay, the rate hit (memory or Redis), and the reservation as one
        statement (`PgBilling.reserve`: quota + allowance or wallet UPDATE feeding the
        reservation INSERT). Only when that statement reserves nothing (a layer refuses, the
        plan or period changed) does the layered `_reserve_txn` run, in one transaction,
        building the denial. Raises IntegrityError when a concurrent Admit took the turn key
        (the caller answers it as a replay).
        """
        assert self.pg is not None
        org_id, rate_class = values["org_id"], values["rate_class"]
        row = None
        if plan_name is None:
            row = await self.db.run(self._account_txn, org_id, True)
            plan_name = row.plan
        plan = await self._plan(plan_name)
        existing = await self.pg.reservation(org_id, values["turn_key"])
        if existing is not None:
            return "replay", existing, row, plan
        limit = plan.rate_limits.get(rate_class)
        if self.rates.synchronous:
            rate = self.rates.hit_now(org_id, rate_class, limit)
        else:
            rate = await self.rates.hit(org_id, rate_class, limit)
        if not rate.allowed:
            return "rate", rate, row, plan
        counts_runs = values["usage_type"] == "run"
        if await self.pg.reserve(values, plan, period, today, counts_runs):
            return "admitted", (rate, None), row, plan
        try:
            fresh = await self.db.run(self._reserve_txn, values, plan, period, today, counts_runs)
        except _Denied as denied:
            return "denied", denied, row, plan
        return "admitted", (rate, fresh), row, plan

    async def _admit_two_step(
        self, values: dict[str, Any], plan_name: str | None, period: datetime.date, today: str
    ) -> tuple[str, Any, Any, PlanTerms]:
        """`_admit_txn`'s outcome for shared (Redis) rate counters: read, rate hit, reserve.

        On PostgreSQL the read and the reservation share one transaction (one pooled
        connection) with the rate hit awaited between them; on SQLite they are two.
        """
        org_id, rate_class = values["org_id"], values["rate_class"]
        async with self.db.transaction() as run:
            existing, row = await run(
                self._prepare_txn, org_id, values["turn_key"], plan_name is None
            )
            if row is not None:
                plan_name = row.plan
            assert plan_name is not None
            plan = await self._plan(plan_name)
            if existing is not None:
                return "replay", existing, row, plan
            rate = await self.rates.hit(org_id, rate_class, plan.rate_limits.get(rate_class))
            if not rate.allowed:
                return "rate", rate, row, plan
            try:
                fresh = await run(
                    self._reserve_txn, values, plan, period, today, values["usage_type"] == "run"
                )
            except (
                _Denied
            ) as denied:  # raised after its SAVEPOINT rolled back: the read stays valid
                return "denied", denied, row, plan
            return "admitted", (rate, fresh), row, plan

    def _reserve_txn(
        self,
        conn: Connection,
        values: dict[str, Any],
        plan: PlanTerms,
        period: datetime.date,
        today: str,
        counts_runs: bool,
    ) -> tuple[str, datetime.date] | None:
        """Quota, allowance and wallet as conditional UPDATEs, then the reservation row.

        Fast path: one UPDATE checking quota and allowance together for the cached plan
        and period. When it matches no row (a layer would refuse, the allowance is spent,
        the plan or period changed) the slow path, inside a SAVEPOINT, re-reads the account
        and runs each layer as its own conditional UPDATE, in order. Returns None after the
        fast path, else the account's (plan, period_start). Raises _Denied(layer) with the
        slow path's updates rolled back. Mutates `values` (funding, wallet_minor).
        """
        org_id, credits = values["org_id"], values["credits"]
        params = {
            "p_org": org_id,
            "p_plan": plan.name,
            "p_period": period,
            "p_credits": credits,
            "p_today": today,
            "p_max_runs": plan.max_runs_per_day,
        }
        fast = _FAST_RESERVE[(counts_runs, plan.max_runs_per_day is not None)]
        if conn.execute(fast, params).rowcount == 1:
            conn.execute(_INS_RESERVATION, values)
            return None
        with conn.begin_nested():
            return self._reserve_slow(conn, values, params, period, counts_runs)

    def _reserve_slow(
        self,
        conn: Connection,
        values: dict[str, Any],
        params: dict[str, Any],
        period: datetime.date,
        counts_runs: bool,
    ) -> tuple[str, datetime.date]:
        credits = values["credits"]
        account = conn.execute(_SEL_ACCOUNT, params).one()
        if account.period_start < period:
            conn.execute(_ROLL_PERIOD, params)
        plan = self._plan_in_txn(conn, account.plan)
        params["p_max_runs"] = plan.max_runs_per_day

        def refuse(layer: str) -> _Denied:
            return _Denied(layer, conn.execute(_SEL_ACCOUNT, params).one(), plan)

        if (
            counts_runs
            and conn.execute(_QUOTA_UPDATE[plan.max_runs_per_day is not None], params).rowcount != 1
        ):
            raise refuse("quota")
        if conn.execute(_ALLOWANCE_UPDATE, params).rowcount != 1:
            if not plan.wallet_overage:
                raise refuse("credit")
            params["p_cost"] = cost = credits * plan.wallet_price_minor
            if conn.execute(_WALLET_UPDATE, params).rowcount != 1:
                raise refuse("wallet")
            values["funding"], values["wallet_minor"] = WALLET, cost
        conn.execute(_INS_RESERVATION, values)
        return account.plan, max(account.period_start, period)

    def _denial(self, denied: _Denied, credits: int, today: str) -> RpcError:
        """Build the denial of `denied.layer` with the account figures read in the transaction."""
        layer, account, plan = denied.layer, denied.account, denied.plan
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

    def _charge_txn(
        self, conn: Connection, reservation_id: str, late: bool = False
    ) -> tuple[str, str, bool, str | None]:
        """(state, ledger entry id, replayed, org_id); raises RpcError for the refusals (before
        anything is written). With `late`, an EXPIRED reservation is charged too (`charge`)."""
        now = self.clock()
        held = conn.execute(_CHARGE_RESERVATION, {"p_id": reservation_id, "p_now": now}).first()
        expired = False
        if held is None and late:
            held = conn.execute(_CHARGE_EXPIRED, {"p_id": reservation_id, "p_now": now}).first()
            expired = held is not None
        if held is None:
            row = conn.execute(
                _SEL_CHARGE_STATE, {"p_id": reservation_id, "p_key": f"charge:{reservation_id}"}
            ).first()
            if row is None:
                raise not_found(reservation_id)
            if row.state == CHARGED:
                return CHARGED, row.id, True, None
            raise RpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"RESERVATION_{row.state.upper()}",
                f"reservation {reservation_id} is {row.state} and cannot be charged",
                domain=BILLING_DOMAIN,
            )
        if held.funding == WALLET:
            stmt, unit, amount = (
                (_CHARGE_WALLET_LATE if expired else _CHARGE_WALLET),
                UNIT_MINOR,
                held.wallet_minor,
            )
        else:
            stmt, unit, amount = (
                (_CHARGE_ALLOWANCE_LATE if expired else _CHARGE_ALLOWANCE),
                UNIT_CREDIT,
                held.credits,
            )
        # A hold opened last month is charged to the current period (rolled first).
        _roll_and_retry(
            conn, stmt, {"p_org": held.org_id, "p_period": month_start(now.date()), "p_n": amount}
        )
        entry_id = _new_id("led")
        note = f"{held.usage_type} {held.credits} credit(s) via {held.funding}"
        conn.execute(
            _INS_LEDGER,
            {
                "id": entry_id,
                "idempotency_key": f"charge:{reservation_id}",
                "org_id": held.org_id,
                "kind": "run_charge",
                "unit": unit,
                "amount": -amount,
                "reservation_id": reservation_id,
                "usage_id": None,
                "note": f"{note}, charged after its hold expired" if expired else note,
                "created_at": now,
            },
        )
        if expired:
            if held.quota_day:
                conn.execute(_RETAKE_QUOTA, {"p_org": held.org_id, "p_quota_day": held.quota_day})
            log.warning(
                "charged a reservation after its hold expired",
                extra={"fields": {"reservation_id": reservation_id, "org_id": held.org_id}},
            )
        return CHARGED, entry_id, False, held.org_id

    async def charge(self, reservation_id: str, *, late: bool = False) -> ChargeResult:
        """Post a HELD reservation to the ledger, exactly once.

        Moves the hold into `allowance_used` (or debits the wallet) and appends ledger entry
        "charge:{reservation_id}" in one transaction (UPDATE reservation ... RETURNING,
        UPDATE account, INSERT ledger). A second call returns the same entry
        (replayed=True). Raises RpcError NOT_FOUND for an unknown id, FAILED_PRECONDITION
        RESERVATION_RELEASED / RESERVATION_EXPIRED when the hold was voided.

        With `late` (ChargeBatch: the charge of a turn the orchestrator committed while the
        hold stood, stored with the turn and delivered after billing or the orchestrator was
        away longer than the hold), an EXPIRED reservation is charged as well: its credits,
        given back when it expired, are taken from the allowance (which may end above the
        plan's by them) or the wallet as they stand, and the ledger entry's note says so
        (README "Decisions": one run credit per persisted turn). RELEASED stays refused.
        """
        if not reservation_id:
            raise invalid("RESERVATION_ID_REQUIRED", "reservation_id is required")
        charged = None
        if self.pg is not None:
            now = self.clock()
            entry_id = _new_id("led")
            org_id = await self.pg.charge(reservation_id, now, month_start(now.date()), entry_id)
            if org_id is not None:
                charged = (CHARGED, entry_id, False, org_id)
        if (
            charged is None
        ):  # SQLite, or on PostgreSQL a replay, a refusal, a late charge or an account to roll
            charged = await self.db.run(self._charge_txn, reservation_id, late)
        return self._charged(reservation_id, charged)

    @staticmethod
    def _charged(reservation_id: str, charged: tuple[str, str, bool, str | None]) -> ChargeResult:
        state, entry_id, replayed, org_id = charged
        if not replayed and log.isEnabledFor(logging.DEBUG):
            with loopline_logging.bind(org_id=org_id):
                log.debug(
                    "charged",
                    extra={
                        "fields": {"reservation_id": reservation_id, "ledger_entry_id": entry_id}
                    },
                )
        return ChargeResult(state, entry_id, replayed)

    def _charge_batch_txn(
        self, conn: Connection, reservation_ids: list[str]
    ) -> list[tuple[str, str, bool, str | None] | RpcError]:
        """Each reservation as `_charge_txn(late=True)` in one transaction; a refusal (raised
        before that charge wrote anything) is returned in its place."""
        results: list[tuple[str, str, bool, str | None] | RpcError] = []
        for reservation_id in reservation_ids:
            try:
                results.append(self._charge_txn(conn, reservation_id, True))
            except RpcError as refused:
                results.append(refused)
        return results

    async def charge_batch(self, reservation_ids: list[str]) -> list[ChargeResult | None]:
        """Charge several reservations, each as `charge(late=True)`; results in order.

        A reservation that cannot be charged is answered in its place instead of failing the
        call: ChargeResult("released", "", False) for a released one, None for an unknown one.
        RpcError INVALID_ARGUMENT (nothing written) when an id is empty. On SQLite the batch is
        one transaction (one commit); on PostgreSQL each charge is its own statement, run
        concurrently. Source: the ChargeBatch RPC (billing.proto), README "Decisions".
        """
        if not all(reservation_ids):
            raise invalid("RESERVATION_ID_REQUIRED", "reservation_id is required")
        if self.pg is None:
            found = await self.db.run(
                self._charge_batch_txn,
                reservation_ids,
                inline=len(reservation_ids) <= USAGE_INLINE_RECORDS,
            )
        else:

            async def one(reservation_id: str) -> ChargeResult | RpcError:
                try:
                    return await self.charge(reservation_id, late=True)
                except RpcError as refused:
                    return refused

            found = list(
                await asyncio.gather(*(one(reservation_id) for reservation_id in reservation_ids))
            )
        results: list[ChargeResult | None] = []
        for reservation_id, result in zip(reservation_ids, found, strict=True):
            if isinstance(result, RpcError):
                results.append(
                    ChargeResult(RELEASED, "", False)
                    if result.reason == "RESERVATION_RELEASED"
                    else None
                )
            else:
                results.append(
                    result
                    if isinstance(result, ChargeResult)
                    else self._charged(reservation_id, result)
                )
        return results

    def _void_txn(
        self, conn: Connection, reservation_id: str, state: str, reason: str
    ) -> tuple[str | None, str | None]:
        """Move a HELD reservation to `state` and return its hold: (org_id, None) if voided now,
        (None, current state) if it was not HELD, (None, None) if it does not exist."""
        held = conn.execute(
            _VOID_RESERVATION,
            {
                "p_id": reservation_id,
                "p_state": state,
                "p_now": self.clock(),
                "p_reason": reason[:255] or None,
            },
        ).first()
        if held is None:
            return None, conn.execute(_SEL_RESERVATION_STATE, {"p_id": reservation_id}).scalar()
        wallet = held.funding == WALLET
        conn.execute(
            _VOID_ACCOUNT,
            {
                "p_org": held.org_id,
                "p_allowance": 0 if wallet else held.credits,
                "p_wallet": held.wallet_minor if wallet else 0,
                "p_quota_day": held.quota_day or None,
            },
        )
        return held.org_id, None

    async def _void(
        self, reservation_id: str, state: str, reason: str
    ) -> tuple[str | None, str | None]:
        """`_void_txn`'s result: one statement on PostgreSQL (`PgBilling.void`), else one transaction."""
        if self.pg is not None:
            return await self.pg.void(reservation_id, state, self.clock(), reason[:255] or None)
        return await self.db.run(self._void_txn, reservation_id, state, reason)

    async def release(self, reservation_id: str, reason: str = "") -> str:
        """Void a HELD reservation at most once; returns the state after the call.

        Returns "released" (now or earlier), "charged" (no-op: a charged reservation is
        never voided) or "expired". Raises RpcError NOT_FOUND for an unknown id.
        """
        if not reservation_id:
            raise invalid("RESERVATION_ID_REQUIRED", "reservation_id is required")
        org_id, state = await self._void(reservation_id, RELEASED, reason)
        if org_id is not None:
            with loopline_logging.bind(org_id=org_id):
                log.info(
                    "released",
                    extra={"fields": {"reservation_id": reservation_id, "reason": reason[:255]}},
                )
            return RELEASED
        if state is None:
            raise not_found(reservation_id)
        return state

    async def expire_holds(self, now: datetime.datetime | None = None, batch: int = 500) -> int:
        """Expire every HELD reservation whose `expires_at` <= `now` (default: the clock).

        Each is voided in its own transaction (a concurrent Charge or Release wins or loses
        cleanly). Returns how many were expired.
        """
        now = now or self.clock()
        expired = 0
        while True:
            ids = await self.db.run(
                lambda conn: (
                    conn.execute(_SEL_EXPIRED, {"p_now": now, "p_batch": batch}).scalars().all()
                )
            )
            if not ids:
                return expired
            for reservation_id in ids:
                org_id, _ = await self._void(reservation_id, EXPIRED, "hold expired")
                if org_id is not None:
                    expired += 1
            if len(ids) < batch:
                if expired:
                    log.info("expired holds", extra={"fields": {"count": expired}})
                return expired

    # ------------------------------------------------------------------ usage

    def _usage_txn(
        self, conn: Connection, record: dict[str, Any], ledger: dict[str, Any] | None
    ) -> Any:
        """INSERT the usage record unless (run_id, call_index) exists; then its ledger entry and
        the account total. Returns None when inserted, else the existing (id, org_id, millicredits)."""
        inserted = (
            conn.execute(_insert_if_absent(conn, _U, ("run_id", "call_index")), record).rowcount
            == 1
        )
        if not inserted:
            return conn.execute(
                _SEL_USAGE, {"p_run": record["run_id"], "p_call": record["call_index"]}
            ).one()
        if ledger is not None:
            conn.execute(_INS_LEDGER, ledger)
            _roll_and_retry(
                conn,
                _ADD_USAGE,
                {
                    "p_org": ledger["org_id"],
                    "p_period": month_start(ledger["created_at"].date()),
                    "p_n": -ledger["amount"],
                },
            )
        return None

    def _usage_rows(
        self, r: billing_pb2.RecordUsageRequest
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """(usage record, ledger entry or None) of one RecordUsage request, validated and priced.

        Raises RpcError INVALID_ARGUMENT on missing ids, negative counts or counts past
        MAX_TOKENS_PER_CALL."""
        if not r.organization_id or not r.run_id:
            raise invalid("USAGE_KEY_REQUIRED", "organization_id and run_id are required")
        if (
            r.call_index < 0
            or min(r.input_tokens, r.output_tokens, r.cache_read_tokens, r.cache_write_tokens) < 0
        ):
            raise invalid("USAGE_NEGATIVE", "call_index and token counts must not be negative")
        if (
            max(r.input_tokens, r.output_tokens, r.cache_read_tokens, r.cache_write_tokens)
            > MAX_TOKENS_PER_CALL
        ):
            raise invalid(
                "USAGE_TOO_LARGE",
                f"a token count of one model call must be at most {MAX_TOKENS_PER_CALL}",
            )
        millicredits = self.prices.millicredits(
            r.provider_id,
            r.model_id,
            input_tokens=r.input_tokens,
            output_tokens=r.output_tokens,
            cache_read_tokens=r.cache_read_tokens,
            cache_write_tokens=r.cache_write_tokens,
            byok=r.byok,
        )
        now = self.clock()
        record = {
            "id": _new_id("use"),
            "org_id": r.organization_id,
            "run_id": r.run_id,
            "call_index": r.call_index,
            "chat_id": r.chat_id,
            "provider_id": r.provider_id,
            "model_id": r.model_id,
            "input_tokens": r.input_tokens,
            "output_tokens": r.output_tokens,
            "cache_read_tokens": r.cache_read_tokens,
            "cache_write_tokens": r.cache_write_tokens,
            "byok": r.byok,
            "estimated": r.estimated,
            "millicredits": millicredits,
            "created_at": now,
        }
        ledger = None
        if millicredits:
            ledger = {
                "id": _new_id("led"),
                "idempotency_key": f"usage:{r.run_id}:{r.call_index}",
                "org_id": r.organization_id,
                "kind": "token_usage",
                "unit": UNIT_MILLICREDIT,
                "amount": -millicredits,
                "reservation_id": None,
                "usage_id": record["id"],
                "note": f"{r.provider_id}/{r.model_id}"[:255],
                "created_at": now,
            }
        return record, ledger

    async def record_usage(self, request: billing_pb2.RecordUsageRequest) -> UsageResult:
        """Record one model call's token usage, idempotent by (run_id, call_index).

        Millicredits come from the price table (0 when `byok`); a non-zero amount is
        posted as ledger entry "usage:{run_id}:{call_index}" (unit millicredit) and added
        to the account's `usage_millicredits`, in the same transaction. Raises RpcError
        INVALID_ARGUMENT on missing ids or negative counts, ALREADY_EXISTS /
        USAGE_KEY_REUSED when the (run_id, call_index) belongs to another organization.
        One transaction: INSERT ... ON CONFLICT DO NOTHING decides first time vs replay
        (on PostgreSQL one statement, `record_usage_batch`).
        """
        if self.pg is not None:
            return (await self.record_usage_batch([request]))[0]
        record, ledger = self._usage_rows(request)
        return await self._record_usage_rows(request, record, ledger, None)

    async def _record_usage_rows(
        self,
        r: Any,
        record: dict[str, Any],
        ledger: dict[str, Any] | None,
        inserted: set[str] | None,
    ) -> UsageResult:
        """Finish one usage call: `inserted` holds the record ids the PostgreSQL statement wrote
        (None: nothing tried yet); a record not among them goes through `_usage_txn`
        (first time with a period roll, or a replay)."""
        with loopline_logging.bind(org_id=r.organization_id, run_id=r.run_id, chat_id=r.chat_id):
            if inserted is None or record["id"] not in inserted:
                if inserted is None:
                    await self._ensure_account(r.organization_id)
                existing = await self.db.run(self._usage_txn, record, ledger)
                if existing is not None:
                    return self._usage_replay(existing, r.organization_id)
            return self._usage_recorded(r, record)

    def _usage_batch_txn(
        self, conn: Connection, rows: list[tuple[dict[str, Any], dict[str, Any] | None]]
    ) -> list[Any]:
        """`_usage_txn` for each (record, ledger entry) in one transaction; their answers in order."""
        return [self._usage_txn(conn, record, ledger) for record, ledger in rows]

    def _usage_recorded(self, r: Any, record: dict[str, Any]) -> UsageResult:
        """The answer for a usage record written now (logged at DEBUG, in the caller's log context)."""
        log.debug(  # the usage record is its record, like a charge's ledger entry
            "usage recorded",
            extra={
                "fields": {
                    "usage_id": record["id"],
                    "call_index": r.call_index,
                    "millicredits": record["millicredits"],
                    "byok": r.byok,
                }
            },
        )
        return UsageResult(record["id"], record["millicredits"], False)

    async def record_usage_batch(
        self, requests: list[billing_pb2.RecordUsageRequest]
    ) -> list[UsageResult]:
        """Record several model calls' usage, each as `record_usage`; results in request order.

        Every request is validated first (RpcError INVALID_ARGUMENT before anything is written).
        On PostgreSQL the calls of one organization are one statement (`PgBilling.record_usage`:
        records, ledger entries and one account UPDATE for their sum), organizations
        concurrently; a call it did not insert (a replay, a key repeated in the batch, an
        account to roll into the new period) then runs as `record_usage` does on its own. On
        SQLite the whole batch is one transaction (each call as `_usage_txn`). An error fails
        the call (a USAGE_KEY_REUSED replay after the others were written); a retry replays
        what was recorded.
        """
        rows = [self._usage_rows(request) for request in requests]
        if (
            self.pg is None
        ):  # one transaction for the whole batch (docs/performance.md, seventh round)
            for org_id in dict.fromkeys(request.organization_id for request in requests):
                await self._ensure_account(org_id)
            found = await self.db.run(
                self._usage_batch_txn, rows, inline=len(rows) <= USAGE_INLINE_RECORDS
            )
            answers = []
            for request, (record, _), existing in zip(requests, rows, found, strict=True):
                with loopline_logging.bind(
                    org_id=request.organization_id, run_id=request.run_id, chat_id=request.chat_id
                ):
                    answers.append(
                        self._usage_recorded(request, record)
                        if existing is None
                        else self._usage_replay(existing, request.organization_id)
                    )
            return answers
        by_org: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            by_org.setdefault(request.organization_id, []).append(index)
        period = month_start(self.clock().date())

        async def one_org(org_id: str, indexes: list[int]) -> set[str]:
            await self._ensure_account(org_id)
            return await self.pg.record_usage(org_id, period, [rows[i] for i in indexes])

        done = await asyncio.gather(
            *(one_org(org_id, indexes) for org_id, indexes in by_org.items())
        )
        inserted = set().union(*done)
        results = []
        for request, (record, ledger) in zip(requests, rows, strict=True):
            results.append(await self._record_usage_rows(request, record, ledger, inserted))
        return results

    def _ledger_txn(
        self, conn: Connection, entry: dict[str, Any], account_stmt: Any, params: dict[str, Any]
    ) -> Any:
        """INSERT the ledger entry unless its idempotency key exists, then update the account.

        Returns None when inserted, else the existing entry's (id, org_id)."""
        if conn.execute(_insert_if_absent(conn, _L, ("idempotency_key",)), entry).rowcount != 1:
            return conn.execute(_SEL_LEDGER_BY_KEY, {"p_key": entry["idempotency_key"]}).one()
        _roll_and_retry(conn, account_stmt, params)
        return None

    async def record_tool_usage(
        self, request: billing_pb2.RecordToolUsageRequest
    ) -> tuple[str, bool]:
        """Charge one tool call's catalogue cost; idempotent by (run_id, tool_call_id).

        Posts ledger entry "tool:{run_id}:{tool_call_id}" (unit millicredit, kind tool_usage)
        and adds it to the account's `usage_millicredits` in the same transaction. Returns
        (ledger entry id, replayed); ("", False) for a zero cost. Raises RpcError
        INVALID_ARGUMENT on missing ids or a cost below 0 or past MAX_TOOL_MILLICREDITS, ALREADY_EXISTS / USAGE_KEY_REUSED
        when the key belongs to another organization.
        """
        r = request
        if not r.organization_id or not r.run_id or not r.tool_call_id:
            raise invalid(
                "USAGE_KEY_REQUIRED", "organization_id, run_id and tool_call_id are required"
            )
        if r.millicredits < 0:
            raise invalid("USAGE_NEGATIVE", "millicredits must not be negative")
        if r.millicredits > MAX_TOOL_MILLICREDITS:
            raise invalid(
                "USAGE_TOO_LARGE",
                f"millicredits of one tool call must be at most {MAX_TOOL_MILLICREDITS}",
            )
        if r.millicredits == 0:
            return "", False
        with loopline_logging.bind(org_id=r.organization_id, run_id=r.run_id, chat_id=r.chat_id):
            await self._ensure_account(r.organization_id)
            now = self.clock()
            entry = {
                "id": _new_id("led"),
                "idempotency_key": f"tool:{r.run_id}:{r.tool_call_id}",
                "org_id": r.organization_id,
                "kind": "tool_usage",
                "unit": UNIT_MILLICREDIT,
                "amount": -r.millicredits,
                "reservation_id": None,
                "usage_id": None,
                "note": f"{r.tool} {r.detail}".strip()[:255],
                "created_at": now,
            }
            params = {
                "p_org": r.organization_id,
                "p_period": month_start(now.date()),
                "p_n": r.millicredits,
            }
            if self.pg is not None and await self.pg.post_usage_entry(
                entry, params["p_period"], r.millicredits
            ):
                return entry["id"], False
            existing = await self.db.run(self._ledger_txn, entry, _ADD_USAGE, params)
            if existing is None:
                return entry["id"], False
            if existing.org_id != r.organization_id:
                raise RpcError(
                    grpc.StatusCode.ALREADY_EXISTS,
                    "USAGE_KEY_REUSED",
                    "this (run_id, tool_call_id) was recorded for another organization",
                    domain=BILLING_DOMAIN,
                )
            return existing.id, True

    @staticmethod
    def _usage_replay(existing: Any, org_id: str) -> UsageResult:
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
        plan = self.plans.get(plan_name) or (await self.load_plans()).get(plan_name)
        if plan is None:
            raise ValueError(f"unknown plan {plan_name!r}")
        row, _ = await self.account(org_id)  # type: ignore[misc]

        await self.db.run(
            lambda conn: conn.execute(
                _SET_PLAN,
                {"p_org": org_id, "p_plan": plan_name, "p_credits": plan.monthly_run_credits},
            )
        )
        self._remember(org_id, plan_name, row.period_start)
        log.info("plan set", extra={"fields": {"org_id": org_id, "plan": plan_name}})

    async def grant_credits(
        self, org_id: str, credits: int, idempotency_key: str = "", note: str = ""
    ) -> str:
        """Add `credits` (> 0) run credits to `org_id`'s allowance for the current period.

        Posts ledger entry kind "grant" (unit credit); idempotent by `idempotency_key`
        (default: a fresh one). Returns the ledger entry id. Raises ValueError if credits <= 0,
        or when the key was used for another entry (another organization, kind or amount).
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
            _GRANT_CREDITS,
        )

    async def top_up(
        self, org_id: str, minor_units: int, idempotency_key: str = "", note: str = ""
    ) -> str:
        """Add `minor_units` (> 0) to `org_id`'s prepaid wallet.

        Posts ledger entry kind "top_up" (unit minor); idempotent by `idempotency_key`.
        Returns the ledger entry id. Raises ValueError if minor_units <= 0, or when the key
        was used for another entry (another organization, kind or amount).
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
            _TOP_UP,
        )

    async def _post_admin(
        self, org_id: str, key: str, kind: str, unit: str, amount: int, note: str, stmt: Any
    ) -> str:
        entry = {
            "id": _new_id("led"),
            "idempotency_key": key,
            "org_id": org_id,
            "kind": kind,
            "unit": unit,
            "amount": amount,
            "reservation_id": None,
            "usage_id": None,
            "note": note[:255] or None,
            "created_at": self.clock(),
        }
        existing = await self.db.run(
            self._ledger_txn, entry, stmt, {"p_org": org_id, "p_n": amount}
        )
        if existing is not None:
            if (existing.org_id, existing.kind, existing.amount) != (org_id, kind, amount):
                # the same key for another posting: refuse, like an Idempotency-Key reused with another body
                raise ValueError(
                    f"idempotency key {key!r} was already used for another entry "
                    f"({existing.kind} of {existing.amount} for {existing.org_id})"
                )
            return existing.id
        log.info(
            "ledger posted",
            extra={"fields": {"org_id": org_id, "kind": kind, "amount": amount, "unit": unit}},
        )
        return entry["id"]

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
                (
                    await session.execute(
                        select(LedgerEntry)
                        .where(LedgerEntry.org_id == org_id)
                        .order_by(LedgerEntry.created_at.desc(), LedgerEntry.id)
                        .limit(entries)
                    )
                )
                .scalars()
                .all()
            )
            held = (
                await session.execute(
                    select(func.count())
                    .select_from(Reservation)
                    .where(and_(Reservation.org_id == org_id, Reservation.state == HELD))
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
                "available": max(
                    0,
                    account.period_allowance - account.allowance_used - account.allowance_reserved,
                ),
            },
            "wallet": {
                "balance_minor": account.wallet_balance_minor,
                "reserved_minor": account.wallet_reserved_minor,
                "available_minor": account.wallet_balance_minor - account.wallet_reserved_minor,
            },
            "usage_millicredits_this_period": account.usage_millicredits,
            "runs_today": account.runs_today
            if account.quota_day == self.clock().date().isoformat()
            else 0,
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
