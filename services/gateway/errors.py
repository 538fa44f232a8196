"""The one error table: gRPC statuses and billing denials to HTTP responses.

Order (STYLE.md, after A2A's `utils/errors.py`): a billing denial (domain
billing.loopline.dev with a `Denial` detail) becomes the spec's flat DenialEnvelope
with the status of its layer (credit, wallet -> 402; quota -> 403; rate -> 429 with
Retry-After and X-RateLimit-*); then specific (domain, reason) pairs; then the plain
code table of DESIGN.md for statuses that carry an ErrorInfo (our services' own answers;
a status without one comes from gRPC itself). Anything else is 500 with a sanitized
`{"detail": ...}`.
"""

from __future__ import annotations

import logging
import math

import grpc
from fastapi.responses import JSONResponse

from loopline.billing.v1 import billing_pb2
from services.common import metrics
from services.common.errors import (
    ASSISTANT_DOMAIN,
    BILLING_DOMAIN,
    bounded,
    status_details,
    storage_failure,
)

log = logging.getLogger(__name__)


class BodyError(Exception):
    """A request the gateway refuses itself (a body that cannot be used, a saved default model
    that cannot); becomes `status` with `{"detail": message}`."""

    def __init__(self, status: int, message: str) -> None:
        message = bounded(message)  # it may quote the body (e.g. an unknown field's name)
        super().__init__(message)
        self.status = status
        self.message = message


DENIAL_STATUS = {"credit": 402, "wallet": 402, "quota": 403, "rate": 429}

REASON_STATUS = {
    (ASSISTANT_DOMAIN, "NO_ACTIVE_EXECUTION"): 400,
}

CODE_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

SAFE_MESSAGES = {
    503: "Service temporarily unavailable; try again",
    504: "The request timed out",
    500: "Internal server error",
}


def retry_after(seconds: float | None) -> str:
    """A `Retry-After` value: whole seconds, rounded up, at least 1 (1 when unknown)."""
    return str(max(1, math.ceil(seconds or 1)))


def rate_headers(state: billing_pb2.RateLimitState) -> dict[str, str]:
    """X-RateLimit-Limit/Remaining/Reset from a rate state; Reset is delta seconds (see README)."""
    if not state.limit:
        return {}
    return {
        "X-RateLimit-Limit": str(state.limit),
        "X-RateLimit-Remaining": str(max(0, state.remaining)),
        "X-RateLimit-Reset": str(max(0, state.reset_seconds)),
    }


def denial_response(denial: billing_pb2.Denial, retry_after_s: float | None) -> JSONResponse:
    """The spec's flat DenialEnvelope {code, layer, key, current, limit, reason} with its status."""
    body = {
        "code": denial.code,
        "layer": denial.layer,
        "key": denial.key if denial.HasField("key") else None,
        "current": denial.current if denial.HasField("current") else None,
        "limit": denial.limit if denial.HasField("limit") else None,
        "reason": denial.reason or denial.code,
    }
    status = DENIAL_STATUS.get(denial.layer, 402)
    headers: dict[str, str] = {}
    if denial.layer == "rate":
        seconds = (
            denial.retry_after_seconds if denial.HasField("retry_after_seconds") else retry_after_s
        )
        headers["Retry-After"] = retry_after(seconds)
        headers.update(rate_headers(denial.rate_limit))
        headers.setdefault("X-RateLimit-Remaining", "0")
    return JSONResponse(body, status_code=status, headers=headers)


def grpc_error_response(error: grpc.aio.AioRpcError) -> JSONResponse:
    """The HTTP response for a failed downstream call (see the module docstring for the order)."""
    parsed = status_details(error)
    if parsed.domain == BILLING_DOMAIN:
        denial = parsed.unpack(billing_pb2.Denial)
        if isinstance(denial, billing_pb2.Denial):
            return denial_response(denial, parsed.retry_after_s)
    status = REASON_STATUS.get((parsed.domain, parsed.reason)) or CODE_STATUS.get(parsed.code, 500)
    if status < 500 and not parsed.reason:
        # No ErrorInfo: not one of our services' answers but gRPC's own (e.g. RESOURCE_EXHAUSTED
        # "received metadata size exceeds hard limit" from this channel): its code says nothing
        # about the request and its text is not for clients.
        status = 500
    if status >= 500:
        log.warning(
            "downstream error",
            extra={"fields": {"code": parsed.code.name, "reason": parsed.reason}},
        )
        detail = SAFE_MESSAGES.get(status, SAFE_MESSAGES[500])
    else:
        detail = parsed.message or "Request failed"
    if status == 503:
        return unavailable_response(parsed.retry_after_s)
    headers = {}
    if status == 429 and parsed.retry_after_s:
        headers["Retry-After"] = retry_after(parsed.retry_after_s)
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


def detail(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """A `{"detail": message}` response."""
    return JSONResponse({"detail": message}, status_code=status, headers=headers)


def unavailable_response(retry_after_s: float | None = None) -> JSONResponse:
    """503 `{"detail": "Service temporarily unavailable; try again"}` with `Retry-After` (whole
    seconds, at least 1): every "down or busy, retry" answer of the gateway (README error table)."""
    return detail(503, SAFE_MESSAGES[503], {"Retry-After": retry_after(retry_after_s)})


def storage_error_response(error: Exception) -> JSONResponse | None:
    """The answer to a storage failure that is not a bug, as the gRPC services answer it
    (`errors.storage_failure`, through CODE_STATUS), logged as a warning: 503 `{"detail": ...}`
    with Retry-After when the database cannot be reached, answers nothing in time or takes no
    more connections, 409 when its transaction lost a race with another (deadlock,
    serialization failure: send it again), 400 when a value cannot be stored. None for any
    other error. The exception's own text is never shown to the client."""
    failure = storage_failure(error, ASSISTANT_DOMAIN)
    if failure is None:
        return None
    metrics.storage_error("gateway", error)
    message, answer = failure
    log.warning(message, extra={"fields": {"error": type(error).__name__}})
    status = CODE_STATUS[answer.code]
    return unavailable_response() if status == 503 else detail(status, answer.message)


def unexpected_error_response(error: Exception) -> JSONResponse:
    """The answer to an exception no route handled: `storage_error_response`'s for a storage
    failure, else 500 `{"detail": "Internal server error"}`, logged with its traceback."""
    response = storage_error_response(error)
    if response is None:
        log.error("unhandled error", exc_info=error)
        return detail(500, SAFE_MESSAGES[500])
    return response
