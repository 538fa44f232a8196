"""Billing's store on PostgreSQL: the hot calls as one SQL statement each, straight on asyncpg.

Every turn's Admit, Charge and RecordUsageBatch update the same organization's `accounts` row.
Through SQLAlchemy's `run_sync` each of those transactions held that row lock across several
round trips (BEGIN, statements, COMMIT, a pool pre-ping), so turns of one organization
serialized on it (docs/performance.md). Here each is one statement with data-modifying CTEs,
sent on billing's own asyncpg pool (`services.common.pg.PgPool`): the row lock is taken by the
statement's account UPDATE and released by the COMMIT that ends the same statement.

The statements cover the common case only and write nothing whenever anything else is needed;
`PgBillingStore` then runs the general transaction of `BillingStore`, which reads the account,
rolls its period, finds the refusing layer and answers replays. The conditions are the general
path's (conditional UPDATEs, a reservation resolves only from `held`, usage and ledger rows
keyed by their idempotency keys).

Period guard: a statement that writes usage or a charge runs only while the account is in the
current period (`period_start >= $period`, checked in the statement's snapshot). A period only
moves forward (`ROLL_PERIOD`), so the account UPDATE of the same statement, which re-reads the
newest row version, is in that period or a later one, as with the general path.
"""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

import asyncpg
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import async_sessionmaker

from services.billing.models import (
    CHARGED,
    HELD,
    WALLET,
    Reservation,
    UsageRecord,
    month_start,
    new_id,
)
from services.billing.plans import PlanTerms
from services.billing.rates import RateLimiter
from services.billing.store import LEFT, AdmitOutcome, BillingStore, ChargeOutcome, Refusal
from services.common.db import utc
from services.common.pg import PgPool, pg_type, record_type

_U = UsageRecord.__table__
_RESERVATION_COLUMNS = tuple(column.name for column in Reservation.__table__.c)
_ReservationRow = record_type(*_RESERVATION_COLUMNS)
_SELECT_RESERVATION = (
    f"SELECT {', '.join(_RESERVATION_COLUMNS)} FROM reservations"
    " WHERE org_id = $1 AND turn_key = $2"
)
_SELECT_STATE = "SELECT state FROM reservations WHERE id = $1"

# usage_records columns sent as arrays by `_insert_usage` (then the ledger entry's id and note)
_USAGE_COLUMNS = (
    "id",
    "org_id",
    "run_id",
    "call_index",
    "chat_id",
    "provider_id",
    "model_id",
    "input_tokens",
    "output_tokens",
    "cache_read_tokens",
    "cache_write_tokens",
    "byok",
    "estimated",
    "millicredits",
    "created_at",
)


def _usage_sql() -> str:
    arrays = [f"${i + 1}::{pg_type(_U.c[name])}[]" for i, name in enumerate(_USAGE_COLUMNS)]
    n = len(_USAGE_COLUMNS)
    arrays += [f"${n + 1}::varchar(40)[]", f"${n + 2}::varchar(255)[]"]
    cols = ", ".join(_USAGE_COLUMNS)
    return (
        f"WITH t AS (SELECT * FROM unnest({', '.join(arrays)})"
        f" WITH ORDINALITY AS t({cols}, ledger_id, note, n)),"
        " ok AS (SELECT t.* FROM t WHERE EXISTS (SELECT 1 FROM accounts a"
        f" WHERE a.org_id = ${n + 3} AND a.period_start >= ${n + 4}::date)"
        f" AND t.org_id = ${n + 3}),"
        f" u AS (INSERT INTO usage_records ({cols}) SELECT {cols} FROM ok ORDER BY n"
        " ON CONFLICT (run_id, call_index) DO NOTHING RETURNING id, millicredits),"
        " l AS (INSERT INTO ledger_entries (id, idempotency_key, org_id, kind, unit, amount,"
        " reservation_id, usage_id, note, created_at)"
        " SELECT ok.ledger_id, 'usage:' || ok.run_id || ':' || ok.call_index, ok.org_id,"
        " 'token_usage', 'millicredit', -ok.millicredits, NULL, ok.id, ok.note, ok.created_at"
        " FROM u JOIN ok ON ok.id = u.id WHERE u.millicredits > 0 ORDER BY ok.n),"
        " a AS (UPDATE accounts SET usage_millicredits = usage_millicredits + s.total"
        " FROM (SELECT coalesce(sum(millicredits), 0)::bigint AS total FROM u) s"
        f" WHERE org_id = ${n + 3} AND s.total > 0)"
        " SELECT id FROM u"
    )


