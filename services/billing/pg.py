"""Billing's hot transactions on PostgreSQL: one SQL statement each, straight on asyncpg.

Every turn's Admit, Charge and RecordUsageBatch update the same organization's `accounts`
row. Through SQLAlchemy's `run_sync` each of those transactions held that row lock across
several round trips (BEGIN, statements, COMMIT, plus a pool pre-ping), so turns of one
organization serialized on `Lock: transactionid` (measured: 66% of billing's connection
samples at concurrency 32; docs/performance.md). Here each is one statement with
data-modifying CTEs, sent on billing's own asyncpg pool (`services.common.pg.PgPool`): the
row lock is taken by the statement's account UPDATE and released by the COMMIT that ends
the same statement, with no client round trip in between.

The statements cover the common case only and report "not done here" (None / empty)
whenever anything else is needed; the caller (`services.billing.core.BillingCore`) then
runs the general transaction (`TxnRunner`), which reads the account, rolls its period,
builds denials and answers replays. The conditions are the ones of the general path
(README "Concurrency"): balances change by conditional UPDATEs, a reservation resolves
only from `held`, usage and ledger rows are keyed by their idempotency keys. A statement
is atomic, so its reply (sent after it returned) always follows its COMMIT.

Period guard: a statement that writes usage or a charge runs only while the account is in
the current period (`period_start >= $period`, checked in the statement's snapshot). A
period only moves forward (`_ROLL_PERIOD`), so the account UPDATE of the same statement,
which re-reads the newest row version, is in that period or a later one, as with the
general path's `UPDATE ... WHERE period_start >= :period`.
"""

from __future__ import annotations

import datetime
from typing import Any

import asyncpg
from sqlalchemy.exc import IntegrityError

from services.billing.models import CHARGED, HELD, WALLET, Reservation, UsageRecord
from services.common.db import utc
from services.common.pg import PgPool, pg_type, record_type

_U = UsageRecord.__table__
_RESERVATION_COLUMNS = tuple(column.name for column in Reservation.__table__.c)
_ReservationRow = record_type(*_RESERVATION_COLUMNS)
_SELECT_RESERVATION = f"SELECT {', '.join(_RESERVATION_COLUMNS)} FROM reservations WHERE org_id = $1 AND turn_key = $2"

# usage_records columns sent as arrays by `record_usage` (then the ledger entry's id and note)
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
        f"WITH t AS (SELECT * FROM unnest({', '.join(arrays)}) WITH ORDINALITY AS t({cols}, ledger_id, note, n)),"
        f" ok AS (SELECT t.* FROM t WHERE EXISTS (SELECT 1 FROM accounts a WHERE a.org_id = ${n + 3}"
        f" AND a.period_start >= ${n + 4}::date) AND t.org_id = ${n + 3}),"
        f" u AS (INSERT INTO usage_records ({cols}) SELECT {cols} FROM ok ORDER BY n"
        " ON CONFLICT (run_id, call_index) DO NOTHING RETURNING id, millicredits),"
        " l AS (INSERT INTO ledger_entries (id, idempotency_key, org_id, kind, unit, amount, reservation_id, usage_id,"
        " note, created_at) SELECT ok.ledger_id, 'usage:' || ok.run_id || ':' || ok.call_index, ok.org_id,"
        " 'token_usage', 'millicredit', -ok.millicredits, NULL, ok.id, ok.note, ok.created_at"
        " FROM u JOIN ok ON ok.id = u.id WHERE u.millicredits > 0 ORDER BY ok.n),"
        " a AS (UPDATE accounts SET usage_millicredits = usage_millicredits + s.total"
        f" FROM (SELECT coalesce(sum(millicredits), 0)::bigint AS total FROM u) s WHERE org_id = ${n + 3} AND s.total > 0)"
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
INSERT INTO reservations (id, org_id, turn_key, usage_type, rate_class, credits, funding, wallet_minor, quota_day,
                          state, created_at, expires_at, resolved_at, release_reason)
SELECT $9::varchar, a.org_id, $10::varchar, $11::varchar, $12::varchar, $4::bigint, '{funding}', $8::bigint,
       $13::varchar, 'held', $14::timestamptz, $15::timestamptz, NULL, NULL
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

