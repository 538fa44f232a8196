"""The SDK's `api_keys` routes against the gateway (issue 30), through the official SDK and, for
the refusals, raw HTTP.

Rules: a key is shown once, works at once and is never listed whole; the list holds the
organization's keys and the caller's own unbound ones, newest first, and anything else is 404;
a revoked key is refused at once (401); owner or admin only; a key bound to one organization is
403 in another; an expired key is 401; a key's own per-minute limit is honoured; bad bodies are
400; the organization's cap is 409.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import AsyncIterator

import httpx
import pytest
from modulex._exceptions import NotFoundError

from services.gateway.identity import (
    BOUND_ELSEWHERE,
    EXPIRED_KEY,
    ROLE_REQUIRED,
    Authenticator,
)
from services.gateway.models import ApiKey
from tests.conftest import SCRIPTED, Stack, script, start_stack, stop_stack
from tests.gateway.test_account_routes import clear_of_the_minute_boundary, join, sdk
from tests.sse_client import read_frames


def _in(seconds: float) -> str:
    moment = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=seconds)
    return moment.isoformat()


async def _raw(stack: Stack, method: str, path: str, key: str, org: str = "", **kwargs):  # noqa: ANN003, ANN202
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
        return await client.request(
            method, path, headers=stack.headers(api_key=key, org_id=org or None), **kwargs
        )


async def test_a_created_key_is_shown_once_works_for_a_turn_and_is_never_listed_whole(services):
    async with sdk(services) as client:
        created = await client.api_keys.create("ci runner")
        listed = await client.api_keys.list()
        one = await client.api_keys.get(created.id)
    key = created.key
    assert key is not None and key.startswith("mx_live_") and len(key) == 51
    assert created.organization_id == services.org_id and created.is_active
    assert created.key_hint == key[:12] and created.masked_key == key[:12] + "…"
    assert created.rate_limit_per_minute == 60  # the SDK's default, under the deployment's 6,000
    assert one.id == created.id and one.name == "ci runner" and one.key_hint == key[:12]
    assert created.id in [k.id for k in listed.keys]
    async with httpx.AsyncClient(base_url=services.base_url) as raw:
        texts = [
            (await raw.get(path, headers=services.headers())).text
            for path in ("/api-keys?include_revoked=true", f"/api-keys/{created.id}")
        ]
    assert all(key not in text and key[:13] not in text for text in texts)
    async with sdk(services, key) as new_key_client:
        turn = await new_key_client.assistant.chat(
            script({"say": "from the new key"}), llm=SCRIPTED
        )
    async with httpx.AsyncClient(
        base_url=services.base_url, headers=services.headers(api_key=key), timeout=30
    ) as client:
        frames = await read_frames(client, f"/assistant/chat/{turn.chat_id}/listen/{turn.run_id}")
    assert frames[-1]["type"] == "done"
    assert frames[-1]["data"]["response"] == "from the new key"
    async with sdk(services) as client:
        used = await client.api_keys.get(created.id)
    assert used.last_used_at is not None  # set by the look-up of its first request


async def test_the_list_holds_the_organizations_keys_and_the_callers_own_unbound_keys(services):
    admin = await services.member("admin")  # with an unbound CLI key, not the owner's
    async with sdk(services, admin["api_key"]) as client:
        admins = await client.api_keys.create("admin's bound key")
    await join(services, services.user_id, "org_other", "owner")
    async with sdk(services, org_id="org_other") as client:
        elsewhere = await client.api_keys.create("bound to the other organization")
    async with sdk(services) as client:
        mine = await client.api_keys.create("owner's bound key")
        listed = await client.api_keys.list()
        with pytest.raises(NotFoundError):
            await client.api_keys.get(elsewhere.id)
    ids = [k.id for k in listed.keys]
    owners_cli_key = [k for k in listed.keys if k.organization_id is None]
    assert ids[:2] == [mine.id, admins.id]  # newest first
    assert len(owners_cli_key) == 1 and owners_cli_key[0].key_hint == services.api_key[:12]
    assert admin["key_id"] not in ids and elsewhere.id not in ids
    assert listed.total == len(ids) == 3 and listed.max_keys == 100
    assert owners_cli_key[0].rate_limit_per_minute == 6_000  # no own limit: the deployment's


async def test_a_key_outside_the_list_is_404_for_get_and_revoke_like_a_missing_one(services):
    admin = await services.member("admin")
    for key_id in (admin["key_id"], "key_does_not_exist"):
        for method in ("GET", "DELETE"):
            response = await _raw(services, method, f"/api-keys/{key_id}", services.api_key)
            assert response.status_code == 404, (key_id, method, response.text)
            assert response.json() == {"detail": "API key not found"}
    assert (await _raw(services, "GET", "/assistant/chats", admin["api_key"])).status_code == 200


async def test_a_revoked_key_is_refused_at_once_and_revoking_again_succeeds(services):
    async with sdk(services) as client:
        created = await client.api_keys.create("short-lived")
        assert created.key is not None
        works = await _raw(services, "GET", "/assistant/chats", created.key)
        assert works.status_code == 200  # now in the gateway's cache (30 s)
        revoked = await client.api_keys.revoke(created.id)
        again = await client.api_keys.revoke(created.id)
        active = await client.api_keys.list()
        every = await client.api_keys.list(include_revoked=True)
    assert revoked.success and again.success
    refused = await _raw(services, "GET", "/assistant/chats", created.key)
    assert refused.status_code == 401 and refused.json() == {"detail": "Invalid API key"}
    assert created.id not in [k.id for k in active.keys]
    shown = next(k for k in every.keys if k.id == created.id)
    assert shown.revoked_at is not None and not shown.is_active


async def test_last_used_at_is_written_at_most_once_a_minute_per_key(services):
    """Written by the look-up that reads the key anyway, when older than a minute: a second
    look-up (another gateway, or after the cache's 30 s) within the minute writes nothing."""
    async with sdk(services) as client:
        created = await client.api_keys.create("counted")
    assert created.key is not None and created.last_used_at is None

    async def last_used() -> datetime.datetime | None:
        async with services.gateway.sessions() as session:
            row = await session.get(ApiKey, created.id)
            assert row is not None
            return row.last_used_at

    header = f"Bearer {created.key}"
    await Authenticator(services.gateway.sessions).authenticate(header, services.org_id)
    first = await last_used()
    await Authenticator(services.gateway.sessions).authenticate(header, services.org_id)
    assert first is not None and await last_used() == first
    async with services.gateway.sessions() as session, session.begin():
        row = await session.get(ApiKey, created.id)
        assert row is not None
        row.last_used_at = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=2)
    await Authenticator(services.gateway.sessions).authenticate(header, services.org_id)
    latest = await last_used()
    assert latest is not None and latest.replace(tzinfo=None) >= first.replace(tzinfo=None)


