"""Organizations' saved default model (DESIGN.md "Models": a turn that names no `llm` uses it).

`DefaultModels` reads and writes it (cached); `DefaultModels.exclusive` holds it while a PUT of
the default or a DELETE of a credential checks and writes, so the two never interleave.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import AsyncIterator
from typing import Any

from cachetools import TTLCache
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from services.gateway.models import Organization


class DefaultModels:
    """Reads and writes organizations' default `llm`, caching reads for `ttl_s` seconds.

    A write through this process is visible to it at once; other gateway replicas see it
    within `ttl_s`. At most `max_entries` organizations are cached (least recently used
    evicted first).
    """

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        ttl_s: float = 30.0,
        max_entries: int = 10_000,
    ) -> None:
        self.sessions = sessions
        self.ttl_s = ttl_s
        self._cache: TTLCache[str, dict[str, Any] | None] = TTLCache(
            max_entries, ttl_s, timer=time.monotonic
        )
        # one lock per organization while someone holds or waits for it (weak: no growth)
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    async def get(self, organization_id: str) -> dict[str, Any] | None:
        """The organization's saved default (integration_name, provider_id, model_id,
        credential_id?) or None."""
        try:
            return self._cache[organization_id]
        except KeyError:  # not cached, or expired
            pass
        value = await self.read(organization_id)
        self._cache[organization_id] = value
        return value

    async def read(self, organization_id: str) -> dict[str, Any] | None:
        """`get` from the database, never from the cache (for a check that another replica's
        write must not miss)."""
        async with self.sessions() as session:
            org = await session.get(Organization, organization_id)
            return dict(org.default_llm) if org is not None and org.default_llm else None

    async def exists(self, organization_id: str) -> bool:
        """Whether the organization exists (admin commands check before they write)."""
        async with self.sessions() as session:
            return await session.get(Organization, organization_id) is not None

    async def set(self, organization_id: str, llm: dict[str, Any] | None) -> None:
        """Save (or with None, clear) the organization's default model."""
        async with self.sessions() as session, session.begin():
            await session.execute(
                update(Organization)
                .where(Organization.id == organization_id)
                .values(default_llm=llm)
            )
        self._cache.pop(organization_id, None)

    @contextlib.asynccontextmanager
    async def exclusive(self, organization_id: str) -> AsyncIterator[HeldDefault]:
        """Hold the organization's default model: yields a `HeldDefault` (`saved`, read from the
        database under the lock; `set(llm)`), and no other `exclusive` of the same organization, in
        this gateway or any other sharing its PostgreSQL database, runs until the block exits.

        Why: saving a default checks its credential in the tools service, then writes here;
        deleting a credential checks the default here, then deletes in the tools service. Two
        databases, so neither write can check the other's in one statement: unserialized, a PUT
        naming credential X and a DELETE of X would both succeed and leave a default whose key is
        gone. Both routes run check and write inside this block.

        How, with the database's own locking rather than anything new:
        - every backend: an in-process `asyncio.Lock` per organization, taken first, so that the
          waiters of one process queue here instead of each holding a pooled connection;
        - PostgreSQL (several gateways may share the database): a transaction holding
          `SELECT ... FOR NO KEY UPDATE` on the organization's row until the block exits
          (`set` writes in that transaction, committed at exit, rolled back if the block raises).
          NO KEY UPDATE conflicts with itself and with UPDATE but not with the KEY SHARE locks that
          inserting a membership takes, so adding members is never held up;
        - SQLite (one file serves one gateway, so the in-process lock is the whole exclusion):
          no transaction is held across the block's awaits, which would stall every other write of
          the gateway (API keys' idempotency records, ...) behind a gRPC call; `saved` and `set` are
          short transactions of their own.
        The block should await only bounded calls (the routes' gRPC calls have deadlines): others
        of the organization wait for it. An organization with no row yields `saved` None, and `set`
        then changes nothing. The offline `set-default-llm` command takes no lock (it checks no
        credential either). Raises what the database raises (e.g. the pool's timeout on PostgreSQL).
        """
        lock = self._locks.get(organization_id)
        if lock is None:
            lock = self._locks[organization_id] = asyncio.Lock()
        async with lock:
            try:
                async with self.sessions() as session:
                    bind = session.bind
                    if bind is not None and bind.dialect.name == "postgresql":
                        async with session.begin():
                            saved = await session.scalar(
                                select(Organization.default_llm)
                                .where(Organization.id == organization_id)
                                .with_for_update(key_share=True)
                            )
                            yield HeldDefault(
                                dict(saved) if saved else None, organization_id, session, self
                            )
                    else:
                        yield HeldDefault(
                            await self.read(organization_id), organization_id, None, self
                        )
            finally:
                self._cache.pop(
                    organization_id, None
                )  # after the commit: no read can cache the old value again


class HeldDefault:
    """An organization's default model while `DefaultModels.exclusive` holds it.

    Attributes:
        saved: the saved default {integration_name, provider_id, model_id, credential_id?} or None,
            read from the database (never the cache) after the lock was taken.
    """

    def __init__(
        self,
        saved: dict[str, Any] | None,
        organization_id: str,
        session: Any,
        models: DefaultModels,
    ) -> None:
        self.saved = saved
        self._organization_id = organization_id
        self._session = session
        self._models = models

    async def set(self, llm: dict[str, Any] | None) -> None:
        """Save (or with None, clear) the default: in the held transaction on PostgreSQL
        (committed when the `exclusive` block exits), at once on SQLite."""
        if self._session is None:
            await self._models.set(self._organization_id, llm)
        else:
            await self._session.execute(
                update(Organization)
                .where(Organization.id == self._organization_id)
                .values(default_llm=llm)
            )
        self.saved = dict(llm) if llm else None
