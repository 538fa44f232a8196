"""Billing's store on SQLite: the general transactions, each call one transaction.

Runs on the process's one database thread (`services.common.txn`: raw `sqlite3`, group commit;
a lone transaction inline). The batch calls are one transaction each, so a batch costs one
commit; an admission with memory rate counters is one call to that thread, its rate hit inside.
"""

from __future__ import annotations

import datetime
from collections.abc import Awaitable
from typing import Any

from sqlalchemy.engine import Connection

from services.billing.rates import RateLimiter
from services.billing.statements import SEL_RESERVATION
from services.billing.store import (
    AdmitOutcome,
    BillingStore,
    ChargeOutcome,
    Refusal,
)

USAGE_INLINE_RECORDS = 20  # a larger usage or charge batch runs on the worker thread, not inline


class SqliteBillingStore(BillingStore):
    """`BillingStore` whose every call is a general transaction (SQLite, any non-PostgreSQL)."""

    def admit(
        self,
        values: dict[str, Any],
        plan_name: str | None,
        period: datetime.date,
        today: str,
        rates: RateLimiter,
    ) -> Awaitable[AdmitOutcome]:
        """One transaction with memory rate counters (`_admit_txn`); with Redis counters a read,
        the rate hit on the loop, then the reservation (`_admit_two_step`)."""
        if rates.synchronous:
            return self.db.run(self._admit_txn, values, plan_name, period, today, rates)
        return self._admit_two_step(values, plan_name, period, today, rates)

    def _admit_txn(
        self,
        conn: Connection,
        values: dict[str, Any],
        plan_name: str | None,
        period: datetime.date,
        today: str,
        rates: RateLimiter,
    ) -> AdmitOutcome:
        """The whole admission in one transaction (memory rate counters, any thread)."""
        org_id = values["org_id"]
        existing = conn.execute(
            SEL_RESERVATION, {"p_org": org_id, "p_turn_key": values["turn_key"]}
        ).first()
        row = None
        if plan_name is None:
            row = self._account_txn(conn, org_id, True)
            plan_name = row.plan
        plan = self._plan_in_txn(conn, plan_name)
        if existing is not None:
            return "replay", existing, row, plan
        rate = rates.hit_now(
            org_id, values["rate_class"], plan.rate_limits.get(values["rate_class"])
        )
        if not rate.allowed:
            return "rate", rate, row, plan
        try:
            fresh = self._reserve_txn(
                conn, values, plan, period, today, values["usage_type"] == "run"
            )
        except Refusal as refused:
            return "denied", refused, row, plan
        return "admitted", (rate, fresh), row, plan

    async def _admit_two_step(
        self,
        values: dict[str, Any],
        plan_name: str | None,
        period: datetime.date,
        today: str,
        rates: RateLimiter,
    ) -> AdmitOutcome:
        """`_admit_txn`'s outcome for shared (Redis) rate counters: read, rate hit, reserve."""
        org_id, rate_class = values["org_id"], values["rate_class"]
        async with self.db.transaction() as run:
            existing, row = await run(self._find_txn, org_id, values["turn_key"], plan_name is None)
            if row is not None:
                plan_name = row.plan
            assert plan_name is not None
            plan = await self.plan(plan_name)
            if existing is not None:
                return "replay", existing, row, plan
            rate = await rates.hit(org_id, rate_class, plan.rate_limits.get(rate_class))
            if not rate.allowed:
                return "rate", rate, row, plan
            try:
                fresh = await run(
                    self._reserve_txn, values, plan, period, today, values["usage_type"] == "run"
                )
            except Refusal as refused:  # raised after its SAVEPOINT rolled back: the read stays
                return "denied", refused, row, plan
            return "admitted", (rate, fresh), row, plan

    def charge_batch(self, reservation_ids: list[str]) -> Awaitable[list[ChargeOutcome]]:
        """Each reservation as `charge(late=True)`, in order, in one transaction (one commit)."""
        return self.db.run(
            self._charge_batch_txn,
            reservation_ids,
            inline=len(reservation_ids) <= USAGE_INLINE_RECORDS,
        )

    def _charge_batch_txn(self, conn: Connection, reservation_ids: list[str]) -> list[Any]:
        return [self._charge_txn(conn, reservation_id, True) for reservation_id in reservation_ids]

    async def record_usage(
        self, rows: list[tuple[dict[str, Any], dict[str, Any] | None]]
    ) -> list[Any]:
        """The accounts provisioned first, then one transaction for all (each as `_usage_txn`)."""
        for org_id in dict.fromkeys(record["org_id"] for record, _ in rows):
            await self.ensure_account(org_id)
        return await self.db.run(
            self._usage_batch_txn, rows, inline=len(rows) <= USAGE_INLINE_RECORDS
        )

    def _usage_batch_txn(
        self, conn: Connection, rows: list[tuple[dict[str, Any], dict[str, Any] | None]]
    ) -> list[Any]:
        return [self._usage_txn(conn, record, ledger) for record, ledger in rows]
