"""What an API key reaches through the `/api-keys` routes and `list-keys` (issue 30, found by a
new-user test).

Rules: a key made with a key that expires or has its own per-minute limit gets those as
ceilings (omitted: the maker's; later or higher: 400 naming the limit), keys without limits make
keys as before; a key bound to an organization lists, gets and revokes only the keys bound to
that organization, never its user's unbound keys; an admin cannot revoke an owner's key (403)
while an owner revokes any listed key and anyone their own; `list-keys --org X` shows each key's
organization and expiry and leaves out keys bound to another organization.
"""

from __future__ import annotations

import datetime

import httpx

from services.gateway import identity
from services.gateway.routes.api_keys import OWNERS_KEY
from tests.conftest import Stack
from tests.gateway.test_account_routes import join, sdk


def _in(seconds: float) -> str:
    moment = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=seconds)
    return moment.isoformat()


async def _call(
    stack: Stack, method: str, path: str, key: str, json: dict | None = None
) -> httpx.Response:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
        return await client.request(method, path, headers=stack.headers(api_key=key), json=json)


async def _create(stack: Stack, key: str, **body: object) -> httpx.Response:
    return await _call(stack, "POST", "/api-keys", key, {"name": "child", **body})


async def test_a_key_that_expires_makes_keys_that_expire_no_later_than_it(services):
    async with sdk(services) as client:
        parent = await client.api_keys.create("parent", expires_at=_in(3600))
    assert parent.key is not None and parent.expires_at is not None
    inherited = await _create(services, parent.key)  # expires_at omitted: the parent's
    assert inherited.status_code == 201, inherited.text
    assert inherited.json()["expires_at"] == parent.expires_at
    same = await _create(services, parent.key, expires_at=parent.expires_at)
    assert same.status_code == 201, same.text  # exactly the parent's expiry is allowed
    earlier = await _create(services, parent.key, expires_at=_in(1800))
    assert earlier.status_code == 201 and earlier.json()["expires_at"] < parent.expires_at
    later = await _create(services, parent.key, expires_at=_in(7200))
    assert later.status_code == 400
    assert later.json() == {
        "detail": f"expires_at must be no later than {parent.expires_at}, when the API key"
        " making this request expires"
    }


async def test_a_key_with_its_own_limit_makes_keys_no_faster_than_it(services):
    async with sdk(services) as client:
        parent = await client.api_keys.create("parent", rate_limit_per_minute=10)
    assert parent.key is not None
    inherited = await _create(services, parent.key)  # rate_limit_per_minute omitted: 10
    assert inherited.status_code == 201 and inherited.json()["rate_limit_per_minute"] == 10
    lower = await _create(services, parent.key, rate_limit_per_minute=5)
    assert lower.status_code == 201 and lower.json()["rate_limit_per_minute"] == 5
    higher = await _create(services, parent.key, rate_limit_per_minute=11)
    assert higher.status_code == 400
    assert higher.json() == {
        "detail": "rate_limit_per_minute must be at most 10, the limit of the API key making"
        " this request"
    }


async def test_a_key_without_limits_makes_keys_without_limits_as_before(services):
    made = await _create(services, services.api_key)  # the CLI's key: no expiry, no own limit
    assert made.status_code == 201, made.text
    assert made.json()["expires_at"] is None
    assert made.json()["rate_limit_per_minute"] == 6_000  # the deployment's
    later = await _create(services, services.api_key, expires_at=_in(10 * 365 * 86400))
    assert later.status_code == 201


async def test_a_bound_key_lists_gets_and_revokes_only_keys_bound_to_its_organization(services):
    async with sdk(services) as client:
        bound = await client.api_keys.create("bound")
        everything = await client.api_keys.list()
    assert bound.key is not None
    unbound_id = next(k.id for k in everything.keys if k.organization_id is None)
    async with sdk(services, bound.key) as client:
        listed = await client.api_keys.list(include_revoked=True)
    assert [k.organization_id for k in listed.keys] == [services.org_id]
    assert [k.id for k in listed.keys] == [bound.id]
    for method in ("GET", "DELETE"):
        refused = await _call(services, method, f"/api-keys/{unbound_id}", bound.key)
        assert refused.status_code == 404 and refused.json() == {"detail": "API key not found"}
    # the unbound key was not revoked, and its own caller still sees it
    assert (await _call(services, "GET", "/assistant/chats", services.api_key)).status_code == 200
    own = await _call(services, "GET", f"/api-keys/{unbound_id}", services.api_key)
    assert own.status_code == 200 and own.json()["revoked_at"] is None


async def test_an_admin_cannot_revoke_an_owners_key_but_its_own_and_other_admins(services):
    admin = await services.member("admin")
    other_admin = await services.member("admin")
    async with sdk(services) as client:
        owners = await client.api_keys.create("owner's bound key")
    async with sdk(services, admin["api_key"]) as client:
        admins = await client.api_keys.create("admin's bound key")
    async with sdk(services, other_admin["api_key"]) as client:
        other_admins = await client.api_keys.create("other admin's bound key")
    assert owners.key is not None
    refused = await _call(services, "DELETE", f"/api-keys/{owners.id}", admin["api_key"])
    assert refused.status_code == 403 and refused.json() == {"detail": OWNERS_KEY}
    assert (await _call(services, "GET", "/assistant/chats", owners.key)).status_code == 200
    for key_id in (admins.id, other_admins.id):
        revoked = await _call(services, "DELETE", f"/api-keys/{key_id}", admin["api_key"])
        assert revoked.status_code == 200, revoked.text


async def test_an_owner_revokes_any_listed_key_another_owners_included(services):
    second_owner = await services.member("owner")
    admin = await services.member("admin")
    async with sdk(services, second_owner["api_key"]) as client:
        theirs = await client.api_keys.create("second owner's key")
    async with sdk(services, admin["api_key"]) as client:
        admins = await client.api_keys.create("admin's key")
    for key_id in (theirs.id, admins.id):
        revoked = await _call(services, "DELETE", f"/api-keys/{key_id}", services.api_key)
        assert revoked.status_code == 200, revoked.text


async def test_list_keys_shows_organization_and_expiry_and_leaves_out_keys_bound_elsewhere(
    services,
):
    await join(services, services.user_id, "org_other", "owner")
    expires = _in(3600)
    async with sdk(services) as client:
        here = await client.api_keys.create("bound here", expires_at=expires)
    async with sdk(services, org_id="org_other") as client:
        elsewhere = await client.api_keys.create("bound elsewhere")
    listed = await identity.list_keys(services.gateway.sessions, services.org_id)
    other = await identity.list_keys(services.gateway.sessions, "org_other")
    assert listed is not None and other is not None
    by_id = {key["key_id"]: key for key in listed}
    assert elsewhere.id not in by_id and here.id not in {key["key_id"] for key in other}
    assert by_id[here.id]["organization_id"] == services.org_id
    assert by_id[here.id]["expires_at"] == here.expires_at
    cli_key = next(key for key in listed if key["key_id"] != here.id)
    assert cli_key["organization_id"] is None and cli_key["expires_at"] is None
    assert cli_key["key_id"] in {key["key_id"] for key in other}  # unbound: in every one
    assert set(cli_key) == {
        "key_id",
        "prefix",
        "name",
        "user_id",
        "role",
        "organization_id",
        "expires_at",
        "created_at",
        "revoked_at",
    }