# Charge: $1 reservation id, $2 now, $3 period, $4 ledger entry id.
_CHARGE = f"""
WITH r AS (
  UPDATE reservations SET state = '{CHARGED}', resolved_at = $2::timestamptz
  WHERE id = $1::varchar AND state = '{HELD}'
    AND EXISTS (SELECT 1 FROM accounts a WHERE a.org_id = reservations.org_id AND a.period_start >= $3::date)
  RETURNING org_id, credits, funding, wallet_minor, usage_type
),
l AS (
  INSERT INTO ledger_entries (id, idempotency_key, org_id, kind, unit, amount, reservation_id, usage_id, note, created_at)
  SELECT $4::varchar, 'charge:' || $1::varchar, r.org_id, 'run_charge',
         CASE WHEN r.funding = '{WALLET}' THEN 'minor' ELSE 'credit' END,
         -(CASE WHEN r.funding = '{WALLET}' THEN r.wallet_minor ELSE r.credits END),
         $1::varchar, NULL, r.usage_type || ' ' || r.credits || ' credit(s) via ' || r.funding, $2::timestamptz
  FROM r
)
UPDATE accounts a SET
  allowance_reserved = a.allowance_reserved - (CASE WHEN r.funding = '{WALLET}' THEN 0 ELSE r.credits END),
  allowance_used = a.allowance_used + (CASE WHEN r.funding = '{WALLET}' THEN 0 ELSE r.credits END),
  wallet_reserved_minor = a.wallet_reserved_minor - (CASE WHEN r.funding = '{WALLET}' THEN r.wallet_minor ELSE 0 END),
  wallet_balance_minor = a.wallet_balance_minor - (CASE WHEN r.funding = '{WALLET}' THEN r.wallet_minor ELSE 0 END)
FROM r WHERE a.org_id = r.org_id
RETURNING r.org_id
"""

# Release / expiry: $1 reservation id, $2 new state, $3 now, $4 reason.
_VOID = f"""
WITH r AS (
  UPDATE reservations SET state = $2::varchar, resolved_at = $3::timestamptz, release_reason = $4::varchar
  WHERE id = $1::varchar AND state = '{HELD}'
  RETURNING org_id, credits, funding, wallet_minor, quota_day
)
UPDATE accounts a SET
  allowance_reserved = a.allowance_reserved - (CASE WHEN r.funding = '{WALLET}' THEN 0 ELSE r.credits END),
  wallet_reserved_minor = a.wallet_reserved_minor - (CASE WHEN r.funding = '{WALLET}' THEN r.wallet_minor ELSE 0 END),
  runs_today = CASE WHEN r.quota_day <> '' AND a.quota_day = r.quota_day AND a.runs_today > 0
                    THEN a.runs_today - 1 ELSE a.runs_today END
FROM r WHERE a.org_id = r.org_id
RETURNING r.org_id
"""

# A ledger entry and the account's usage total: $1 id, $2 key, $3 org, $4 kind, $5 unit,
# $6 amount, $7 note, $8 created_at, $9 period, $10 millicredits added to usage.
_LEDGER_USAGE = """
WITH l AS (
  INSERT INTO ledger_entries (id, idempotency_key, org_id, kind, unit, amount, reservation_id, usage_id, note, created_at)
  SELECT $1::varchar, $2::varchar, $3::varchar, $4::varchar, $5::varchar, $6::bigint, NULL, NULL, $7::varchar,
         $8::timestamptz
  WHERE EXISTS (SELECT 1 FROM accounts a WHERE a.org_id = $3::varchar AND a.period_start >= $9::date)
  ON CONFLICT (idempotency_key) DO NOTHING
  RETURNING id
)
UPDATE accounts a SET usage_millicredits = a.usage_millicredits + $10::bigint
FROM l WHERE a.org_id = $3::varchar
RETURNING l.id
"""


