"""Rate limits per (organization, rate class), moving window.

A moving window counts every hit of the last window length, so a burst across a window
boundary never passes more than the limit. Limit expressions ("600/minute")
are parsed by the `limits` library. Counters live in process memory for `memory://`
(the default, one process: `MemoryWindows`, synchronous, so the admission transaction
can count the hit in the same worker call) or in Redis by URL (`redis://...`, shared by
replicas, through `limits`' asyncio Redis storage).
"""

from __future__ import annotations

import collections
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

from limits import RateLimitItem, parse
from limits.aio.strategies import MovingWindowRateLimiter
from limits.storage import storage_from_string

from services.common import db


@dataclass(frozen=True)
class RateDecision:
    """The outcome of a rate check.

    Attributes:
        allowed: True when the hit was counted within the limit.
        limit: requests allowed per window (0 when the class is not limited).
        remaining: requests left in the window after this decision.
        reset_seconds: whole seconds (delta, rounded up) until the window has room again.
        window_seconds: the window length in seconds.
    """

    allowed: bool
    limit: int
    remaining: int
    reset_seconds: int
    window_seconds: int


def _async_url(url: str, timeout_s: float = db.REDIS_TIMEOUT_S) -> tuple[str, dict[str, Any]]:
    """`limits`' asyncio storage URL for `url` ("async+" scheme) and the client's options.

    limits picks its asyncio storages by an "async+" scheme; the redis-py client is the one
    installed (coredis is not), so it is selected explicitly. The client takes the services'
    Redis options (`db.redis_client_options`): a reply waited for at most `timeout_s`, and a command
    retried on a connection error (3 quick retries, as the orchestrator's Redis client):
    without that, the first Admit on each pooled connection that Redis (or a proxy) closed
    while it was away would fail with 503 after Redis is back."""
    scheme = url.split("://", 1)[0]
    options: dict[str, Any] = {}
    if scheme.startswith("redis") or scheme.startswith("rediss"):
        options = {"implementation": "redispy", **db.redis_client_options(timeout_s)}
    return (url if url.startswith("async+") else f"async+{url}"), options


class MemoryWindows:
    """In-process moving windows: per key, the times of the hits of the last window.

    Same rule as `limits`' moving window: a hit is allowed when fewer than `limit` hits
    fall within the last `window_s` seconds (a hit at exactly now - window_s still counts);
    the window resets when its oldest counted hit leaves it. One deque per key, so a hit
    is O(1) amortized (`limits`' memory storage prepends to a list: O(hits in window)).
    Thread-safe (the admission worker thread hits, the event loop peeks).
    """

    def __init__(self) -> None:
        self._hits: dict[tuple[str, ...], collections.deque[float]] = {}
        self._lock = threading.Lock()

    def check(
        self, key: tuple[str, ...], limit: int, window_s: int, count: bool
    ) -> tuple[bool, int, float]:
        """Count one hit of `key` (when `count`) if the window has room.

        Returns (allowed, hits in the window after the call, reset time as a Unix
        timestamp = oldest counted hit + window_s, or now + window_s when empty).
        `allowed` is the room check; with `count` False nothing is recorded.
        """
        now = time.time()
        with self._lock:
            hits = self._hits.get(key)
            if hits is None:
                hits = self._hits[key] = collections.deque()
            cutoff = now - window_s
            while hits and hits[0] < cutoff:
                hits.popleft()
            allowed = len(hits) < limit
            if count and allowed:
                hits.append(now)
            used = len(hits)
            reset = (hits[0] if hits else now) + window_s
            if not hits:
                del self._hits[key]
        return allowed, used, reset


