"""The SDK's `system.health` and `auth.me` routes against the gateway (issue 30), through the
official SDK and, for the refusals, raw HTTP.

Rules: the health answers without a key and says `degraded` while readiness fails; `auth.me`
and `auth.organizations` take any member role, X-Organization-ID optional (with it: the role
there, 403 for no membership; without it: role null, the primary organization the oldest owned);
a key bound to one organization sees only that one; authentication failures are counted as on
every route.
"""

from __future__ import annotations

import types
from collections.abc import AsyncIterator

import httpx
import pytest
from modulex import Modulex

from services.gateway.identity import NOT_A_MEMBER
from services.gateway.models import Membership, Organization
from tests.conftest import Stack, start_stack, stop_stack
from tests.gateway.test_rate_limits import (
    _clear_of_the_minute_boundary as clear_of_the_minute_boundary,
)


def sdk(stack: Stack, api_key: str | None = None, org_id: str | None = "") -> Modulex:
    """The SDK as the stack's owner (or `api_key`), in the stack's organization, in `org_id`,
    or (None) without X-Organization-ID."""
    return Modulex(
        api_key=api_key or stack.api_key,
        organization_id=stack.org_id if org_id == "" else org_id,
        base_url=stack.base_url,
    )


async def join(stack: Stack, user_id: str, org_id: str, role: str, name: str = "") -> None:
    """Make `user_id` a member of `org_id` (created when missing) with `role`."""
    async with stack.gateway.sessions() as session, session.begin():
        if await session.get(Organization, org_id) is None:
            session.add(Organization(id=org_id, name=name or org_id))
            await session.flush()
        session.add(Membership(organization_id=org_id, user_id=user_id, role=role))


async def test_system_health_answers_without_a_key(services):
    async with httpx.AsyncClient(base_url=services.base_url) as client:
        response = await client.get("/system/health")
    assert response.status_code == 200
    assert response.json() == {
        "status": "ok",
        "service": "loopline",
        "version": services.gateway.app.version,
    }
    async with sdk(services) as client:
        health = await client.system.health()
    assert (health.status, health.service) == ("ok", "loopline")


async def test_system_health_is_degraded_but_200_while_readiness_fails(services):
    app = services.gateway.app
    real = app.state.readiness
    app.state.readiness = types.SimpleNamespace(ready=False, failing=("database",))
    try:
        async with httpx.AsyncClient(base_url=services.base_url) as client:
            health = await client.get("/system/health")
            ready = await client.get("/readyz")
    finally:
        app.state.readiness = real
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    assert ready.status_code == 503  # the orchestrators' probe says it


@pytest.mark.parametrize("path", ["/system/health", "/healthz", "/readyz"])
async def test_the_health_routes_answer_head_with_200_and_no_body(services, path):
    """Uptime monitors send HEAD."""
    async with httpx.AsyncClient(base_url=services.base_url) as client:
        response = await client.head(path)
    assert response.status_code == 200 and response.content == b""


async def test_the_system_health_operation_declares_only_the_200_it_answers(services):
    async with httpx.AsyncClient(base_url=services.base_url) as client:
        document = (await client.get("/openapi.json")).json()
    operation = document["paths"]["/system/health"]
    assert set(operation) == {"get"}  # HEAD is served, not documented as its own operation
    assert set(operation["get"]["responses"]) == {"200"}
    assert not operation["get"].get("security")


async def test_auth_me_gives_the_owners_profile_with_the_role_in_the_header_organization(services):
    async with sdk(services) as client:
        me = await client.auth.me()
    assert me.id == services.user_id and me.role == "owner" and me.is_active
    assert me.email and me.email.endswith("@example.test") and me.username is None
    assert me.organization_ids == [services.org_id]
    assert me.primary_organization_id == services.org_id


