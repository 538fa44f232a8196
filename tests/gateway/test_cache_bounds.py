"""The gateway's per-process caches stay bounded however many organizations and keys call.

DefaultModels and the API-key caches are `cachetools.TTLCache`s: at most `max_entries`
entries, least recently used evicted first, expired entries dropped. So a gateway serving
many organizations does not grow without limit, nor empty a cache wholesale when it is full.
"""

from __future__ import annotations

import contextlib

from services.gateway.default_models import DefaultModels
from services.gateway.identity import Authenticator, Principal
from tests.conftest import NO_DATABASE


class _Session:
    def __init__(self) -> None:
        self.reads = 0

    async def get(
        self, model, key
    ) -> None:  # a stand-in for AsyncSession.get: no such organization
        self.reads += 1


def _sessions(session: _Session):
    @contextlib.asynccontextmanager
    async def factory():
        yield session

    return factory


async def test_default_models_cache_is_bounded():
    session = _Session()
    models = DefaultModels(_sessions(session), ttl_s=30.0, max_entries=100)
    for i in range(1_000):
        assert await models.get(f"org_{i}") is None
    assert len(models._cache) <= 100
    reads = session.reads
    assert await models.get("org_999") is None  # recently used: still cached
    assert session.reads == reads
    assert await models.get("org_0") is None  # evicted long ago: read again
    assert session.reads == reads + 1


class _Auth(Authenticator):
    async def _resolve(self, digest: str, organization_id: str) -> Principal:
        return Principal(user_id="u", organization_id=organization_id, role="owner")


async def test_api_key_caches_are_bounded_without_emptying():
    auth = _Auth(sessions=NO_DATABASE, ttl_s=30.0, max_entries=50)
    for i in range(500):
        await auth.authenticate(f"Bearer key_{i}", "org")
    assert 0 < len(auth._cache) <= 50 and 0 < len(auth._by_header) <= 50
    assert ("Bearer key_499", "org") in auth._by_header  # the newest survive eviction