_USAGE = _usage_sql()

# Admission, one conditional account UPDATE (quota + allowance, or quota + wallet) and the
# reservation INSERT fed by its row. Parameters: $1 org, $2 plan, $3 period, $4 credits,
# $5 today, $6 max runs a day (NULL: none), $7 counts runs, $8 wallet cost (0: allowance),
# $9 id, $10 turn key, $11 usage type, $12 rate class, $13 reservation quota_day,
# $14 created_at, $15 expires_at.
_RESERVE = """
WITH a AS (
  UPDATE accounts SET
    {set_balance},
    runs_today = CASE WHEN NOT $7::boolean THEN runs_today
                      WHEN quota_day = $5::varchar THEN runs_today + 1 ELSE 1 END,
    quota_day = CASE WHEN $7::boolean THEN $5::varchar ELSE quota_day END
  WHERE org_id = $1::varchar AND plan = $2::varchar AND period_start >= $3::date
    AND (NOT $7::boolean OR $6::bigint IS NULL
         OR (CASE WHEN quota_day = $5::varchar THEN runs_today ELSE 0 END) + 1 <= $6::bigint)
    AND {fits}
  RETURNING org_id
)
INSERT INTO reservations (id, org_id, turn_key, usage_type, rate_class, credits, funding,
                          wallet_minor, quota_day, state, created_at, expires_at, resolved_at,
                          release_reason)
SELECT $9::varchar, a.org_id, $10::varchar, $11::varchar, $12::varchar, $4::bigint, '{funding}',
       $8::bigint, $13::varchar, 'held', $14::timestamptz, $15::timestamptz, NULL, NULL
FROM a
RETURNING id
"""
_RESERVE_ALLOWANCE = _RESERVE.format(
    set_balance="allowance_reserved = allowance_reserved + $4::bigint",
    fits="allowance_used + allowance_reserved + $4::bigint <= period_allowance",
    funding="allowance",
)
_RESERVE_WALLET = _RESERVE.format(
    set_balance="wallet_reserved_minor = wallet_reserved_minor + $8::bigint",
    fits="allowance_used + allowance_reserved + $4::bigint > period_allowance"
    " AND wallet_balance_minor - wallet_reserved_minor >= $8::bigint",
    funding=WALLET,
)

# Amounts of a resolved reservation `r` by funding source.
_CREDITS = f"(CASE WHEN r.funding = '{WALLET}' THEN 0 ELSE r.credits END)"
_MINOR = f"(CASE WHEN r.funding = '{WALLET}' THEN r.wallet_minor ELSE 0 END)"

# Charge: $1 reservation id, $2 now, $3 period, $4 ledger entry id.
_CHARGE = f"""
WITH r AS (
  UPDATE reservations SET state = '{CHARGED}', resolved_at = $2::timestamptz
  WHERE id = $1::varchar AND state = '{HELD}'
    AND EXISTS (SELECT 1 FROM accounts a
                WHERE a.org_id = reservations.org_id AND a.period_start >= $3::date)
  RETURNING org_id, credits, funding, wallet_minor, usage_type
),
l AS (
  INSERT INTO ledger_entries (id, idempotency_key, org_id, kind, unit, amount, reservation_id,
                              usage_id, note, created_at)
  SELECT $4::varchar, 'charge:' || $1::varchar, r.org_id, 'run_charge',
         CASE WHEN r.funding = '{WALLET}' THEN 'minor' ELSE 'credit' END,
         -(CASE WHEN r.funding = '{WALLET}' THEN r.wallet_minor ELSE r.credits END),
         $1::varchar, NULL, r.usage_type || ' ' || r.credits || ' credit(s) via ' || r.funding,
         $2::timestamptz
  FROM r
)
UPDATE accounts a SET
  allowance_reserved = a.allowance_reserved - {_CREDITS},
  allowance_used = a.allowance_used + {_CREDITS},
  wallet_reserved_minor = a.wallet_reserved_minor - {_MINOR},
  wallet_balance_minor = a.wallet_balance_minor - {_MINOR}
FROM r WHERE a.org_id = r.org_id
RETURNING r.org_id
"""

# Release / expiry: $1 reservation id, $2 new state, $3 now, $4 reason.
_VOID = f"""
WITH r AS (
  UPDATE reservations
  SET state = $2::varchar, resolved_at = $3::timestamptz, release_reason = $4::varchar
  WHERE id = $1::varchar AND state = '{HELD}'
  RETURNING org_id, credits, funding, wallet_minor, quota_day
)
UPDATE accounts a SET
  allowance_reserved = a.allowance_reserved - {_CREDITS},
  wallet_reserved_minor = a.wallet_reserved_minor - {_MINOR},
  runs_today = CASE WHEN r.quota_day <> '' AND a.quota_day = r.quota_day AND a.runs_today > 0
                    THEN a.runs_today - 1 ELSE a.runs_today END
FROM r WHERE a.org_id = r.org_id
RETURNING r.org_id
"""

