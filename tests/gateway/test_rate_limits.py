"""Rate limits on every authenticated route (per API key) and on failed authentications (per
client), answered with the rate denial envelope: credential reads and wrong keys too, not
only turn starts."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest

from services.gateway.config import GatewaySettings
from services.gateway.identity import Authenticator, AuthError, Principal
from services.gateway.ratelimit import MemoryWindow, RateLimited, RequestLimits, client_of
from tests.conftest import NO_DATABASE, redis_url, start_stack, stop_stack


async def _clear_of_the_minute_boundary() -> None:
    """Wait for the next minute when this one ends within 10 s: the memory windows are fixed
    minutes, and a window that turns during a test would give its counts back."""
    left = 60 - time.time() % 60
    if left < 10:
        await asyncio.sleep(left + 0.2)


def _assert_rate_denial(response: httpx.Response, key: str, limit: int) -> None:
    assert response.status_code == 429, response.text
    body = response.json()
    assert body["code"] == "rate_limited" and body["layer"] == "rate" and body["key"] == key
    assert body["limit"] == limit and body["current"] == limit and body["reason"]
    assert set(body) == {
        "code",
        "layer",
        "key",
        "current",
        "limit",
        "reason",
    }  # the flat envelope, as billing's
    assert 1 <= int(response.headers["retry-after"]) <= 60
    assert response.headers["x-ratelimit-limit"] == str(limit)
    assert response.headers["x-ratelimit-remaining"] == "0"
    assert 1 <= int(response.headers["x-ratelimit-reset"]) <= 60


def test_the_defaults_are_generous():
    settings = GatewaySettings()
    assert settings.key_requests_per_minute == 6_000 and settings.failed_auths_per_minute == 30
    assert settings.rate_limit_storage_url in ("memory://", settings.redis_url)


async def test_every_authenticated_route_counts_against_the_key(tmp_path):
    stack = await start_stack(tmp_path, gateway={"key_requests_per_minute": 6})
    try:
        await _clear_of_the_minute_boundary()
        other = await stack.member("owner")
        async with stack.client() as client:
            turn = await client.post("/assistant/chat", json={"message": "hi"})  # the lean route
            assert turn.status_code == 200, turn.text
            listen = await client.get(turn.json()["stream_url"])  # the lean listen route
            assert listen.status_code == 200
            for path in (
                "/assistant/chats",
                "/credentials",
                "/knowledge-bases",
                f"/assistant/chat/{turn.json()['chat_id']}/status",
            ):
                assert (await client.get(path)).status_code == 200, path
            for path in ("/credentials", "/assistant/chats", "/knowledge-bases"):
                _assert_rate_denial(await client.get(path), "api_key", 6)
            _assert_rate_denial(
                await client.post("/assistant/chat", json={"message": "hi"}), "api_key", 6
            )
            _assert_rate_denial(await client.get(turn.json()["stream_url"]), "api_key", 6)
        async with httpx.AsyncClient(
            base_url=stack.base_url, headers=stack.headers(other["api_key"])
        ) as second:
            assert (
                await second.get("/credentials")
            ).status_code == 200  # another key has its own count
        async with httpx.AsyncClient(base_url=stack.base_url) as anonymous:
            assert (await anonymous.get("/healthz")).status_code == 200  # no key, no count
    finally:
        await stop_stack(stack)


async def test_failed_authentications_block_the_client_for_the_rest_of_the_minute(tmp_path, caplog):
    stack = await start_stack(tmp_path, gateway={"failed_auths_per_minute": 3})
    try:
        await _clear_of_the_minute_boundary()
        wrong = {"Authorization": "Bearer mx_live_" + "x" * 43, "X-Organization-ID": stack.org_id}
        async with httpx.AsyncClient(base_url=stack.base_url) as client:
            assert (await client.get("/credentials", headers=wrong)).status_code == 401
            assert (await client.get("/assistant/chats")).status_code == 401  # no key at all
            member = await stack.member("member")  # a key without the role: 403, not counted
            assert (
                await client.get("/credentials", headers=stack.headers(member["api_key"]))
            ).status_code == 403
            assert (await client.get("/credentials", headers=wrong)).status_code == 401  # the 3rd
            _assert_rate_denial(
                await client.get("/credentials", headers=wrong), "failed_authentication", 3
            )
            # now every request of this client is refused, a valid key's too, lean routes included
            _assert_rate_denial(
                await client.get("/credentials", headers=stack.headers()),
                "failed_authentication",
                3,
            )
            _assert_rate_denial(
                await client.post(
                    "/assistant/chat", headers=stack.headers(), json={"message": "x"}
                ),
                "failed_authentication",
                3,
            )
            _assert_rate_denial(
                await client.get("/assistant/chat/c/listen/r", headers=stack.headers()),
                "failed_authentication",
                3,
            )
            assert (await client.get("/healthz")).status_code == 200
        assert [
            r
            for r in caplog.records
            if r.getMessage() == "client blocked for failed authentications"
        ]
    finally:
        await stop_stack(stack)


async def test_role_and_organization_403s_do_not_count_as_failed_authentications(tmp_path):
    """A valid key refused for its role or its organization guesses nothing: its 403s never block
    the client (30 of a member's requests used to lock out everyone behind its address)."""
    stack = await start_stack(tmp_path, gateway={"failed_auths_per_minute": 2})
    try:
        await _clear_of_the_minute_boundary()
        member = await stack.member("member")
        stranger = await stack.member("owner", org_id="org_stranger")  # not a member of the stack's
        async with httpx.AsyncClient(base_url=stack.base_url) as client:
            made = await client.post(
                "/api-keys",
                headers=stack.headers(stranger["api_key"], "org_stranger"),
                json={"name": "bound to org_stranger"},
            )
            assert made.status_code == 201, made.text
            bound_elsewhere = made.json()["key"]
            for _ in range(5):
                for key in (member["api_key"], stranger["api_key"], bound_elsewhere):
                    denied = await client.get("/credentials", headers=stack.headers(key))
                    assert denied.status_code == 403, denied.text
            assert (await client.get("/credentials", headers=stack.headers())).status_code == 200
            wrong = stack.headers(api_key="mx_live_" + "y" * 43)
            statuses = [
                (await client.get("/credentials", headers=wrong)).status_code for _ in "abc"
            ]
        assert statuses == [401, 401, 429]  # 401s still count
    finally:
        await stop_stack(stack)


async def test_the_openapi_document_declares_429_on_every_route_that_takes_a_key(services):
    async with services.client() as client:
        document = (await client.get("/openapi.json")).json()
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            if path == "/system/health":  # open, no key: answers 200 only
                continue
            assert "429" in operation["responses"], (method, path)


# ---- the limiter itself -------------------------------------------------------------------------


class _Keys(Authenticator):
    """An authenticator that knows one key ("good") and refuses any other with 401."""

    def __init__(self) -> None:
        super().__init__(NO_DATABASE)

    async def authenticate(
        self, authorization: str | None, organization_id: str | None
    ) -> Principal:
        if authorization == "Bearer good":
            return Principal("u", organization_id or "o", "owner")
        raise AuthError(401, "Invalid API key")


def _scope(host: str) -> dict:
    return {"type": "http", "client": (host, 5000)}


def test_a_memory_window_counts_to_its_limit_and_forgets_at_the_next_window():
    window = MemoryWindow(2, window_s=60, max_entries=3)
    start = 600.0  # a window starts here
    assert window.hit("a", start) == (True, 0)
    assert window.hit("a", start + 1) == (True, 0)
    assert window.hit("a", start + 50) == (False, 10)  # 10 s to the window's end
    assert window.hit("b", start + 50) == (True, 0)
    assert window.hit("a", start + 60) == (True, 0)  # the next window
    for name in "cdef":  # past max_entries the oldest identifier is forgotten
        window.hit(name, start + 61)
    assert len(window._counts) == 3


async def test_clients_are_counted_apart_and_an_ipv6_client_by_its_64():
    limits = RequestLimits(_Keys(), key_per_minute=0, failed_auth_per_minute=2)
    await _clear_of_the_minute_boundary()
    for _ in range(2):
        with pytest.raises(AuthError) as failed:
            await limits.authenticate(_scope("2001:db8:1:2::1"), "Bearer bad", "o")
        assert failed.value.status == 401
    with pytest.raises(RateLimited):  # another address of the same /64
        await limits.authenticate(_scope("2001:db8:1:2:ffff::9"), "Bearer bad", "o")
    with pytest.raises(RateLimited):  # blocked: a good key is refused too, without a look-up
        await limits.authenticate(_scope("2001:db8:1:2::1"), "Bearer good", "o")
    assert (
        await limits.authenticate(_scope("2001:db8:1:3::1"), "Bearer good", "o")
    ).user_id == "u"  # another /64
    assert (await limits.authenticate(_scope("192.0.2.7"), "Bearer good", "o")).user_id == "u"
    assert client_of({"client": None}) == "" and client_of(_scope("192.0.2.7")) == "192.0.2.7"


async def test_a_key_is_counted_by_its_value_whatever_the_header_spacing():
    limits = RequestLimits(_Keys(), key_per_minute=2, failed_auth_per_minute=0)
    await _clear_of_the_minute_boundary()
    await limits.authenticate(_scope("192.0.2.1"), "Bearer good", "o")
    await limits.authenticate(_scope("192.0.2.2"), "Bearer good", "o")
    with pytest.raises(RateLimited) as refused:
        await limits.authenticate(_scope("192.0.2.3"), "Bearer good", "o")
    assert refused.value.status == 429 and refused.value.key == "api_key"
    response = refused.value.response()
    assert response.status_code == 429 and response.headers["x-ratelimit-limit"] == "2"


def test_a_hit_costs_microseconds():
    """The hot path: one dict update per request, so every route can afford the limit."""
    window = MemoryWindow(10**9)
    started = time.perf_counter()
    for _ in range(100_000):
        window.hit("key")
    assert time.perf_counter() - started < 0.5


async def test_redis_counters_are_shared_and_a_redis_that_fails_lets_requests_pass(caplog):
    try:
        import redis.asyncio as redis_asyncio

        probe = redis_asyncio.from_url(redis_url(), socket_connect_timeout=1)
        await probe.ping()
        await probe.aclose()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"no Redis at {redis_url()} ({type(exc).__name__})")
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    first = RequestLimits(_Keys(), 3, 0, redis_url(), prefix)
    second = RequestLimits(_Keys(), 3, 0, redis_url(), prefix)  # another replica
    try:
        await first.authenticate(_scope("192.0.2.1"), "Bearer good", "o")
        await second.authenticate(_scope("192.0.2.1"), "Bearer good", "o")
        await first.authenticate(_scope("192.0.2.1"), "Bearer good", "o")
        with pytest.raises(RateLimited) as refused:
            await second.authenticate(_scope("192.0.2.1"), "Bearer good", "o")
        assert 1 <= refused.value.reset_s <= 60
    finally:
        await first.close()
        await second.close()
    unreachable = RequestLimits(_Keys(), 1, 1, "redis://127.0.0.1:1/0", prefix)
    try:
        for _ in range(3):
            assert (
                await unreachable.authenticate(_scope("192.0.2.1"), "Bearer good", "o")
            ).user_id == "u"
    finally:
        await unreachable.close()
    assert (
        len(
            [
                r
                for r in caplog.records
                if r.getMessage().startswith("rate-limit counters unavailable")
            ]
        )
        == 1
    )