class PgBilling(PgPool):
    """The hot billing transactions as single statements (see the module docstring).

    Each method returns what it did, or a "not here" value after which the caller runs the
    general transaction; nothing is written in that case. asyncpg errors propagate
    (`reserve` raises sqlalchemy's IntegrityError when a concurrent Admit took the turn key).

    Args:
        url: billing's SQLAlchemy URL (`postgresql+asyncpg://...`).
        max_size: asyncpg connections at most.
    """

    async def reserve(
        self,
        values: dict[str, Any],
        plan: Any,
        period: datetime.date,
        today: str,
        counts_runs: bool,
    ) -> bool:
        """Hold `values["credits"]` for the reservation `values` (Reservation columns) in one statement.

        Tries the period allowance, then (plan with `wallet_overage`) the wallet at
        `credits x wallet_price_minor` minor units, each with the daily quota of `plan`
        (`PlanTerms`) for runs (`counts_runs`). Only for an account on `plan.name` in
        `period`. Returns True when reserved (sets `values["funding"]`, `values["wallet_minor"]`);
        False when neither fits or the account is not as cached: nothing was written,
        the caller runs the layered path (which finds the denial or rolls the period).
        Raises sqlalchemy's IntegrityError (from asyncpg.UniqueViolationError) when the
        (org, turn_key) exists, as the general path does.
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
        pool = await self.pool()
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

    async def reservation(self, org_id: str, turn_key: str) -> Any:
        """The reservation row of (org_id, turn_key) (attributes by column name) or None. One SELECT."""
        pool = await self.pool()
        record = await pool.fetchrow(_SELECT_RESERVATION, org_id, turn_key)
        return None if record is None else _ReservationRow(tuple(record))

    async def charge(
        self, reservation_id: str, now: datetime.datetime, period: datetime.date, entry_id: str
    ) -> str | None:
        """Charge a HELD reservation of an account in `period`: state CHARGED, ledger entry
        `entry_id` ("charge:{id}", unit credit or minor), hold moved into used/debited. Returns
        the org id when charged here; None when the reservation is not HELD, unknown, or its
        account is in an older period (nothing written)."""
        pool = await self.pool()
        return await pool.fetchval(_CHARGE, reservation_id, utc(now), period, entry_id)

    async def void(
        self, reservation_id: str, state: str, now: datetime.datetime, reason: str | None
    ) -> tuple[str | None, str | None]:
        """Move a HELD reservation to `state` (released/expired) and give its hold back, one
        statement; then, if it was not HELD, one SELECT of its state. Returns (org_id, None) when
        voided now, (None, current state) when it was not HELD, (None, None) when unknown."""
        pool = await self.pool()
        org_id = await pool.fetchval(_VOID, reservation_id, state, utc(now), reason)
        if org_id is not None:
            return org_id, None
        return None, await pool.fetchval(
            "SELECT state FROM reservations WHERE id = $1", reservation_id
        )

    async def record_usage(
        self,
        org_id: str,
        period: datetime.date,
        calls: list[tuple[dict[str, Any], dict[str, Any] | None]],
    ) -> set[str]:
        """Insert the usage records of `calls` ((record, ledger entry or None), all of `org_id`) unless
        their (run_id, call_index) exists, their ledger entries, and add the new millicredits to
        the account, in one statement, if the account is in `period`. Returns the ids of the
        records inserted; the others (replays, duplicates in `calls`, an account to roll) are
        left to the caller."""
        columns: list[list[Any]] = [[] for _ in range(len(_USAGE_COLUMNS) + 2)]
        for record, ledger in calls:
            for i, name in enumerate(_USAGE_COLUMNS):
                value = record[name]
                columns[i].append(utc(value) if name == "created_at" else value)
            columns[-2].append(None if ledger is None else ledger["id"])
            columns[-1].append(None if ledger is None else ledger["note"])
        pool = await self.pool()
        return {r[0] for r in await pool.fetch(_USAGE, *columns, org_id, period)}

    async def post_usage_entry(
        self, entry: dict[str, Any], period: datetime.date, millicredits: int
    ) -> str | None:
        """Insert ledger entry `entry` (LedgerEntry columns, no reservation/usage id) unless its
        idempotency key exists, and add `millicredits` to the account's usage total, if the
        account is in `period`. Returns the entry id when posted here, None otherwise (replay or
        account to roll: nothing written)."""
        pool = await self.pool()
        return await pool.fetchval(
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
            millicredits,
        )
