"""The gateway's API-key cache (services/gateway/identity.py): one look-up per key and organization.

Rule (issue 9, fan-out connect path): requests that miss the cache at the same moment — 10,000
listeners connecting, or the entry expiring under load — share one database look-up instead of
each running its own; the result (a principal or an auth error) is cached for `ttl_s`.
"""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.identity import Authenticator, AuthError, Principal


class CountingAuthenticator(Authenticator):
    def __init__(self, result: Principal | AuthError) -> None:
        super().__init__(sessions=None, ttl_s=30.0)
        self.lookups = 0
        self.result = result

    async def _resolve(self, digest: str, organization_id: str) -> Principal | AuthError:
        self.lookups += 1
        await asyncio.sleep(0.05)  # a database round trip
        return self.result


async def test_concurrent_cache_misses_share_one_lookup():
    auth = CountingAuthenticator(Principal(user_id="u", organization_id="org", role="owner"))
    results = await asyncio.gather(*[auth.authenticate("Bearer mx_live_k", "org") for _ in range(200)])
    assert auth.lookups == 1
    assert all(r.user_id == "u" for r in results)
    await auth.authenticate("Bearer mx_live_k", "org")
    assert auth.lookups == 1  # cached


async def test_concurrent_misses_of_a_bad_key_share_one_lookup_and_all_get_the_error():
    auth = CountingAuthenticator(AuthError(401, "Invalid API key"))
    outcomes = await asyncio.gather(*[auth.authenticate("Bearer mx_live_bad", "org") for _ in range(50)], return_exceptions=True)
    assert auth.lookups == 1
    assert all(isinstance(o, AuthError) and o.status == 401 for o in outcomes)
    with pytest.raises(AuthError):
        await auth.authenticate("Bearer mx_live_bad", "org")
    assert auth.lookups == 1
