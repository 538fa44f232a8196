"""Billing's store: every read and write of the billing database, behind one interface.

`BillingStore` holds the general transactions, each written once as a synchronous function over
a connection and run as one transaction (`services.common.txn.TxnRunner`: on SQLite on the
process's one database thread with group commit, on PostgreSQL through `run_sync`). Two
implementations send the calls: `SqliteBillingStore` (store_sqlite.py) runs them as they are;
`PgBillingStore` (store_pg.py) sends the hot calls as one statement each and falls back to the
general transaction for the rest (replays, refusals, period rolls). `open_store` picks one.

The store answers with facts (rows, states, the layer that refused); admission.py, ledger.py and
admin.py turn them into answers and errors.

Caches (process memory, never trusted for a balance): the plan catalogue (`plans`, reloaded when
an unknown plan name shows up) and, per organization, the plan name and period start last read
(`known`). The admission fast path puts both in its WHERE clause, so a stale entry only sends
the call down the slow path, which reads the account again.
"""

from __future__ import annotations

import abc
import datetime
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy import and_, func, select
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import async_sessionmaker

from services.billing.models import (
    CHARGED,
    HELD,
    UNIT_CREDIT,
    UNIT_MINOR,
    WALLET,
    Account,
    LedgerEntry,
    Reservation,
    UsageRecord,
    month_start,
    new_id,
    utcnow,
)
from services.billing.plans import PlanTerms
from services.billing.rates import RateLimiter
from services.billing.statements import (
    ADD_USAGE,
    ALLOWANCE_UPDATE,
    CHARGE_ALLOWANCE,
    CHARGE_ALLOWANCE_LATE,
    CHARGE_EXPIRED,
    CHARGE_RESERVATION,
    CHARGE_WALLET,
    CHARGE_WALLET_LATE,
    FAST_RESERVE,
    GRANT_CREDITS,
    INS_LEDGER,
    INS_RESERVATION,
    QUOTA_UPDATE,
    RETAKE_QUOTA,
    ROLL_PERIOD,
    SEL_ACCOUNT,
    SEL_CHARGE_STATE,
    SEL_EXPIRED,
    SEL_LEDGER_BY_KEY,
    SEL_PLANS,
    SEL_RESERVATION,
    SEL_RESERVATION_STATE,
    SEL_USAGE,
    SET_PLAN,
    TOP_UP,
    VOID_ACCOUNT,
    VOID_RESERVATION,
    WALLET_UPDATE,
)
from services.common import db
from services.common.txn import TxnRunner

log = logging.getLogger(__name__)

#: `record_usage`'s answer for a call its one statement left to `record_usage_one` (PostgreSQL)
LEFT = object()
#: the account statement of each kind of balance posting (`post_balance_entry`)
_BALANCE_CHANGE = {"grant": GRANT_CREDITS, "top_up": TOP_UP}

# (kind, detail, account row read or None, plan) of an admission; see `BillingStore.admit`
AdmitOutcome = tuple[str, Any, Any, PlanTerms]
# (state or None when unknown, ledger entry id or "", replayed, org_id when charged now)
ChargeOutcome = tuple[str | None, str, bool, str | None]


class Refusal(Exception):
    """A layer refused inside the reservation transaction; carries the figures for the denial."""

    def __init__(self, layer: str, account: Any, plan: PlanTerms) -> None:
        super().__init__(layer)
        self.layer = layer
        self.account = account
        self.plan = plan


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
    return {row.name: _plan_terms(row) for row in conn.execute(SEL_PLANS)}


def _roll_and_retry(conn: Connection, stmt: Any, params: dict[str, Any]) -> None:
    """Run an in-period account UPDATE; when the account is in an older period, roll it first."""
    if conn.execute(stmt, params).rowcount != 1:
        conn.execute(ROLL_PERIOD, params)
        if conn.execute(stmt, params).rowcount != 1:
            raise RuntimeError(f"billing account {params['p_org']!r} is missing")


