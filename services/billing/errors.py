"""The errors billing answers besides its rows: refused admissions, unknown reservations, bad input.

Every one is an `RpcError` in domain `billing.loopline.dev`; the servicer's one wrapper turns it
into a rich gRPC status.
"""

from __future__ import annotations

import grpc

from loopline.billing.v1 import billing_pb2
from services.billing.rates import RateDecision
from services.common.errors import BILLING_DOMAIN, RpcError

#: Denial codes (Denial.code); the ErrorInfo reason is the same in UPPER_SNAKE.
RATE_LIMITED = "rate_limited"
QUOTA_EXCEEDED = "quota_exceeded"
CREDIT_PLAN_EXHAUSTED = "credit_plan_exhausted"
WALLET_INSUFFICIENT_FUNDS = "wallet_insufficient_funds"


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


def invalid(reason: str, message: str) -> RpcError:
    """INVALID_ARGUMENT with `reason` (UPPER_SNAKE)."""
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, reason, message, domain=BILLING_DOMAIN)