async def test_the_member_role_is_403_on_api_keys_but_200_on_auth_me(services):
    member = await services.member("member")
    for method, path, body in (
        ("GET", "/api-keys", None),
        ("POST", "/api-keys", {"name": "k"}),
        ("GET", "/api-keys/key_x", None),
        ("DELETE", "/api-keys/key_x", None),
    ):
        response = await _raw(services, method, path, member["api_key"], json=body)
        assert response.status_code == 403, (method, path)
        assert response.json() == {"detail": ROLE_REQUIRED}
    assert (await _raw(services, "GET", "/auth/me", member["api_key"])).status_code == 200


async def test_a_key_bound_to_one_organization_is_403_in_another_of_its_users(services):
    await join(services, services.user_id, "org_second", "owner")
    async with sdk(services) as client:
        created = await client.api_keys.create("bound")
    assert created.key is not None
    refused = await _raw(services, "GET", "/assistant/chats", created.key, org="org_second")
    assert refused.status_code == 403 and refused.json() == {"detail": BOUND_ELSEWHERE}
    assert (await _raw(services, "GET", "/assistant/chats", created.key)).status_code == 200
    # the CLI's unbound key works in both, as before
    for org in (services.org_id, "org_second"):
        response = await _raw(services, "GET", "/assistant/chats", services.api_key, org=org)
        assert response.status_code == 200


async def test_an_expired_key_is_401_also_while_its_look_up_is_cached(services):
    async with sdk(services) as client:
        created = await client.api_keys.create("expiring", expires_at=_in(1.5))
        stored = await client.api_keys.create("expired in the database")
    assert created.key is not None and stored.key is not None
    assert created.expires_at is not None and not created.is_expired
    assert (await _raw(services, "GET", "/assistant/chats", created.key)).status_code == 200
    await asyncio.sleep(2.0)
    refused = await _raw(services, "GET", "/assistant/chats", created.key)
    assert refused.status_code == 401 and refused.json() == {"detail": EXPIRED_KEY}
    async with services.gateway.sessions() as session, session.begin():
        row = await session.get(ApiKey, stored.id)
        assert row is not None
        row.expires_at = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=1)
    refused = await _raw(services, "GET", "/assistant/chats", stored.key)  # first look-up
    assert refused.status_code == 401 and refused.json() == {"detail": EXPIRED_KEY}
    async with sdk(services) as client:
        shown = await client.api_keys.get(created.id)
    assert shown.is_expired and not shown.is_active


