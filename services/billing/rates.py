"""Rate limits per (organization, rate class) with the `limits` library, moving window.

A moving window counts every hit of the last window length, so a burst across a window
boundary never passes more than the limit (issue 5). Counters live in `memory://` by
default (one process) or in Redis by URL (`redis://...`, shared by replicas).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from limits import RateLimitItem, parse
from limits.aio.strategies import MovingWindowRateLimiter
from limits.storage import storage_from_string


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


def _async_url(url: str) -> tuple[str, dict[str, str]]:
    # limits picks its asyncio storages by an "async+" scheme; the redis-py client is
    # the one installed (coredis is not), so select it explicitly.
    scheme = url.split("://", 1)[0]
    options: dict[str, str] = {}
    if scheme.startswith("redis") or scheme.startswith("rediss"):
        options["implementation"] = "redispy"
    return (url if url.startswith("async+") else f"async+{url}"), options


class RateLimiter:
    """Moving-window rate limiter keyed by (org_id, rate_class).

    `storage_url` is a `limits` URL: "memory://" or "redis://host:port/db" (the "async+"
    prefix is added). Identifiers are namespaced with `key_prefix` so tests can share
    a Redis without sharing counters.
    """

    def __init__(self, storage_url: str, key_prefix: str = "loopline-billing") -> None:
        url, options = _async_url(storage_url)
        self.storage = storage_from_string(url, **options)
        self.limiter = MovingWindowRateLimiter(self.storage)
        self.key_prefix = key_prefix
        self._items: dict[str, RateLimitItem] = {}

    def _item(self, expression: str) -> RateLimitItem:
        item = self._items.get(expression)
        if item is None:
            item = self._items[expression] = parse(expression)
        return item

    async def _state(self, item: RateLimitItem, keys: tuple[str, ...], allowed: bool) -> RateDecision:
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
        item = self._item(expression)
        keys = (self.key_prefix, org_id, rate_class)
        allowed = await self.limiter.hit(item, *keys)
        return await self._state(item, keys, allowed)

    async def peek(self, org_id: str, rate_class: str, expression: str | None) -> RateDecision:
        """The current window state without counting a request (used by replays)."""
        if not expression:
            return RateDecision(True, 0, 0, 0, 0)
        item = self._item(expression)
        return await self._state(item, (self.key_prefix, org_id, rate_class), True)

    async def close(self) -> None:
        """Stop the in-memory storage's expiry task (no-op for other storages)."""
        timer = getattr(self.storage, "timer", None)
        if timer is not None and not timer.done():
            timer.cancel()
