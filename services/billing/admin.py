"""Administration of accounts: plan changes, credit grants, wallet top-ups and the account view.

Used by `python -m services.billing admin ...`; not part of the gRPC contract. Grants and
top-ups are ledger entries, idempotent by their key; reusing a key for another posting is
refused like an Idempotency-Key reused with another body.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from services.billing.models import UNIT_CREDIT, UNIT_MINOR, LedgerEntry, new_id
from services.billing.plans import PlanTerms
from services.billing.store import BillingStore

log = logging.getLogger(__name__)


class Admin:
    """The administration of billing accounts over a store."""

    def __init__(self, store: BillingStore) -> None:
        self.store = store

    async def set_plan(self, org_id: str, plan_name: str) -> None:
        """Move `org_id` (provisioned if absent) to `plan_name` from now on.

        The period allowance becomes the new plan's monthly credits + credits granted this
        period (it may fall below what is already used: further runs then draw on the
        wallet or are denied). Raises ValueError for an unknown plan.
        """
        store = self.store
        plan = store.plans.get(plan_name) or (await store.load_plans()).get(plan_name)
        if plan is None:
            raise ValueError(f"unknown plan {plan_name!r}")
        found = await store.account(org_id)
        assert found is not None  # provisioned when absent
        await store.set_plan(org_id, plan, found[0].period_start)
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
        await self.store.account(org_id)
        key = idempotency_key or f"grant:{uuid.uuid4().hex}"
        return await self._post(org_id, key, "grant", UNIT_CREDIT, credits, note)

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
        await self.store.account(org_id)
        key = idempotency_key or f"topup:{uuid.uuid4().hex}"
        return await self._post(org_id, key, "top_up", UNIT_MINOR, minor_units, note)

    async def _post(
        self, org_id: str, key: str, kind: str, unit: str, amount: int, note: str
    ) -> str:
        entry: dict[str, Any] = {
            "id": new_id("led"),
            "idempotency_key": key,
            "org_id": org_id,
            "kind": kind,
            "unit": unit,
            "amount": amount,
            "reservation_id": None,
            "usage_id": None,
            "note": note[:255] or None,
            "created_at": self.store.clock(),
        }
        existing = await self.store.post_balance_entry(entry)
        if existing is not None:
            if (existing.org_id, existing.kind, existing.amount) != (org_id, kind, amount):
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
        found = await self.store.account(org_id, provision=False)
        if found is None:
            return None
        account, plan = found
        rows, held = await self.store.recent_entries(org_id, entries)
        today = self.store.clock().date().isoformat()
        return {
            "organization_id": account.org_id,
            "plan": _plan_view(plan),
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
            "runs_today": account.runs_today if account.quota_day == today else 0,
            "held_reservations": held,
            "recent_ledger_entries": [_entry_view(e) for e in rows],
        }


def _plan_view(plan: PlanTerms) -> dict[str, Any]:
    return {
        "name": plan.name,
        "monthly_run_credits": plan.monthly_run_credits,
        "max_runs_per_day": plan.max_runs_per_day,
        "rate_limits": plan.rate_limits,
        "wallet_overage": plan.wallet_overage,
        "wallet_price_minor": plan.wallet_price_minor,
    }


def _entry_view(e: LedgerEntry) -> dict[str, Any]:
    return {
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
