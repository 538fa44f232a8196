"""Organization settings: the saved default model (the SDK's `organizations.get_settings` and
`set_composer_llm`; DESIGN.md "Models": an omitted `llm` uses the organization's saved default).

GET /organizations/settings -> {llm_model_visibility: {}, composer_llm: {...} | null}
PUT /organizations/settings/composer-llm {integration_name, provider_id, model_id, credential_id?}
    -> {composer_llm: {...}}; owner or admin only.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from cachetools import TTLCache
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import update

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
        self._cache: TTLCache[str, dict[str, Any] | None] = TTLCache(max_entries, ttl_s, timer=time.monotonic)

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
            await session.execute(update(Organization).where(Organization.id == organization_id).values(default_llm=llm))
        self._cache.pop(organization_id, None)


def _shown(llm: dict[str, Any]) -> dict[str, Any]:
    """A saved default as GET and PUT both answer it: `credential_id` always present (null without one)."""
    return {**llm, "credential_id": llm.get("credential_id")}


def settings_router(models: DefaultModels, principal: Callable[[Request], Awaitable[Any]],
                    parse_llm: Callable[[Any], Any], read_body: Callable[[Request], Awaitable[dict[str, Any]]],
                    check_model: Callable[[Any, Any], Awaitable[Any]]) -> APIRouter:
    """The organization-settings routes; `parse_llm` validates an llm object's shape (BodyError 400) and
    `check_model(principal, llm)` asks the orchestrator whether it can serve it (grpc error → 400)."""
    router = APIRouter(responses=error_responses(413))

    @router.get("/organizations/settings", summary="The organization's model preferences", tags=["organizations"])
    async def get_settings(request: Request) -> JSONResponse:
        who = await principal(request)
        saved = await models.get(who.organization_id)
        return JSONResponse({"llm_model_visibility": {}, "composer_llm": _shown(saved) if saved else None})

    @router.put(
        "/organizations/settings/composer-llm",
        summary="Save the organization's default model (used when a turn names none)",
        tags=["organizations"],
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {
                    "type": "object",
                    "properties": {
                        "integration_name": {"type": "string", "minLength": 1, "pattern": r"\S"},
                        "provider_id": {"type": "string", "minLength": 1, "pattern": r"\S"},
                        "model_id": {"type": "string", "minLength": 1, "pattern": r"\S"},
                        "credential_id": {"type": ["string", "null"]},
                    },
                    "required": ["integration_name", "provider_id", "model_id"],
                    "additionalProperties": False,
                }}},
            }
        },
    )
    async def set_composer_llm(request: Request) -> JSONResponse:
        who = await principal(request)
        body = await read_body(request)
        parsed = parse_llm(body)
        await check_model(who, parsed)  # an unusable default would break every turn that names no model
        llm = {"integration_name": parsed.integration_name, "provider_id": parsed.provider_id, "model_id": parsed.model_id}
        if parsed.HasField("credential_id") and parsed.credential_id:
            llm["credential_id"] = parsed.credential_id
        await models.set(who.organization_id, llm)
        return JSONResponse({"composer_llm": _shown(llm)})

    return router
