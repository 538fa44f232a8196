"""Request rate limits of the gateway: per API key, and per client for failed authentications.

Turn starts are also limited by billing (its `sync_exec` class, per organization); these
limits cover every route, credential reads, listings and wrong keys included:

- every authenticated request counts against its API key: past LOOPLINE_KEY_REQUESTS_PER_MINUTE
  (6,000) in a minute it is answered 429, or past the key's own `rate_limit_per_minute` (a key
  made by POST /api-keys) when that is lower;
- every failed authentication (401: no, a malformed, an unknown, a revoked or an expired key)
  counts against its client (its IP address; an IPv6 client's /64, which one host usually holds
  whole): past LOOPLINE_FAILED_AUTHS_PER_MINUTE (30) in a minute the client is answered 429 for
  every request, valid key or not, until that minute is over, without its key being looked up
  (so a client cannot try keys faster than that). A 403 (a valid key without the role, or bound
  to another organization) is not counted: it guesses nothing, and counting it would let one
  member's key lock out every client behind its address, owners included.

A refusal is billing's rate denial as the client knows it (README "Errors"): the flat denial
envelope `{code: "rate_limited", layer: "rate", key, current, limit, reason}` with 429,
`Retry-After` and `X-RateLimit-Limit/Remaining/Reset` (`errors.denial_response`, the same
function that renders billing's). `key` names the limit: `api_key` or `failed_authentication`.

Windows are fixed minutes. Counters live in process memory (the default: a dict per limit,
emptied when the minute turns, so one request costs one dict update; `limits`' own memory
storage starts a timer thread or task per hit) or, with LOOPLINE_GATEWAY_RATE_LIMIT_STORAGE_URL
or else LOOPLINE_REDIS_URL set, in Redis through the `limits` library (a fixed window shared by
every gateway replica; one INCR per request). A Redis that does not answer within
REDIS_TIMEOUT_S does not fail requests: they pass uncounted (a WARNING at most once a minute).
A client blocked for failed authentications is remembered by the replica that refused it.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import math
import time
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import Scope

from loopline.billing.v1 import billing_pb2
from services.common import metrics
from services.gateway.access_log import ORGANIZATION
from services.gateway.errors import denial_response
from services.gateway.identity import Authenticator, AuthError, Principal

log = logging.getLogger(__name__)

#: The rate denial's code (billing's, README "Errors").
RATE_LIMITED = "rate_limited"
#: The `key` of each limit's denial.
KEY_LIMIT = "api_key"
FAILED_AUTH_LIMIT = "failed_authentication"
#: The window of both limits, in seconds.
WINDOW_S = 60
#: The most identifiers one memory window holds (keys, or clients with failures); past it the
#: oldest entry of the window is forgotten (memory stays bounded whatever a client sends).
MAX_ENTRIES = 100_000
#: Seconds a Redis reply is waited for before a request passes uncounted.
REDIS_TIMEOUT_S = 0.5
#: The least seconds between two "counters unavailable" warnings.
WARN_EVERY_S = 60.0


class RateLimited(AuthError):
    """A request refused by a gateway rate limit: 429 with billing's rate denial envelope.

    An AuthError, so that every path that answers authentication failures answers this one
    (`app.auth_error_response` renders it with `response()`).
    """

    def __init__(self, key: str, limit: int, reset_s: int, reason: str) -> None:
        super().__init__(429, reason)
        self.key = key
        self.limit = limit
        self.reset_s = max(1, reset_s)

    def response(self) -> JSONResponse:
        """The flat denial envelope with 429, Retry-After and X-RateLimit-*."""
        denial = billing_pb2.Denial(
            code=RATE_LIMITED,
            layer="rate",
            key=self.key,
            current=self.limit,
            limit=self.limit,
            reason=self.detail,
            retry_after_seconds=self.reset_s,
        )
        denial.rate_limit.CopyFrom(
            billing_pb2.RateLimitState(limit=self.limit, remaining=0, reset_seconds=self.reset_s)
        )
        return denial_response(denial, self.reset_s)


class MemoryWindow:
    """Hits per identifier in the current fixed window of `window_s` seconds (process memory).

    Windows are aligned on multiples of `window_s` (Unix time); when one ends every count is
    dropped at once. At most `max_entries` identifiers are held (the oldest one is forgotten
    first). Used from the event loop's thread only.
    """

    def __init__(
        self, amount: int, window_s: int = WINDOW_S, max_entries: int = MAX_ENTRIES
    ) -> None:
        self.amount = amount
        self.window_s = window_s
        self.max_entries = max_entries
        self._index = -1
        self._counts: dict[str, int] = {}

    def _reset_s(self, now: float) -> int:
        return max(1, math.ceil((self._index + 1) * self.window_s - now))

    def hit(
        self, identifier: str, now: float | None = None, amount: int | None = None
    ) -> tuple[bool, int]:
        """Count one hit of `identifier` if the window has room for it (`amount` hits, else the
        window's): (allowed, seconds until the window ends)."""
        now = time.time() if now is None else now
        amount = self.amount if amount is None else amount
        index = int(now // self.window_s)
        if index != self._index:
            self._index = index
            self._counts.clear()
        counts = self._counts
        count = counts.get(identifier, 0)
        if count >= amount:
            return False, self._reset_s(now)
        if not count and len(counts) >= self.max_entries:
            del counts[next(iter(counts))]
        counts[identifier] = count + 1
        return True, 0


class RedisWindow:
    """The same fixed window, kept in Redis by `limits` (shared by every gateway replica); a
    window of another `amount` is a counter of its own there (`limits` keys by the amount)."""

    def __init__(self, limiter: Any, amount: int, prefix: str, name: str) -> None:
        self._limiter = limiter
        self._items: dict[int, Any] = {}
        self.amount = amount
        self._keys = (prefix, name)

    def _item(self, amount: int) -> Any:
        item = self._items.get(amount)
        if item is None:
            # imported only when Redis counters are configured
            from limits import RateLimitItemPerMinute  # noqa: PLC0415

            if len(self._items) >= 1_000:  # bounded, whatever limits the keys have
                self._items.clear()
            item = self._items[amount] = RateLimitItemPerMinute(amount)
        return item

    async def hit(self, identifier: str, amount: int | None = None) -> tuple[bool, int]:
        """Count one hit in Redis (`amount` a minute, else the window's): (allowed, seconds
        until the window has room again)."""
        item = self._item(self.amount if amount is None else amount)
        if await self._limiter.hit(item, *self._keys, identifier):
            return True, 0
        stats = await self._limiter.get_window_stats(item, *self._keys, identifier)
        return False, max(1, math.ceil(stats.reset_time - time.time()))


def effective_limit(deployment: int, own: int | None) -> int:
    """The requests a minute an API key may make: the deployment's
    (LOOPLINE_KEY_REQUESTS_PER_MINUTE; 0 = not limited), or the key's own
    `rate_limit_per_minute` when it has one that is lower."""
    if own is not None and own > 0 and (not deployment or own < deployment):
        return own
    return deployment


def client_of(scope: Scope) -> str:
    """The client a failed authentication is counted against: its IP address (an IPv6 address's
    /64 network), "" when the server does not know it."""
    client = scope.get("client")
    if not client:
        return ""
    host = str(client[0])
    if ":" in host:
        try:
            return str(ipaddress.IPv6Network((host.split("%", 1)[0], 64), strict=False))
        except ValueError:
            return host
    return host


def key_of(authorization: str) -> str:
    """The identifier an API key is counted by: a digest of the key as authentication reads it
    (never the key itself, which must not reach Redis)."""
    return hashlib.sha256(authorization[7:].strip().encode()).hexdigest()[:32]


def _storage_url(url: str) -> tuple[str, dict[str, Any]]:
    """`limits`' asyncio storage URL ("async+" scheme, the redis-py client) and its options (the
    services' Redis options with a short reply timeout: services/common/db.py)."""
    from services.common import db  # noqa: PLC0415

    options: dict[str, Any] = {}
    scheme = url.split("://", 1)[0].removeprefix("async+")
    if scheme.startswith("redis"):
        options = {"implementation": "redispy", **db.redis_client_options(REDIS_TIMEOUT_S)}
    return (url if url.startswith("async+") else f"async+{url}"), options


class RequestLimits:
    """The gateway's authentication with its rate limits (see the module docstring).

    Args:
        authenticator: resolves keys (identity.Authenticator).
        key_per_minute: requests per API key per minute (0: not limited); a key with a lower
            `rate_limit_per_minute` of its own gets that.
        failed_auth_per_minute: failed authentications per client per minute (0: not limited).
        storage_url: "memory://" (or "") for process memory, else a `limits` Redis URL.
        prefix: the Redis key prefix (LOOPLINE_REDIS_KEY_PREFIX), so deployments sharing a Redis
            do not share counters.
    """

    def __init__(
        self,
        authenticator: Authenticator,
        key_per_minute: int,
        failed_auth_per_minute: int,
        storage_url: str = "memory://",
        prefix: str = "loopline:",
    ) -> None:
        self.authenticator = authenticator
        self.storage: Any = None
        self._blocked: dict[str, float] = {}  # client -> time its failed-authentication window ends
        self._warned_at = -math.inf
        self.key_per_minute = key_per_minute
        # always there: a key's own limit applies when the deployment's is off (0) too
        if storage_url.split("://", 1)[0].removeprefix("async+") in ("", "memory"):
            self.keys: Any = MemoryWindow(key_per_minute)
            self.failures: Any = (
                MemoryWindow(failed_auth_per_minute) if failed_auth_per_minute else None
            )
            self._shared = False
        else:
            from limits.aio.strategies import FixedWindowRateLimiter  # noqa: PLC0415
            from limits.storage import storage_from_string  # noqa: PLC0415

            url, options = _storage_url(storage_url)
            self.storage = storage_from_string(url, **options)
            limiter = FixedWindowRateLimiter(self.storage)
            self.keys = RedisWindow(limiter, key_per_minute, f"{prefix}gateway", "key")
            self.failures = (
                RedisWindow(limiter, failed_auth_per_minute, f"{prefix}gateway", "auth-failure")
                if failed_auth_per_minute
                else None
            )
            self._shared = True

    async def authenticate(
        self,
        scope: Scope,
        authorization: str | None,
        organization_id: str | None,
        *,
        member: bool = False,
    ) -> Principal:
        """`Authenticator.authenticate` (with `member`: `Authenticator.identify`, for a route any
        member may call with an optional organization) under the limits: raises RateLimited (429)
        when the client is blocked for failed authentications or the key is past its limit,
        AuthError as the authenticator does (each 401 counted against the client; a 403 is a
        known key's refusal, not a guess, and is not counted)."""
        if self._blocked:
            client = client_of(scope)
            until = self._blocked.get(client)
            if until is not None:
                now = time.time()
                if now < until:
                    raise self._failures_refusal(math.ceil(until - now))
                del self._blocked[client]
        try:
            if member:
                who = await self.authenticator.identify(authorization, organization_id)
            else:
                who = await self.authenticator.authenticate(authorization, organization_id)
        except AuthError as error:
            if error.status == 401 and self.failures is not None:
                await self._failed(client_of(scope))
            raise
        scope[ORGANIZATION] = who.organization_id  # for the access line (access_log.py)
        limit = effective_limit(self.key_per_minute, who.rate_limit_per_minute)
        if limit:
            allowed, reset_s = await self._hit(self.keys, key_of(authorization or ""), limit)
            if not allowed:
                raise RateLimited(
                    KEY_LIMIT,
                    limit,
                    reset_s,
                    f"rate limit of {limit} requests per minute exceeded for this"
                    f" API key; retry in {reset_s} s",
                )
        return who

    async def _failed(self, client: str) -> None:
        """Count a failed authentication of `client`; RateLimited (and the client blocked until its
        window ends) when it is one too many."""
        allowed, reset_s = await self._hit(self.failures, client)
        if not allowed:
            if len(self._blocked) >= MAX_ENTRIES:
                del self._blocked[next(iter(self._blocked))]
            self._blocked[client] = time.time() + reset_s
            log.warning(
                "client blocked for failed authentications",
                extra={
                    "fields": {
                        "client": client,
                        "limit_per_minute": self.failures.amount,
                        "retry_after_s": reset_s,
                    }
                },
            )
            raise self._failures_refusal(reset_s)

    def _failures_refusal(self, reset_s: int) -> RateLimited:
        amount = self.failures.amount
        return RateLimited(
            FAILED_AUTH_LIMIT,
            amount,
            reset_s,
            f"too many failed authentications from this client (limit {amount} per minute);"
            f" retry in {max(1, reset_s)} s",
        )

    async def _hit(
        self, window: Any, identifier: str, amount: int | None = None
    ) -> tuple[bool, int]:
        if not self._shared:
            return window.hit(identifier, amount=amount)
        try:
            return await window.hit(identifier, amount)
        # counters that cannot be reached never fail a request
        except Exception as error:  # noqa: BLE001
            metrics.storage_error("gateway", error)
            now = time.monotonic()
            if now - self._warned_at >= WARN_EVERY_S:
                self._warned_at = now
                log.warning(
                    "rate-limit counters unavailable; requests pass uncounted",
                    extra={"fields": {"error": type(error).__name__}},
                )
            return True, 0

    async def close(self) -> None:
        """Close the Redis storage's connections, if any."""
        storage, self.storage = self.storage, None
        # limits' redis-py client
        client = getattr(getattr(storage, "bridge", None), "storage", None)
        closer = getattr(client, "aclose", None)
        if closer is not None:
            try:
                await closer()
            except Exception:  # noqa: BLE001 - a close at shutdown that fails changes nothing
                pass