def open_store(sessions: async_sessionmaker, *, default_plan: str) -> BillingStore:
    """The store of the database behind `sessions` (migrated, plans synced): `PgBillingStore`
    on PostgreSQL, else `SqliteBillingStore`."""
    if sessions.kw["bind"].dialect.name == "postgresql":
        from services.billing.store_pg import PgBillingStore  # asyncpg, loaded only here

        return PgBillingStore(sessions, default_plan=default_plan)
    from services.billing.store_sqlite import SqliteBillingStore

    return SqliteBillingStore(sessions, default_plan=default_plan)


class BillingStore(abc.ABC):
    """The billing database as one transaction per call (see the module docstring).

    Args:
        sessions: async session factory of the billing database (migrated, plans synced); the
            calls run through `TxnRunner` over the same engine, `sessions` serves reads and tests.
        default_plan: plan name given to auto-provisioned accounts (must be in `plans`).
        clock: returns the current aware UTC time (tests may replace it; the rules read it too).
    """

    #: Bound on the per-organization cache (cleared when exceeded).
    ACCOUNT_CACHE_SIZE = 100_000
    ACCOUNT_CACHE_TTL_S = 1.0

    def __init__(
        self,
        sessions: async_sessionmaker,
        *,
        default_plan: str,
        clock: Callable[[], datetime.datetime] = utcnow,
    ) -> None:
        self.sessions = sessions
        self.default_plan = default_plan
        self.clock = clock
        self.db = TxnRunner(sessions.kw["bind"], thread_name="billing-db")
        self.plans: dict[str, PlanTerms] = {}
        self._accounts: dict[str, tuple[str, datetime.date, float]] = {}

    async def close(self) -> None:
        """Stop the transaction runner (worker thread), then dispose of the engine."""
        self.db.close()
        await self.sessions.kw["bind"].dispose()

    # ------------------------------------------------------------------ plans and accounts

    async def load_plans(self) -> dict[str, PlanTerms]:
        """(Re)load the plan catalogue from the `plans` table into memory; call after every sync."""
        self.plans = await self.db.run(_load_plans)
        return self.plans

    async def plan(self, name: str) -> PlanTerms:
        """The terms of plan `name`, reloading the catalogue once when it is not known."""
        plan = self.plans.get(name)
        if plan is None:
            plan = (await self.load_plans()).get(name)
            if plan is None:
                raise RuntimeError(f"plan {name!r} is not in the plans table")
        return plan

    def _plan_in_txn(self, conn: Connection, name: str) -> PlanTerms:
        plan = self.plans.get(name)
        if plan is None:
            self.plans = _load_plans(conn)  # one reference swap: safe to read from the loop
            plan = self.plans.get(name)
            if plan is None:
                raise RuntimeError(f"plan {name!r} is not in the plans table")
        return plan

    def remember(self, org_id: str, plan: str, period_start: datetime.date) -> None:
        """Cache `org_id`'s plan name and period start as just read."""
        if len(self._accounts) >= self.ACCOUNT_CACHE_SIZE:
            self._accounts.clear()
        self._accounts[org_id] = (plan, period_start, time.monotonic())

    def known(self, org_id: str, period: datetime.date) -> str | None:
        """The cached plan name of `org_id` if its account exists, is in `period`, and was read
        less than ACCOUNT_CACHE_TTL_S ago: a plan changed by another process (the admin command,
        another replica) applies to every layer, the rate layer included, within that time."""
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
        row = conn.execute(SEL_ACCOUNT, {"p_org": org_id}).first()
        if row is not None and row.period_start >= period:
            return row
        if row is None:
            if not provision:
                return None
            plan = self.plans.get(self.default_plan) or _load_plans(conn).get(self.default_plan)
            if plan is None:
                raise RuntimeError(f"default plan {self.default_plan!r} is not in the plans table")
            result = conn.execute(
                _insert_if_absent(conn, Account.__table__, ("org_id",)),
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
            conn.execute(ROLL_PERIOD, {"p_org": org_id, "p_period": period})
        return conn.execute(SEL_ACCOUNT, {"p_org": org_id}).one()

    async def account(self, org_id: str, *, provision: bool = True) -> tuple[Any, PlanTerms] | None:
        """The account row of `org_id` and its plan terms, rolled into the current period.

        Provisions it on the default plan when absent and `provision` (else returns None).
        Raises RuntimeError when the default plan is not in the `plans` table.
        """
        row = await self.db.run(self._account_txn, org_id, provision)
        if row is None:
            return None
        self.remember(org_id, row.plan, row.period_start)
        return row, await self.plan(row.plan)

    async def ensure_account(self, org_id: str) -> None:
        """Make sure `org_id` has an account (skipped when this process already knows it)."""
        if self.known(org_id, month_start(self.clock().date())) is None:
            await self.account(org_id)

    # ------------------------------------------------------------------ admission

    @abc.abstractmethod
    def admit(
        self,
        values: dict[str, Any],
        plan_name: str | None,
        period: datetime.date,
        today: str,
        rates: RateLimiter,
    ) -> Awaitable[AdmitOutcome]:
        """Replay check, rate hit and reservation of the admission `values` (Reservation columns).

        Returns (kind, detail, account row read here or None, plan) with kind "replay" (detail =
        the existing reservation), "rate" (the refusing RateDecision; nothing reserved),
        "denied" (a Refusal; the layers' updates are rolled back, an account provisioned here
        is kept) or "admitted" ((RateDecision, `_reserve_txn`'s result)). `plan_name` is the
        cached plan (None: read the account). Mutates `values` (funding, wallet_minor). Raises
        IntegrityError when a concurrent Admit took the turn key.
        """

    def find_reservation(
        self, org_id: str, turn_key: str, need_account: bool
    ) -> Awaitable[tuple[Any, Any]]:
        """(reservation of (org_id, turn_key) or None, account row if `need_account` or None)."""
        return self.db.run(self._find_txn, org_id, turn_key, need_account)

    def _find_txn(
        self, conn: Connection, org_id: str, turn_key: str, need_account: bool
    ) -> tuple[Any, Any]:
        existing = conn.execute(SEL_RESERVATION, {"p_org": org_id, "p_turn_key": turn_key}).first()
        if not need_account:
            return existing, None
        return existing, self._account_txn(conn, org_id, True)

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

        Fast path: one UPDATE checking quota and allowance together for the cached plan and
        period. When it matches no row (a layer would refuse, the allowance is spent, the plan
        or period changed) the slow path, inside a SAVEPOINT, re-reads the account and runs
        each layer as its own conditional UPDATE, in order. Returns None after the fast path,
        else the account's (plan, period_start). Raises Refusal(layer) with the slow path's
        updates rolled back. Mutates `values` (funding, wallet_minor).
        """
        params = {
            "p_org": values["org_id"],
            "p_plan": plan.name,
            "p_period": period,
            "p_credits": values["credits"],
            "p_today": today,
            "p_max_runs": plan.max_runs_per_day,
        }
        fast = FAST_RESERVE[(counts_runs, plan.max_runs_per_day is not None)]
        if conn.execute(fast, params).rowcount == 1:
            conn.execute(INS_RESERVATION, values)
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
        """The layers in order: quota, allowance, then (overage allowed) the wallet."""
        credits = values["credits"]
        account = conn.execute(SEL_ACCOUNT, params).one()
        if account.period_start < period:
            conn.execute(ROLL_PERIOD, params)
        plan = self._plan_in_txn(conn, account.plan)
        params["p_max_runs"] = plan.max_runs_per_day

        def refuse(layer: str) -> Refusal:
            return Refusal(layer, conn.execute(SEL_ACCOUNT, params).one(), plan)

        if (
            counts_runs
            and conn.execute(QUOTA_UPDATE[plan.max_runs_per_day is not None], params).rowcount != 1
        ):
            raise refuse("quota")
        if conn.execute(ALLOWANCE_UPDATE, params).rowcount != 1:
            if not plan.wallet_overage:
                raise refuse("credit")
            params["p_cost"] = cost = credits * plan.wallet_price_minor
            if conn.execute(WALLET_UPDATE, params).rowcount != 1:
                raise refuse("wallet")
            values["funding"], values["wallet_minor"] = WALLET, cost
        conn.execute(INS_RESERVATION, values)
        return account.plan, max(account.period_start, period)

    # ------------------------------------------------------------------ charge, release, expiry

    def charge(self, reservation_id: str, late: bool = False) -> Awaitable[ChargeOutcome]:
        """Charge a HELD reservation (with `late`, an EXPIRED one too): see `_charge_txn`."""
        return self.db.run(self._charge_txn, reservation_id, late)

    def _charge_txn(
        self, conn: Connection, reservation_id: str, late: bool = False
    ) -> ChargeOutcome:
        """State CHARGED, the hold moved into used (or debited from the wallet), ledger entry
        "charge:{id}". Returns (CHARGED, entry id, False, org_id) when charged now, (CHARGED, its
        entry id, True, None) when charged before, (state, "", False, None) when it cannot be
        charged (state None: unknown), with nothing written."""
        now = self.clock()
        held = conn.execute(CHARGE_RESERVATION, {"p_id": reservation_id, "p_now": now}).first()
        expired = False
        if held is None and late:
            held = conn.execute(CHARGE_EXPIRED, {"p_id": reservation_id, "p_now": now}).first()
            expired = held is not None
        if held is None:
            row = conn.execute(
                SEL_CHARGE_STATE, {"p_id": reservation_id, "p_key": f"charge:{reservation_id}"}
            ).first()
            if row is None:
                return None, "", False, None
            if row.state == CHARGED:
                return CHARGED, row.id, True, None
            return row.state, "", False, None
        if held.funding == WALLET:
            stmt = CHARGE_WALLET_LATE if expired else CHARGE_WALLET
            unit, amount = UNIT_MINOR, held.wallet_minor
        else:
            stmt = CHARGE_ALLOWANCE_LATE if expired else CHARGE_ALLOWANCE
            unit, amount = UNIT_CREDIT, held.credits
        # A hold opened last month is charged to the current period (rolled first).
        _roll_and_retry(
            conn, stmt, {"p_org": held.org_id, "p_period": month_start(now.date()), "p_n": amount}
        )
        entry_id = new_id("led")
        note = f"{held.usage_type} {held.credits} credit(s) via {held.funding}"
        conn.execute(
            INS_LEDGER,
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
                conn.execute(RETAKE_QUOTA, {"p_org": held.org_id, "p_quota_day": held.quota_day})
            log.warning(
                "charged a reservation after its hold expired",
                extra={"fields": {"reservation_id": reservation_id, "org_id": held.org_id}},
            )
        return CHARGED, entry_id, False, held.org_id

    @abc.abstractmethod
    def charge_batch(self, reservation_ids: list[str]) -> Awaitable[list[ChargeOutcome]]:
        """Each reservation as `charge(late=True)`; outcomes in order."""

    def void(
        self, reservation_id: str, state: str, reason: str | None
    ) -> Awaitable[tuple[str | None, str | None]]:
        """Move a HELD reservation to `state` (released, expired) and give its hold back.

        Returns (org_id, None) if voided now, (None, current state) if it was not HELD,
        (None, None) if it does not exist.
        """
        return self.db.run(self._void_txn, reservation_id, state, reason)

    def _void_txn(
        self, conn: Connection, reservation_id: str, state: str, reason: str | None
    ) -> tuple[str | None, str | None]:
        held = conn.execute(
            VOID_RESERVATION,
            {"p_id": reservation_id, "p_state": state, "p_now": self.clock(), "p_reason": reason},
        ).first()
        if held is None:
            return None, conn.execute(SEL_RESERVATION_STATE, {"p_id": reservation_id}).scalar()
        wallet = held.funding == WALLET
        conn.execute(
            VOID_ACCOUNT,
            {
                "p_org": held.org_id,
                "p_allowance": 0 if wallet else held.credits,
                "p_wallet": held.wallet_minor if wallet else 0,
                "p_quota_day": held.quota_day or None,
            },
        )
        return held.org_id, None

    def overdue_holds(self, now: datetime.datetime, batch: int) -> Awaitable[list[str]]:
        """Ids of at most `batch` HELD reservations whose `expires_at` <= `now`, oldest first."""
        return self.db.run(
            lambda conn: conn.execute(SEL_EXPIRED, {"p_now": now, "p_batch": batch}).scalars().all()
        )

    # ------------------------------------------------------------------ usage and ledger entries

    @abc.abstractmethod
    def record_usage(
        self, rows: list[tuple[dict[str, Any], dict[str, Any] | None]]
    ) -> Awaitable[list[Any]]:
        """Write each (usage record, ledger entry or None) unless its (run_id, call_index) exists,
        provisioning the accounts. Per row: None (written now), the existing record (id, org_id,
        millicredits), or LEFT (not done here: the caller runs `record_usage_one`)."""

    def record_usage_one(
        self, record: dict[str, Any], ledger: dict[str, Any] | None
    ) -> Awaitable[Any]:
        """One call of `record_usage` in its own transaction (its account exists)."""
        return self.db.run(self._usage_txn, record, ledger)

    def _usage_txn(
        self, conn: Connection, record: dict[str, Any], ledger: dict[str, Any] | None
    ) -> Any:
        """INSERT the usage record unless (run_id, call_index) exists; then its ledger entry and
        the account's usage total. Returns None when inserted, else the existing record."""
        table = UsageRecord.__table__
        if (
            conn.execute(_insert_if_absent(conn, table, ("run_id", "call_index")), record).rowcount
            != 1
        ):
            return conn.execute(
                SEL_USAGE, {"p_run": record["run_id"], "p_call": record["call_index"]}
            ).one()
        if ledger is not None:
            conn.execute(INS_LEDGER, ledger)
            _roll_and_retry(
                conn,
                ADD_USAGE,
                {
                    "p_org": ledger["org_id"],
                    "p_period": month_start(ledger["created_at"].date()),
                    "p_n": -ledger["amount"],
                },
            )
        return None

    def post_usage_entry(self, entry: dict[str, Any], period: datetime.date) -> Awaitable[Any]:
        """Post usage ledger entry `entry` (negative millicredits) unless its idempotency key
        exists and add it to the account's usage total. None when posted, else the existing
        entry (id, org_id, kind, amount)."""
        params = {"p_org": entry["org_id"], "p_period": period, "p_n": -entry["amount"]}
        return self.db.run(self._ledger_txn, entry, ADD_USAGE, params)

    def post_balance_entry(self, entry: dict[str, Any]) -> Awaitable[Any]:
        """Post a "grant" (allowance) or "top_up" (wallet) entry unless its idempotency key exists,
        and add its amount to that balance. None when posted, else the existing entry."""
        params = {"p_org": entry["org_id"], "p_n": entry["amount"]}
        return self.db.run(self._ledger_txn, entry, _BALANCE_CHANGE[entry["kind"]], params)

    def _ledger_txn(
        self, conn: Connection, entry: dict[str, Any], account_stmt: Any, params: dict[str, Any]
    ) -> Any:
        table = LedgerEntry.__table__
        if conn.execute(_insert_if_absent(conn, table, ("idempotency_key",)), entry).rowcount != 1:
            return conn.execute(SEL_LEDGER_BY_KEY, {"p_key": entry["idempotency_key"]}).one()
        _roll_and_retry(conn, account_stmt, params)
        return None

    # ------------------------------------------------------------------ administration

    async def set_plan(self, org_id: str, plan: PlanTerms, period_start: datetime.date) -> None:
        """Put `org_id` on `plan`: allowance = its monthly credits + credits granted this period."""
        await self.db.run(
            lambda conn: conn.execute(
                SET_PLAN,
                {"p_org": org_id, "p_plan": plan.name, "p_credits": plan.monthly_run_credits},
            )
        )
        self.remember(org_id, plan.name, period_start)

    async def recent_entries(self, org_id: str, entries: int) -> tuple[list[LedgerEntry], int]:
        """(the newest `entries` ledger entries of `org_id`, its number of HELD reservations)."""
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
        return list(rows), held