class RateLimiter:
    """Moving-window rate limiter keyed by (org_id, rate_class).

    `storage_url` is "memory://" (process memory, `MemoryWindows`; `synchronous` is True
    and `hit_now` may be called from any thread) or a `limits` Redis URL
    "redis://host:port/db" (the "async+" prefix is added). Identifiers are namespaced with
    `key_prefix` so tests can share a Redis without sharing counters. A Redis reply is waited
    for at most `timeout_s` seconds (then redis-py's TimeoutError: Admit answers
    UNAVAILABLE REDIS_UNAVAILABLE).
    """

    def __init__(
        self,
        storage_url: str,
        key_prefix: str = "loopline-billing",
        timeout_s: float = db.REDIS_TIMEOUT_S,
    ) -> None:
        self.key_prefix = key_prefix
        self._items: dict[str, RateLimitItem] = {}
        self.memory: MemoryWindows | None = None
        self.storage: Any = None
        if storage_url.split("://", 1)[0].removeprefix("async+") == "memory":
            self.memory = MemoryWindows()
        else:
            url, options = _async_url(storage_url, timeout_s)
            self.storage = storage_from_string(url, **options)
            self.limiter = MovingWindowRateLimiter(self.storage)

    @property
    def synchronous(self) -> bool:
        """True when counters are in process memory and `hit_now` is available."""
        return self.memory is not None

    def _memory_decision(
        self, org_id: str, rate_class: str, expression: str, count: bool
    ) -> RateDecision:
        assert self.memory is not None
        item = self._item(expression)
        window = item.get_expiry()
        allowed, used, reset_at = self.memory.check(
            (self.key_prefix, org_id, rate_class), item.amount, window, count
        )
        reset = max(0, math.ceil(reset_at - time.time()))
        if count and not allowed:
            reset = max(1, reset)
        return RateDecision(
            allowed or not count, item.amount, max(0, item.amount - used), reset, window
        )

    def hit_now(self, org_id: str, rate_class: str, expression: str | None) -> RateDecision:
        """`hit` for memory counters, synchronously (any thread). Raises RuntimeError for Redis."""
        if not expression:
            return RateDecision(True, 0, 0, 0, 0)
        if self.memory is None:
            raise RuntimeError("hit_now needs memory:// rate counters")
        return self._memory_decision(org_id, rate_class, expression, True)

    def _item(self, expression: str) -> RateLimitItem:
        item = self._items.get(expression)
        if item is None:
            item = self._items[expression] = parse(expression)
        return item

    async def _state(
        self, item: RateLimitItem, keys: tuple[str, ...], allowed: bool
    ) -> RateDecision:
        stats = await self.limiter.get_window_stats(item, *keys)
        reset = max(0, math.ceil(stats.reset_time - time.time()))
        if not allowed:
            reset = max(1, reset)
        return RateDecision(allowed, item.amount, max(0, stats.remaining), reset, item.get_expiry())

    async def hit(self, org_id: str, rate_class: str, expression: str | None) -> RateDecision:
        """Count one request of `org_id` in `rate_class` against `expression` ("600/minute").

        No expression means the class is not limited: always allowed, limit 0.
        """
        if not expression:
            return RateDecision(True, 0, 0, 0, 0)
        if self.memory is not None:
            return self._memory_decision(org_id, rate_class, expression, True)
        item = self._item(expression)
        keys = (self.key_prefix, org_id, rate_class)
        allowed = await self.limiter.hit(item, *keys)
        return await self._state(item, keys, allowed)

    async def peek(self, org_id: str, rate_class: str, expression: str | None) -> RateDecision:
        """The current window state without counting a request (used by replays)."""
        if not expression:
            return RateDecision(True, 0, 0, 0, 0)
        if self.memory is not None:
            return self._memory_decision(org_id, rate_class, expression, False)
        item = self._item(expression)
        return await self._state(item, (self.key_prefix, org_id, rate_class), True)

    async def close(self) -> None:
        """Stop a storage's expiry task, if it has one (no-op for memory and Redis)."""
        timer = getattr(self.storage, "timer", None)
        if timer is not None and not timer.done():
            timer.cancel()
