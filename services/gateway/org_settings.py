"""Organization settings: the saved default model (the SDK's `organizations.get_settings` and
`set_composer_llm`; DESIGN.md "Models": an omitted `llm` uses the organization's saved default).

GET /organizations/settings -> {llm_model_visibility: {}, composer_llm: {...} | null}
PUT /organizations/settings/composer-llm {integration_name, provider_id, model_id, credential_id?}
DELETE /organizations/settings/composer-llm (back to the deployment's default model)
    -> {composer_llm: {...}}; owner or admin only.

Saving a default (check, then write) and deleting a credential (check the default, then delete)
hold the organization's default-model lock, `DefaultModels.exclusive`, so that they never
interleave (see there).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from cachetools import TTLCache
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import select, update

from services.gateway.models import Organization
from services.gateway.openapi import error_responses

_MISS = object()


class DefaultModels:
    """Reads and writes organizations' default `llm`, caching reads for `ttl_s` seconds.

    A write through this process is visible to it at once; other gateway replicas see it
    within `ttl_s`. At most `max_entries` organizations are cached (least recently used
    evicted first).
    """

    def __init__(self, sessions, ttl_s: float = 30.0, max_entries: int = 10_000) -> None:  # noqa: ANN001
        self.sessions = sessions
        self.ttl_s = ttl_s
        self._cache: TTLCache[str, dict[str, Any] | None] = TTLCache(
            max_entries, ttl_s, timer=time.monotonic
        )
        # one lock per organization while someone holds or waits for it (weak: no growth per organization)
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    async def get(self, organization_id: str) -> dict[str, Any] | None:
        """The organization's saved default {integration_name, provider_id, model_id, credential_id?} or None."""
        cached = self._cache.get(organization_id, _MISS)
        if cached is not _MISS:
            return cached
        value = await self.read(organization_id)
        self._cache[organization_id] = value
        return value

    async def read(self, organization_id: str) -> dict[str, Any] | None:
        """`get` from the database, never from the cache (a check another replica's write must not miss)."""
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
        naming credential X and a DELETE of X both succeeded and left a default whose key was gone
        (tests/gateway/test_default_model_race.py). Both routes run check and write inside this block.

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
                    if session.bind.dialect.name == "postgresql":
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


def _shown(llm: dict[str, Any]) -> dict[str, Any]:
    """A saved default as GET and PUT both answer it: `credential_id` always present (null without one)."""
    return {**llm, "credential_id": llm.get("credential_id")}


def settings_router(
    models: DefaultModels,
    principal: Callable[[Request], Awaitable[Any]],
    parse_llm: Callable[[Any], Any],
    read_body: Callable[[Request], Awaitable[dict[str, Any]]],
    check_model: Callable[[Any, Any], Awaitable[Any]],
    refuse_body: Callable[[Request], Awaitable[None]],
) -> APIRouter:
    """The organization-settings routes; `parse_llm` validates an llm object's shape (BodyError 400) and
    `check_model(principal, llm)` asks the orchestrator whether it can serve it (grpc error → 400);
    `refuse_body` is the DELETE's check that it was sent no body (app.py `refuse_body`).

    The PUT checks and saves inside `models.exclusive` (a DELETE of the credential it names waits,
    then sees it as the default: 409; or it waits for that DELETE and its check fails: 400)."""
    router = APIRouter(responses=error_responses(413))

    @router.get(
        "/organizations/settings",
        summary="The organization's model preferences",
        tags=["organizations"],
    )
    async def get_settings(request: Request) -> JSONResponse:
        who = await principal(request)
        saved = await models.get(who.organization_id)
        return JSONResponse(
            {"llm_model_visibility": {}, "composer_llm": _shown(saved) if saved else None}
        )

    @router.put(
        "/organizations/settings/composer-llm",
        summary="Save the organization's default model (used when a turn names none)",
        tags=["organizations"],
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "properties": {
                                "integration_name": {
                                    "type": "string",
                                    "minLength": 1,
                                    "pattern": r"\S",
                                },
                                "provider_id": {"type": "string", "minLength": 1, "pattern": r"\S"},
                                "model_id": {"type": "string", "minLength": 1, "pattern": r"\S"},
                                "credential_id": {"type": ["string", "null"]},
                            },
                            "required": ["integration_name", "provider_id", "model_id"],
                            "additionalProperties": False,
                        }
                    }
                },
            }
        },
    )
    async def set_composer_llm(request: Request) -> JSONResponse:
        who = await principal(request)
        body = await read_body(request)
        parsed = parse_llm(body)
        llm = {
            "integration_name": parsed.integration_name,
            "provider_id": parsed.provider_id,
            "model_id": parsed.model_id,
        }
        if parsed.HasField("credential_id") and parsed.credential_id:
            llm["credential_id"] = parsed.credential_id
        async with models.exclusive(
            who.organization_id
        ) as held:  # no DELETE /credentials/{id} between check and save
            await check_model(
                who, parsed
            )  # an unusable default would break every turn that names no model
            await held.set(llm)
        return JSONResponse({"composer_llm": _shown(llm)})

    @router.delete(
        "/organizations/settings/composer-llm",
        summary="Clear the organization's saved default model (turns naming none use the deployment's again)",
        tags=["organizations"],
    )
    async def clear_composer_llm(request: Request) -> JSONResponse:
        """200 {"composer_llm": null}, also when none was saved (fresh-eyes test: there was no way
        back to "no saved default"; PUT of another model kept a saved choice). Under the same lock
        as PUT; the key of the model that was the default may be deleted afterwards."""
        who = await principal(request)
        await refuse_body(request)
        async with models.exclusive(who.organization_id) as held:
            await held.set(None)
        return JSONResponse({"composer_llm": None})

    return router
