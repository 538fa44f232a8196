"""The per-process cache of what tool calls read about an organization's credentials."""

from __future__ import annotations

import time
from typing import Any

from cachetools import TTLCache

#: What `OrgReadCache.get` returns for a key it does not hold (None is a value it may hold).
MISS = object()


class OrgReadCache:
    """What tool calls read about an organization's credentials on every turn, per process.

    Holds, per organization, the results of `connected_integrations` and `of_auth_type`
    (metadata and MCP discovery only; never a secret) for at most `ttl_s` seconds, for
    at most `max_orgs` organizations (least recently used dropped first).

    Correctness rule: every credential write made through this process (create, delete,
    set default, MCP discovery) drops the organization's entry when it commits, and a
    read that overlapped any write is not stored (a global write generation), so this
    process never serves data older than its own last write. A write made by another
    replica is seen after at most `ttl_s` (LOOPLINE_TOOLS_CREDENTIAL_CACHE_TTL_S);
    `ttl_s <= 0` turns the cache off.
    """

    def __init__(self, ttl_s: float, max_orgs: int = 4096) -> None:
        self.ttl_s = ttl_s
        self.max_orgs = max_orgs
        self.generation = 0
        self._entries: TTLCache[str, dict[Any, Any]] = TTLCache(
            max_orgs, max(ttl_s, 0.0), timer=time.monotonic
        )

    def get(self, org_id: str, key: Any) -> Any:
        """The cached value of (`org_id`, `key`), or `MISS` when absent or expired."""
        entry = self._entries.get(org_id)
        return MISS if entry is None else entry.get(key, MISS)

    def put(self, org_id: str, key: Any, value: Any, generation: int) -> None:
        """Store `value` unless caching is off or a write happened since `generation` was read."""
        if self.ttl_s <= 0 or generation != self.generation:
            return
        entry = self._entries.get(org_id)
        if entry is None:  # the organization's values expire together, `ttl_s` after the first
            entry = self._entries[org_id] = {}
        entry[key] = value

    def invalidate(self, org_id: str) -> None:
        """Forget the organization's entry and make reads that overlapped this write unstorable."""
        self.generation += 1
        self._entries.pop(org_id, None)
