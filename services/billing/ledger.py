"""The ledger: what a hold becomes (charged, released, expired) and what usage costs.

- Charge posts ledger entry "charge:{reservation_id}" at most once; ChargeBatch also charges a
  hold that expired meanwhile (the orchestrator stored the charge with its turn).
- Release and the expiry sweeper void a HELD reservation at most once.
- RecordUsage(Batch) is idempotent by (run_id, call_index) and posts "usage:{run_id}:{call_index}";
  RecordToolUsage by (run_id, tool_call_id), posting "tool:{run_id}:{tool_call_id}".

The writes are the store's (`BillingStore`); this module validates, prices, and turns the
store's facts into answers and errors.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any

import grpc

from loopline.billing.v1 import billing_pb2
from services.billing.errors import invalid, not_found
from services.billing.models import (
    CHARGED,
    EXPIRED,
    RELEASED,
    UNIT_MILLICREDIT,
    month_start,
    new_id,
)
from services.billing.pricing import PriceTable
from services.billing.store import LEFT, BillingStore, ChargeOutcome
from services.common import logging as loopline_logging
from services.common.errors import BILLING_DOMAIN, RpcError

log = logging.getLogger(__name__)

# Bounds of one usage call: a larger amount would overflow the organization's bigint sums.
MAX_TOKENS_PER_CALL = 10**9  # per token count of one model call (the orchestrator clamps too)
MAX_TOOL_MILLICREDITS = 10**12  # one tool call's cost (catalogue costs are hundreds)


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


def _usage_key_reused(key: str) -> RpcError:
    return RpcError(
        grpc.StatusCode.ALREADY_EXISTS,
        "USAGE_KEY_REUSED",
        f"this ({key}) was recorded for another organization",
        domain=BILLING_DOMAIN,
    )


class Ledger:
    """Charges, releases, expiry and usage over a store.

    Args:
        store: the billing store.
        prices: the token price table.
    """

    def __init__(self, store: BillingStore, prices: PriceTable) -> None:
        self.store = store
        self.prices = prices

    # ------------------------------------------------------------------ charge, release, expiry

    async def charge(self, reservation_id: str) -> ChargeResult:
        """Post a HELD reservation to the ledger, exactly once.

        Moves the hold into `allowance_used` (or debits the wallet) and appends ledger entry
        "charge:{reservation_id}" in one transaction. A second call returns the same entry
        (replayed=True). Raises RpcError NOT_FOUND for an unknown id, FAILED_PRECONDITION
        RESERVATION_RELEASED / RESERVATION_EXPIRED when the hold was voided.
        """
        if not reservation_id:
            raise invalid("RESERVATION_ID_REQUIRED", "reservation_id is required")
        charged = await self.store.charge(reservation_id)
        state = charged[0]
        if state != CHARGED:
            if state is None:
                raise not_found(reservation_id)
            raise RpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"RESERVATION_{state.upper()}",
                f"reservation {reservation_id} is {state} and cannot be charged",
                domain=BILLING_DOMAIN,
            )
        return self._charged(reservation_id, charged)

    async def charge_batch(self, reservation_ids: list[str]) -> list[ChargeResult | None]:
        """Charge several reservations, each as `charge`; results in order.

        These are the run charges the orchestrator stored with its turns, so an EXPIRED
        reservation is charged as well: its credits, given back when it expired, are taken
        from the allowance (which may end above the plan's) or the wallet as they stand, and
        the ledger note says so. A reservation that cannot be charged is answered in its place
        instead of failing the call: ChargeResult("released", "", False) for a released one,
        None for an unknown one. RpcError INVALID_ARGUMENT (nothing written) when an id is empty.
        """
        if not all(reservation_ids):
            raise invalid("RESERVATION_ID_REQUIRED", "reservation_id is required")
        found = await self.store.charge_batch(reservation_ids)
        results: list[ChargeResult | None] = []
        for reservation_id, charged in zip(reservation_ids, found, strict=True):
            state = charged[0]
            if state == CHARGED:
                results.append(self._charged(reservation_id, charged))
            else:
                results.append(ChargeResult(RELEASED, "", False) if state == RELEASED else None)
        return results

    @staticmethod
    def _charged(reservation_id: str, charged: ChargeOutcome) -> ChargeResult:
        state, entry_id, replayed, org_id = charged
        if not replayed and log.isEnabledFor(logging.DEBUG):
            with loopline_logging.bind(org_id=org_id):
                log.debug(
                    "charged",
                    extra={
                        "fields": {"reservation_id": reservation_id, "ledger_entry_id": entry_id}
                    },
                )
        return ChargeResult(CHARGED, entry_id, replayed)

    async def release(self, reservation_id: str, reason: str = "") -> str:
        """Void a HELD reservation at most once; returns the state after the call.

        Returns "released" (now or earlier), "charged" (no-op: a charged reservation is
        never voided) or "expired". Raises RpcError NOT_FOUND for an unknown id.
        """
        if not reservation_id:
            raise invalid("RESERVATION_ID_REQUIRED", "reservation_id is required")
        org_id, state = await self.store.void(reservation_id, RELEASED, reason[:255] or None)
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
        now = now or self.store.clock()
        expired = 0
        while True:
            ids = await self.store.overdue_holds(now, batch)
            if not ids:
                return expired
            for reservation_id in ids:
                org_id, _ = await self.store.void(reservation_id, EXPIRED, "hold expired")
                if org_id is not None:
                    expired += 1
            if len(ids) < batch:
                if expired:
                    log.info("expired holds", extra={"fields": {"count": expired}})
                return expired

    # ------------------------------------------------------------------ usage

    async def record_usage(self, request: billing_pb2.RecordUsageRequest) -> UsageResult:
        """Record one model call's token usage, idempotent by (run_id, call_index).

        Millicredits come from the price table (0 when `byok`); a non-zero amount is posted as
        ledger entry "usage:{run_id}:{call_index}" (unit millicredit) and added to the account's
        `usage_millicredits`, in the same transaction. Raises RpcError INVALID_ARGUMENT on
        missing ids or negative counts, ALREADY_EXISTS / USAGE_KEY_REUSED when the (run_id,
        call_index) belongs to another organization.
        """
        return (await self.record_usage_batch([request]))[0]

    async def record_usage_batch(
        self, requests: list[billing_pb2.RecordUsageRequest]
    ) -> list[UsageResult]:
        """Record several model calls' usage, each as `record_usage`; results in request order.

        Every request is validated first (RpcError INVALID_ARGUMENT before anything is written).
        An error fails the call (a USAGE_KEY_REUSED replay after the others were written); a
        retry replays what was recorded.
        """
        rows = [self._usage_rows(request) for request in requests]
        found = await self.store.record_usage(rows)
        answers = []
        for r, (record, ledger), existing in zip(requests, rows, found, strict=True):
            with loopline_logging.bind(
                org_id=r.organization_id, run_id=r.run_id, chat_id=r.chat_id
            ):
                if existing is LEFT:
                    existing = await self.store.record_usage_one(record, ledger)
                if existing is None:
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
                    answers.append(UsageResult(record["id"], record["millicredits"], False))
                elif existing.org_id != r.organization_id:
                    raise _usage_key_reused("run_id, call_index")
                else:
                    answers.append(UsageResult(existing.id, existing.millicredits, True))
        return answers

    def _usage_rows(
        self, r: billing_pb2.RecordUsageRequest
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """(usage record, ledger entry or None) of one RecordUsage request, validated and priced.

        Raises RpcError INVALID_ARGUMENT on missing ids, negative counts or counts past
        MAX_TOKENS_PER_CALL."""
        if not r.organization_id or not r.run_id:
            raise invalid("USAGE_KEY_REQUIRED", "organization_id and run_id are required")
        counts = (r.input_tokens, r.output_tokens, r.cache_read_tokens, r.cache_write_tokens)
        if r.call_index < 0 or min(counts) < 0:
            raise invalid("USAGE_NEGATIVE", "call_index and token counts must not be negative")
        if max(counts) > MAX_TOKENS_PER_CALL:
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
        now = self.store.clock()
        record = {
            "id": new_id("use"),
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
                "id": new_id("led"),
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

    async def record_tool_usage(
        self, request: billing_pb2.RecordToolUsageRequest
    ) -> tuple[str, bool]:
        """Charge one tool call's catalogue cost; idempotent by (run_id, tool_call_id).

        Posts ledger entry "tool:{run_id}:{tool_call_id}" (unit millicredit, kind tool_usage)
        and adds it to the account's `usage_millicredits` in the same transaction. Returns
        (ledger entry id, replayed); ("", False) for a zero cost. Raises RpcError
        INVALID_ARGUMENT on missing ids or a cost below 0 or past MAX_TOOL_MILLICREDITS,
        ALREADY_EXISTS / USAGE_KEY_REUSED when the key belongs to another organization.
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
            await self.store.ensure_account(r.organization_id)
            now = self.store.clock()
            entry: dict[str, Any] = {
                "id": new_id("led"),
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
            existing = await self.store.post_usage_entry(entry, month_start(now.date()))
            if existing is None:
                return entry["id"], False
            if existing.org_id != r.organization_id:
                raise _usage_key_reused("run_id, tool_call_id")
            return existing.id, True
