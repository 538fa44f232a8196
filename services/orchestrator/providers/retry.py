"""Bounded retries of provider calls, and the sanitized failure message.

The rule, in one place:
- Retryable: a timeout (client side, or HTTP 408), a connection failure, HTTP 429, any
  HTTP 5xx (Anthropic's 529 "overloaded" included), and a stream that ended before its
  last event — but only while no text or tool call of that attempt has reached the
  client (`emitted`): a retry after a visible chunk would repeat it.
- At most `max_retries` retries (so `max_retries + 1` attempts). The delay before retry
  n (1-based) is `base_delay_s * 2**(n-1)`, capped at `max_delay_s`; when the provider
  sent `Retry-After` (seconds or an HTTP date) or `retry-after-ms`, the delay is at least
  that. A `Retry-After` longer than `max_delay_s` is not waited for: the call fails at once.
- Everything else (400, 401, 403, 404, 422, a malformed response, ...) fails at once.
- A failure raises `ModelError` whose message (and `public` text) names the provider and the
  kind of failure only (e.g. "openai: rate limited (429) after 3 attempts"): the kinds are
  `classify`'s closed set (the HTTP status a number); the provider's own error text, the key
  and the URL never appear in it.
- The SDKs' own retries are turned off (`max_retries=0`) so that this is the only rule.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from services.orchestrator.providers.base import ModelError, TokenUsage, add_usage

log = logging.getLogger(__name__)

T = TypeVar("T")


class IncompleteStream(Exception):
    """The provider's stream ended before its final event (no `[DONE]` / `message_stop`)."""


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry a failed provider call.

    Attributes:
        max_retries: retries after the first attempt (0 = no retry).
        base_delay_s: delay before the first retry, in seconds; doubled for each next one.
        max_delay_s: cap of one delay, in seconds; a longer `Retry-After` is not waited for.
    """

    max_retries: int = 2
    base_delay_s: float = 0.5
    max_delay_s: float = 30.0

    def delay(self, retry: int, retry_after: float | None) -> float:
        """Seconds to wait before retry number `retry` (1-based), honoring `retry_after`."""
        backoff = min(self.max_delay_s, self.base_delay_s * (2 ** max(0, retry - 1)))
        return max(backoff, retry_after or 0.0)


@dataclass(frozen=True)
class Failure:
    """A classified provider failure: a short `kind` safe to show, whether to retry, and
    Retry-After (s)."""

    kind: str
    retryable: bool
    retry_after: float | None = None


def parse_retry_after(headers: Any) -> float | None:
    """Seconds from `retry-after-ms` or `Retry-After` (delta seconds or an HTTP date); None
    when absent or invalid."""
    if headers is None:
        return None
    try:
        millis = headers.get("retry-after-ms")
        if millis is not None:
            return max(0.0, float(millis) / 1000)
    except (TypeError, ValueError):
        pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except (TypeError, ValueError):
        pass
    try:
        moment = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if moment is None:
        return None
    return max(0.0, moment.timestamp() - time.time())


_STATUS_KINDS = {
    400: "request rejected (400)",
    401: "authentication failed (401)",
    402: "payment required (402)",
    403: "permission denied (403)",
    404: "model or endpoint not found (404)",
    408: "timed out (408)",
    409: "conflict (409)",
    413: "request too large (413)",
    422: "request rejected (422)",
    429: "rate limited (429)",
}


_RETRYABLE_STREAM_ERRORS = frozenset(
    {"overloaded_error", "api_error", "server_error", "rate_limit_error", "timeout_error"}
)
_STREAM_ERROR_TYPES = _RETRYABLE_STREAM_ERRORS | {
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "billing_error",
}


def classify(error: BaseException) -> Failure:
    """Classify an exception of the `openai` or `anthropic` SDK (or of a provider's stream reader).

    Works on both SDKs by duck typing: an HTTP status error has `status_code` and
    `response.headers`; connection and timeout errors are recognized by the innermost
    `__cause__` (a socket error, a timeout, aiohttp's connection or parser error) and by class
    name (`APITimeoutError`, `APIConnectionError`) and the asyncio/httpx timeout types.
    """
    if isinstance(error, IncompleteStream):
        return Failure("stream ended early", True)
    # what the socket said, under the SDK's and the HTTP library's wrappers: the aiohttp
    # transport wraps a refused or dropped connection in a timeout class, and lets aiohttp's
    # parser error for an answer that is no HTTP response (`HttpProcessingError`) through to
    # the openai SDK's caller unwrapped; httpx called that a protocol error
    root = error
    while root.__cause__ is not None:
        root = root.__cause__
    if isinstance(root, (asyncio.TimeoutError, TimeoutError)):
        return Failure("timed out", True)
    root_names = _class_names(root)
    if (
        isinstance(root, OSError)
        or "ClientConnectionError" in root_names
        or "HttpProcessingError" in root_names
    ):
        return Failure("connection failed", True)
    names = _class_names(error)
    status = getattr(error, "status_code", None)
    if "APITimeoutError" in names or "TimeoutException" in names:
        return Failure("timed out", True)
    if "APIConnectionError" in names or "TransportError" in names or "RemoteProtocolError" in names:
        return Failure("connection failed", True)
    if "APIError" in names and (not isinstance(status, int) or status < 400):
        # an error event inside an accepted (200) stream, e.g. Anthropic's "overloaded_error"
        body = getattr(error, "body", None)
        detail = body.get("error", body) if isinstance(body, dict) else None
        error_type = detail.get("type") if isinstance(detail, dict) else None
        known = error_type if error_type in _STREAM_ERROR_TYPES else None
        return Failure(
            f"stream error ({known})" if known else "stream error",
            known in _RETRYABLE_STREAM_ERRORS,
        )
    if isinstance(status, int):
        response = getattr(error, "response", None)
        retry_after = parse_retry_after(getattr(response, "headers", None))
        if status == 429:
            return Failure(_STATUS_KINDS[429], True, retry_after)
        if status == 408:
            return Failure(_STATUS_KINDS[408], True, retry_after)
        if status == 529:
            return Failure("overloaded (529)", True, retry_after)
        if status >= 500:
            return Failure(f"server error ({status})", True, retry_after)
        if "APIResponseValidationError" in names:
            return Failure("malformed response", False)
        return Failure(_STATUS_KINDS.get(status, f"request failed ({status})"), False)
    return Failure("unexpected error", False)


def _class_names(error: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(error).__mro__}


_IDENTIFIER = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def provider_error_ids(error: BaseException) -> dict[str, str]:
    """The provider's own error `type` and `code` from an SDK error's body, for the log:
    `{"provider_error_type": "invalid_request_error", "provider_error_code": ...}`.

    Only values that are identifiers (letters, digits, `_.-`, at most 64) are kept, never the
    error's message, which may quote the request (the thread, a key); with them a 400 such as
    Anthropic's "tool_use blocks must define tools" can be told from any other 400 in the log."""
    body = getattr(error, "body", None)
    detail = body.get("error", body) if isinstance(body, dict) else None
    found: dict[str, str] = {}
    if isinstance(detail, dict):
        for key in ("type", "code"):
            value = detail.get(key)
            if isinstance(value, str) and _IDENTIFIER.fullmatch(value):
                found[f"provider_error_{key}"] = value
    return found


async def call_with_retries(
    provider_id: str,
    policy: RetryPolicy,
    attempt: Callable[[], Awaitable[T]],
    *,
    emitted: Callable[[], bool],
    usage: Callable[[], TokenUsage],
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
) -> T:
    """Run `attempt()` under `policy`; return its result or raise a sanitized ModelError.

    Args:
        provider_id: named in the error message (e.g. "openai").
        policy: the retry bounds.
        attempt: one provider call; raises on failure.
        emitted: whether anything of the current call reached the client (then no retry).
        usage: the tokens accrued so far over every attempt (carried on ModelError.usage).
        sleep: the wait between attempts (replaceable in tests).

    Raises:
        ModelError: after the last attempt, or at once for a non-retryable failure.
        asyncio.CancelledError: propagated unchanged (the attempt closes its own stream).
    """
    attempts = 0
    while True:
        attempts += 1
        try:
            return await attempt()
        except asyncio.CancelledError:
            raise
        except ModelError:
            raise
        except Exception as error:  # noqa: BLE001 - every provider failure is classified below
            failure = classify(error)
            log.warning(
                "model call failed",
                extra={
                    "fields": {
                        "provider": provider_id,
                        "kind": failure.kind,
                        "attempt": attempts,
                        "error_class": type(error).__name__,
                        **provider_error_ids(error),
                    }
                },
            )
            too_long = failure.retry_after is not None and failure.retry_after > policy.max_delay_s
            if (
                failure.retryable
                and attempts <= policy.max_retries
                and not emitted()
                and not too_long
            ):
                await sleep(policy.delay(attempts, failure.retry_after))
                continue
            suffix = f" after {attempts} attempts" if attempts > 1 else ""
            if too_long and failure.retryable:
                suffix += " (retry-after too long)"
            # built from the provider's id, a kind and counts only: safe to show
            text = f"{provider_id}: {failure.kind}{suffix}"
            raise ModelError(text, usage=usage(), public=text) from None


async def stream_with_retries(
    provider_id: str,
    policy: RetryPolicy,
    new_attempt: Callable[[], Any],
    stream_once: Callable[[Any], Awaitable[None]],
    total: TokenUsage,
    input_estimate: int,
) -> Any:
    """Run one streamed model call under the retry rule and return the attempt that succeeded.

    `new_attempt()` makes the per-attempt state (with `opened`, `emitted`, `cancelled` and
    `usage(input_estimate)`); `stream_once(state)` streams into it. A connection that
    breaks after the stream opened is an IncompleteStream (retried only while nothing was
    emitted). Every attempt's usage is added to `total`, also when it fails. Raises
    ModelError as `call_with_retries` does.
    """
    current = new_attempt()

    async def attempt() -> Any:
        nonlocal current
        current = new_attempt()
        try:
            await stream_once(current)
        except asyncio.CancelledError:
            current.cancelled = True  # a cut-off call's tokens are billed (spec: "or is cancelled")
            raise
        except Exception as error:
            if current.opened and classify(error).kind == "connection failed":
                raise IncompleteStream("the connection broke mid-stream") from error
            raise
        finally:
            add_usage(total, current.usage(input_estimate))
        return current

    return await call_with_retries(
        provider_id, policy, attempt, emitted=lambda: current.emitted, usage=lambda: total
    )
