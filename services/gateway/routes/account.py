"""The SDK's `system.health` and `auth.me` routes.

GET /system/health -> {status, service, version}: open (no key), no database call; `status` is
    `degraded` while the readiness probe fails (still 200: /readyz is the orchestrators' probe).
    HEAD answers the same 200 without a body (uptime monitors send HEAD). Its OpenAPI entry
    declares only the 200 it answers: no key, no body, so none of the other routes' errors.
GET /auth/me -> the caller's profile; GET /auth/me/organizations?role= -> its organizations.
    Any member (owner, admin, member) may call them; X-Organization-ID is optional: with it the
    answer gives the role there (403 when not a member), without it `role` is null. A key bound
    to one organization sees only that organization.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from services.common.readiness import Readiness
from services.gateway import accounts
from services.gateway.account_schemas import (
    OrganizationMembership,
    SystemHealth,
    UserOrganizations,
    UserProfile,
)
from services.gateway.context import context_of
from services.gateway.identity import Principal
from services.gateway.openapi import error_responses, keyed

SERVICE = "loopline"

router = APIRouter()


@router.get(
    "/system/health",
    summary="Whether the service is up (no key needed)",
    tags=["system"],
    response_model=SystemHealth,
)
@router.head("/system/health", include_in_schema=False)
async def system_health(request: Request) -> JSONResponse:
    """`ok`, or `degraded` while the last readiness probe failed; read from memory only."""
    readiness: Readiness | None = getattr(request.app.state, "readiness", None)
    answer: SystemHealth = {
        "status": "ok" if readiness is None or readiness.ready else "degraded",
        "service": SERVICE,
        "version": request.app.version,
    }
    return JSONResponse(answer, headers={"Cache-Control": "no-store"})


@router.get(
    "/auth/me",
    summary="The caller's profile",
    tags=["auth"],
    response_model=UserProfile,
    responses=error_responses(),
    openapi_extra=keyed(organization_optional=True),
)
async def me(request: Request) -> JSONResponse:
    context = context_of(request)
    who = await context.member(request)
    email, joined = await accounts.profile(
        context.authenticator.sessions, who.user_id, who.key_organization_id
    )
    answer: UserProfile = {
        "id": who.user_id,
        "email": email,
        "username": None,
        "role": who.role or None,
        "is_active": True,
        "organization_ids": [org.id for org in joined],
        "primary_organization_id": accounts.primary(
            joined, who.organization_id, who.key_organization_id
        ),
    }
    return JSONResponse(answer)


Role = Literal["owner", "admin", "member"]


@router.get(
    "/auth/me/organizations",
    summary="The caller's organizations, oldest first",
    tags=["auth"],
    response_model=UserOrganizations,
    responses=error_responses(),
    openapi_extra=keyed(organization_optional=True),
)
async def my_organizations(
    request: Request, role: Annotated[Role | None, Query()] = None
) -> JSONResponse:
    """`is_default` marks the profile's primary organization; `role` keeps only those where
    the user has that role."""
    context = context_of(request)
    who: Principal = await context.member(request)
    _, joined = await accounts.profile(
        context.authenticator.sessions, who.user_id, who.key_organization_id
    )
    default = accounts.primary(joined, who.organization_id, who.key_organization_id)
    organizations: list[OrganizationMembership] = [
        {
            "id": org.id,
            "name": org.name,
            "slug": None,
            "domain": None,
            "role": org.role,
            "joined_at": None,
            "is_default": org.id == default,
        }
        for org in joined
        if role is None or org.role == role
    ]
    answer: UserOrganizations = {
        "success": True,
        "user_id": who.user_id,
        "organizations": organizations,
        "total": len(organizations),
    }
    return JSONResponse(answer)
