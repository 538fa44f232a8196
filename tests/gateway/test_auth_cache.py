"""The gateway's API-key cache (services/gateway/identity.py): one look-up per key and organization.

Rule (fan-out connect path): requests that miss the cache at the same moment — 10,000
listeners connecting, or the entry expiring under load — share one database look-up instead of
each running its own; the result (a principal or an auth error) is cached for `ttl_s`.
"""

from __future__ import annotations

import asyncio
import types

import pytest

from services.gateway.identity import ROLE_REQUIRED, Authenticator, AuthError, Principal
from tests.conftest import NO_DATABASE


class CountingAuthenticator(Authenticator):
    def __init__(self, result: Principal | AuthError) -> None:
        super().__init__(sessions=NO_DATABASE, ttl_s=30.0)
        self.lookups = 0
        self.result = result

    async def _resolve(self, digest: str, organization_id: str) -> Principal | AuthError:
        self.lookups += 1
        await asyncio.sleep(0.05)  # a database round trip
        return self.result


async def test_concurrent_cache_misses_share_one_lookup():
    auth = CountingAuthenticator(Principal(user_id="u", organization_id="org", role="owner"))
    results = await asyncio.gather(
        *[auth.authenticate("Bearer mx_live_k", "org") for _ in range(200)]
    )
    assert auth.lookups == 1
    assert all(r.user_id == "u" for r in results)
    await auth.authenticate("Bearer mx_live_k", "org")
    assert auth.lookups == 1  # cached


async def test_concurrent_misses_of_a_bad_key_share_one_lookup_and_all_get_the_error():
    auth = CountingAuthenticator(AuthError(401, "Invalid API key"))
    outcomes = await asyncio.gather(
        *[auth.authenticate("Bearer mx_live_bad", "org") for _ in range(50)], return_exceptions=True
    )
    assert auth.lookups == 1
    assert all(isinstance(o, AuthError) and o.status == 401 for o in outcomes)
    with pytest.raises(AuthError):
        await auth.authenticate("Bearer mx_live_bad", "org")
    assert auth.lookups == 1


async def test_header_cache_hit_is_a_lookup_of_the_header_and_expires_with_the_entry(monkeypatch):
    """A repeat caller is answered from the (Authorization, organization) cache without hashing
    the key again; the entry keeps the age of the look-up, so it expires after `ttl_s` as before."""
    from services.gateway import identity

    auth = CountingAuthenticator(Principal(user_id="u", organization_id="org", role="owner"))
    clock = [1000.0]
    monkeypatch.setattr(
        identity, "time", types.SimpleNamespace(monotonic=lambda: clock[0])
    )  # not the event loop's clock
    assert (await auth.authenticate("Bearer mx_live_k", "org")).user_id == "u"
    hashed: list[str] = []

    def hash_to_digest(key: str) -> str:
        hashed.append(key)
        return "digest"

    monkeypatch.setattr(identity, "hash_key", hash_to_digest)
    clock[0] += 29.0
    assert (await auth.authenticate("Bearer mx_live_k", "org")).user_id == "u"
    assert hashed == [] and auth.lookups == 1

    # Another spelling of the same key is its own header entry but shares the hash-keyed one.
    def hash_for_real(key: str) -> str:
        hashed.append(key)
        return identity.hashlib.sha256(key.encode()).hexdigest()

    monkeypatch.setattr(identity, "hash_key", hash_for_real)
    assert (await auth.authenticate("bearer  mx_live_k ", "org")).user_id == "u"
    assert hashed == ["mx_live_k"] and auth.lookups == 1
    clock[0] += 1.5  # 30.5 s after the look-up: both entries are stale
    assert (await auth.authenticate("Bearer mx_live_k", "org")).user_id == "u"
    assert auth.lookups == 2


async def test_header_cache_keeps_errors_and_other_organizations_apart():
    auth = CountingAuthenticator(AuthError(403, ROLE_REQUIRED))
    for _ in range(2):
        with pytest.raises(AuthError) as raised:
            await auth.authenticate("Bearer mx_live_k", "org_a")
        assert raised.value.status == 403
    assert auth.lookups == 1
    with pytest.raises(AuthError):
        await auth.authenticate("Bearer mx_live_k", "org_b")
    assert auth.lookups == 2
    with pytest.raises(AuthError) as raised:  # malformed headers are refused before any cache
        await auth.authenticate("Basic mx_live_k", "org_a")
    assert raised.value.status == 401


async def test_a_forgotten_key_is_looked_up_again_even_when_its_look_up_was_running():
    """A key revoked through this gateway (`forget`) is read from the database at its next
    request: its cached entries are dropped, and a look-up that was running when it was revoked
    answers its own requests but caches nothing."""
    auth = CountingAuthenticator(
        Principal(user_id="u", organization_id="org", role="owner", key_id="key_1")
    )
    await auth.authenticate("Bearer mx_live_k", "org")
    auth.forget("key_1")
    await auth.authenticate("Bearer mx_live_k", "org")
    assert auth.lookups == 2
    running = asyncio.create_task(auth.authenticate("Bearer mx_live_other", "org"))
    await asyncio.sleep(0.01)  # the look-up is in its database round trip
    auth.forget("key_1")
    assert (await running).user_id == "u"
    await auth.authenticate("Bearer mx_live_other", "org")
    assert auth.lookups == 4