# A ledger entry and the account's usage total: $1 id, $2 key, $3 org, $4 kind, $5 unit,
# $6 amount, $7 note, $8 created_at, $9 period, $10 millicredits added to usage.
_LEDGER_USAGE = """
WITH l AS (
  INSERT INTO ledger_entries (id, idempotency_key, org_id, kind, unit, amount, reservation_id,
                              usage_id, note, created_at)
  SELECT $1::varchar, $2::varchar, $3::varchar, $4::varchar, $5::varchar, $6::bigint, NULL, NULL,
         $7::varchar, $8::timestamptz
  WHERE EXISTS (SELECT 1 FROM accounts a
                WHERE a.org_id = $3::varchar AND a.period_start >= $9::date)
  ON CONFLICT (idempotency_key) DO NOTHING
  RETURNING id
)
UPDATE accounts a SET usage_millicredits = a.usage_millicredits + $10::bigint
FROM l WHERE a.org_id = $3::varchar
RETURNING l.id
"""


class PgBillingStore(BillingStore):
    """`BillingStore` with the hot calls as single statements (see the module docstring).

    Each override tries its statement first; when that wrote nothing, the general transaction
    runs. asyncpg errors propagate.
    """

    def __init__(self, sessions: async_sessionmaker, *, default_plan: str) -> None:
        super().__init__(sessions, default_plan=default_plan)
        engine = sessions.kw["bind"]  # the engine's pool size and timeout
        self._pg = PgPool(engine.url, max_size=engine.pool.size(), timeout_s=engine.pool.timeout())

    async def close(self) -> None:
        """Close the asyncpg pool too."""
        self._pg.close()
        await super().close()

    async def admit(
        self,
        values: dict[str, Any],
        plan_name: str | None,
        period: datetime.date,
        today: str,
        rates: RateLimiter,
    ) -> AdmitOutcome:
        """`BillingStore.admit` with no transaction open across round trips.

        An account not cached is read (provisioned, rolled) in its own transaction first; then
        one SELECT for a replay, the rate hit (memory or Redis), and the reservation as one
        statement (`_reserve`). Only when that statement reserves nothing (a layer refuses, the
        plan or period changed) does the layered `_reserve_txn` run, building the refusal.
        """
        org_id, rate_class = values["org_id"], values["rate_class"]
        row = None
        if plan_name is None:
            row = await self.db.run(self._account_txn, org_id, True)
            plan_name = row.plan
        plan = await self.plan(plan_name)
        pool = await self._pg.pool()
        record = await pool.fetchrow(_SELECT_RESERVATION, org_id, values["turn_key"])
        if record is not None:
            return "replay", _ReservationRow(tuple(record)), row, plan
        limit = plan.rate_limits.get(rate_class)
        if rates.synchronous:
            rate = rates.hit_now(org_id, rate_class, limit)
        else:
            rate = await rates.hit(org_id, rate_class, limit)
        if not rate.allowed:
            return "rate", rate, row, plan
        counts_runs = values["usage_type"] == "run"
        if await self._reserve(values, plan, period, today, counts_runs):
            return "admitted", (rate, None), row, plan
        try:
            fresh = await self.db.run(self._reserve_txn, values, plan, period, today, counts_runs)
        except Refusal as refused:
            return "denied", refused, row, plan
        return "admitted", (rate, fresh), row, plan

    async def _reserve(
        self,
        values: dict[str, Any],
        plan: PlanTerms,
        period: datetime.date,
        today: str,
        counts_runs: bool,
    ) -> bool:
        """Hold `values["credits"]` for the reservation `values` in one statement.

        Tries the period allowance, then (plan with `wallet_overage`) the wallet at
        `credits x wallet_price_minor` minor units, each with the daily quota of `plan` for
        runs (`counts_runs`), for an account on `plan.name` in `period` only. Returns True when
        reserved (sets `values["funding"]`, `values["wallet_minor"]`); False when nothing was
        written. Raises sqlalchemy's IntegrityError when the (org, turn_key) exists, as the
        general path does.
        """
        credits = values["credits"]
        args = [
            values["org_id"],
            plan.name,
            period,
            credits,
            today,
            plan.max_runs_per_day,
            counts_runs,
            0,
            values["id"],
            values["turn_key"],
            values["usage_type"],
            values["rate_class"],
            values["quota_day"],
            utc(values["created_at"]),
            utc(values["expires_at"]),
        ]
        pool = await self._pg.pool()
        try:
            if await pool.fetchval(_RESERVE_ALLOWANCE, *args) is not None:
                return True
            cost = credits * plan.wallet_price_minor
            if not plan.wallet_overage or cost <= 0:
                return False
            args[7] = cost
            if await pool.fetchval(_RESERVE_WALLET, *args) is None:
                return False
        except asyncpg.UniqueViolationError as error:
            raise IntegrityError("INSERT INTO reservations", None, error) from error
        values["funding"], values["wallet_minor"] = WALLET, cost
        return True

    async def charge(self, reservation_id: str, late: bool = False) -> ChargeOutcome:
        """One statement for a HELD reservation of an account in the current period; the
        general transaction for a replay, a refusal, a late charge or an account to roll."""
        now = self.clock()
        entry_id = new_id("led")
        pool = await self._pg.pool()
        org_id = await pool.fetchval(
            _CHARGE, reservation_id, utc(now), month_start(now.date()), entry_id
        )
        if org_id is not None:
            return CHARGED, entry_id, False, org_id
        return await self.db.run(self._charge_txn, reservation_id, late)

    async def charge_batch(self, reservation_ids: list[str]) -> list[ChargeOutcome]:
        """Each reservation as `charge(late=True)`, concurrently; outcomes in order."""
        return list(
            await asyncio.gather(
                *(self.charge(reservation_id, True) for reservation_id in reservation_ids)
            )
        )

    async def void(
        self, reservation_id: str, state: str, reason: str | None
    ) -> tuple[str | None, str | None]:
        """One statement; then, if the reservation was not HELD, one SELECT of its state."""
        pool = await self._pg.pool()
        org_id = await pool.fetchval(_VOID, reservation_id, state, utc(self.clock()), reason)
        if org_id is not None:
            return org_id, None
        return None, await pool.fetchval(_SELECT_STATE, reservation_id)

    async def record_usage(
        self, rows: list[tuple[dict[str, Any], dict[str, Any] | None]]
    ) -> list[Any]:
        """One statement per organization (records, ledger entries, one account UPDATE for their
        sum), organizations concurrently. A call it did not insert (a replay, a key repeated in
        the batch, an account to roll into the new period) is answered LEFT."""
        by_org: dict[str, list[int]] = {}
        for index, (record, _) in enumerate(rows):
            by_org.setdefault(record["org_id"], []).append(index)
        period = month_start(self.clock().date())

        async def one_org(org_id: str, indexes: list[int]) -> set[str]:
            await self.ensure_account(org_id)
            return await self._insert_usage(org_id, period, [rows[i] for i in indexes])

        done = await asyncio.gather(
            *(one_org(org_id, indexes) for org_id, indexes in by_org.items())
        )
        inserted = set().union(*done)
        return [None if record["id"] in inserted else LEFT for record, _ in rows]

    async def _insert_usage(
        self,
        org_id: str,
        period: datetime.date,
        calls: list[tuple[dict[str, Any], dict[str, Any] | None]],
    ) -> set[str]:
        """The ids of the usage records of `calls` (all of `org_id`) the statement inserted."""
        columns: list[list[Any]] = [[] for _ in range(len(_USAGE_COLUMNS) + 2)]
        for record, ledger in calls:
            for i, name in enumerate(_USAGE_COLUMNS):
                value = record[name]
                columns[i].append(utc(value) if name == "created_at" else value)
            columns[-2].append(None if ledger is None else ledger["id"])
            columns[-1].append(None if ledger is None else ledger["note"])
        pool = await self._pg.pool()
        return {r[0] for r in await pool.fetch(_USAGE, *columns, org_id, period)}

    async def post_usage_entry(self, entry: dict[str, Any], period: datetime.date) -> Any:
        """One statement when the account is in `period` and the key is new; else the general
        transaction (a replay, an account to roll)."""
        pool = await self._pg.pool()
        posted = await pool.fetchval(
            _LEDGER_USAGE,
            entry["id"],
            entry["idempotency_key"],
            entry["org_id"],
            entry["kind"],
            entry["unit"],
            entry["amount"],
            entry["note"],
            utc(entry["created_at"]),
            period,
            -entry["amount"],
        )
        if posted is not None:
            return None
        return await super().post_usage_entry(entry, period)