async def test_a_key_with_its_own_limit_of_2_a_minute_gets_429_on_the_3rd_request(services):
    await clear_of_the_minute_boundary()
    async with sdk(services) as client:
        created = await client.api_keys.create("slow", rate_limit_per_minute=2)
    assert created.key is not None and created.rate_limit_per_minute == 2
    statuses = [
        (await _raw(services, "GET", "/assistant/chats", created.key)).status_code for _ in range(3)
    ]
    assert statuses == [200, 200, 429]
    denied = await _raw(services, "GET", "/auth/me", created.key)
    assert denied.status_code == 429
    assert denied.json()["key"] == "api_key" and denied.json()["limit"] == 2
    # the owner's own key is counted apart, under the deployment's limit
    assert (await _raw(services, "GET", "/assistant/chats", services.api_key)).status_code == 200


async def test_a_key_limit_above_the_deployments_is_400(services):
    response = await _raw(
        services,
        "POST",
        "/api-keys",
        services.api_key,
        json={"name": "fast", "rate_limit_per_minute": 6_001},
    )
    assert response.status_code == 400
    assert response.json() == {
        "detail": "rate_limit_per_minute must be an integer between 1 and 6000"
    }


BAD_BODIES = [
    ({}, "name is required: a non-empty string"),
    ({"name": "   "}, "name is required: a non-empty string"),
    ({"name": 5}, "name is required: a non-empty string"),
    ({"name": "x" * 201}, "name must be at most 200 characters (it has 201)"),
    ({"name": "k", "organization_id": "org_someone_else"}, None),
    ({"name": "k", "expires_at": "2030-01-01T00:00:00"}, None),  # no offset
    ({"name": "k", "expires_at": "tomorrow"}, None),
    (
        {"name": "k", "expires_at": "9999-12-31T23:59:59-05:00"},  # past year 9999 in UTC
        "expires_at is out of range: in UTC it falls outside the years 1 to 9999",
    ),
    (
        {"name": "k", "expires_at": "9999-12-31T23:59:59-14:00"},
        "expires_at is out of range: in UTC it falls outside the years 1 to 9999",
    ),
    ({"name": "k", "expires_at": "2001-01-01T00:00:00Z"}, "expires_at must be in the future"),
    ({"name": "k", "rate_limit_per_minute": 0}, None),
    ({"name": "k", "rate_limit_per_minute": "5"}, None),
    ({"name": "k", "scopes": ["all"]}, "Unknown field(s): scopes"),
]


@pytest.mark.parametrize(("body", "detail"), BAD_BODIES)
async def test_a_bad_create_body_is_400_with_a_detail(services, body, detail):
    response = await _raw(services, "POST", "/api-keys", services.api_key, json=body)
    assert response.status_code == 400, response.text
    assert set(response.json()) == {"detail"}
    if detail is not None:
        assert response.json()["detail"] == detail


@pytest.mark.parametrize("raw", [b"", b"[]", b'{"name": "a", "name": "b"}', b"{not json"], ids=str)
async def test_a_create_body_that_is_not_one_json_object_is_400(services, raw):
    response = await _raw(services, "POST", "/api-keys", services.api_key, content=raw)
    assert response.status_code == 400 and set(response.json()) == {"detail"}


async def test_a_name_is_trimmed_and_may_have_200_characters_then(services):
    response = await _raw(
        services,
        "POST",
        "/api-keys",
        services.api_key,
        json={"name": "  " + "n" * 200 + "  ", "organization_id": services.org_id},
    )
    assert response.status_code == 201, response.text
    assert response.json()["name"] == "n" * 200


@pytest.fixture
async def capped(tmp_path) -> AsyncIterator[Stack]:
    """The four services allowing 2 active API keys an organization."""
    running = await start_stack(tmp_path, gateway={"max_api_keys_per_organization": 2})
    try:
        yield running
    finally:
        await stop_stack(running)


async def test_past_the_organizations_cap_of_active_keys_creation_is_409(capped):
    async with sdk(capped) as client:
        first = await client.api_keys.create("one")
        await client.api_keys.create("two")
        listed = await client.api_keys.list()
    assert listed.max_keys == 2 and listed.total == 3  # the CLI's unbound key is not counted
    refused = await _raw(capped, "POST", "/api-keys", capped.api_key, json={"name": "three"})
    assert refused.status_code == 409 and "2 active API keys" in refused.json()["detail"]
    async with sdk(capped) as client:
        await client.api_keys.revoke(first.id)
        third = await client.api_keys.create("three")
    assert third.is_active


@pytest.mark.parametrize(
    "name",
    [
        "two\nlines",
        "ci runner\n",
        "tab\tname",
        "bell\x07",
        "del\x7f",
        "next line\x85",
        "mark\u200e",
        "mark\u200f",
        "override\u202eevil",
        "embed\u202a",
        "isolate\u2066x\u2069",
    ],
    ids=repr,
)
async def test_a_name_with_a_control_or_bidirectional_character_is_400(services, name):
    response = await _raw(services, "POST", "/api-keys", services.api_key, json={"name": name})
    assert response.status_code == 400, response.text
    assert response.json()["detail"].startswith(
        "name must not contain control characters (such as line breaks or tabs) nor"
        " bidirectional text controls (it has U+"
    )