async def test_auth_me_without_the_organization_header_has_no_role_and_the_oldest_owned_primary(
    services,
):
    member = await services.member("member")  # a member of the stack's organization (older)
    await join(services, member["user_id"], "org_owned_later", "owner")
    await join(services, member["user_id"], "org_admin_last", "admin")
    async with sdk(services, member["api_key"], org_id=None) as client:
        me = await client.auth.me()
        organizations = await client.auth.organizations()
    assert me.role is None
    assert me.organization_ids == [services.org_id, "org_owned_later", "org_admin_last"]
    assert me.primary_organization_id == "org_owned_later"
    assert [(o.id, o.role, o.is_default) for o in organizations.organizations] == [
        (services.org_id, "member", False),
        ("org_owned_later", "owner", True),
        ("org_admin_last", "admin", False),
    ]
    assert organizations.total == 3 and organizations.user_id == member["user_id"]


async def test_auth_me_takes_the_member_role_and_names_the_header_organization_primary(services):
    member = await services.member("member")
    await join(services, member["user_id"], "org_owned", "owner")
    async with sdk(services, member["api_key"]) as client:
        me = await client.auth.me()
        owned = await client.auth.organizations(role="owner")
    assert me.role == "member" and me.primary_organization_id == services.org_id
    assert [(o.id, o.is_default) for o in owned.organizations] == [("org_owned", False)]
    assert owned.total == 1


async def test_auth_me_in_an_organization_without_membership_is_403(services):
    async with httpx.AsyncClient(base_url=services.base_url) as client:
        response = await client.get(
            "/auth/me", headers=services.headers(org_id="org_not_mine_at_all")
        )
    assert response.status_code == 403 and response.json() == {"detail": NOT_A_MEMBER}


OWNER = "owner's key"


@pytest.mark.parametrize(
    ("authorization", "organization", "status"),
    [
        (None, "stack", 401),
        ("Bearer mx_live_unknown_key_0000000000", "stack", 401),
        ("Basic abc", None, 401),
        (OWNER, "org with spaces", 400),
    ],
)
async def test_auth_me_refuses_a_missing_or_unknown_key_401_and_a_malformed_organization_400(
    services, authorization, organization, status
):
    headers = {}
    if authorization is not None:
        headers["Authorization"] = (
            f"Bearer {services.api_key}" if authorization == OWNER else authorization
        )
    if organization is not None:
        headers["X-Organization-ID"] = services.org_id if organization == "stack" else organization
    async with httpx.AsyncClient(base_url=services.base_url) as client:
        response = await client.get("/auth/me", headers=headers)
    assert response.status_code == status, response.text
    assert set(response.json()) == {"detail"}


async def test_auth_me_organizations_with_an_unknown_role_is_400(services):
    async with services.client() as client:
        response = await client.get("/auth/me/organizations", params={"role": "viewer"})
    assert response.status_code == 400 and response.json()["detail"].startswith("role:")


async def test_a_key_bound_to_an_organization_sees_only_that_organization(services):
    await join(services, services.user_id, "org_second", "owner")
    async with sdk(services) as client:
        created = await client.api_keys.create("bound key")
    assert created.key is not None
    async with sdk(services, created.key, org_id=None) as client:
        me = await client.auth.me()
        organizations = await client.auth.organizations()
    assert me.organization_ids == [services.org_id]
    assert me.primary_organization_id == services.org_id
    assert [o.id for o in organizations.organizations] == [services.org_id]
    async with sdk(services) as client:  # the unbound CLI key sees both
        assert (await client.auth.me()).organization_ids == [services.org_id, "org_second"]


@pytest.fixture
async def few_failures(tmp_path) -> AsyncIterator[Stack]:
    """The four services allowing 2 failed authentications a client a minute."""
    running = await start_stack(tmp_path, gateway={"failed_auths_per_minute": 2})
    try:
        yield running
    finally:
        await stop_stack(running)


async def test_auth_me_failures_count_against_the_client_as_on_every_route(few_failures):
    await clear_of_the_minute_boundary()
    bad = {"Authorization": "Bearer mx_live_not_a_key_000000000000"}
    async with httpx.AsyncClient(base_url=few_failures.base_url) as client:
        failures = [(await client.get("/auth/me", headers=bad)).status_code for _ in range(3)]
        good = await client.get("/auth/me", headers=few_failures.headers())
    assert failures == [401, 401, 429]
    assert good.status_code == 429 and good.json()["key"] == "failed_authentication"
