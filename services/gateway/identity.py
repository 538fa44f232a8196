"""API-key authentication and organization roles.

`Authorization: Bearer <api key>` names a user (keys are stored as SHA-256 hashes);
`X-Organization-ID` names the organization the request acts in. Every authenticated
route (the assistant, credentials, knowledge bases, organization settings) requires the
owner or admin role (spec: "As built today the Assistant requires the owner or admin
role"); any other role, or no membership, is 403 "This requires the owner or admin role
in this organization"; a missing, unknown, revoked or expired key is 401. The exception is
`GET /auth/me` (`Authenticator.identify`): any member may call it, X-Organization-ID optional.
A key bound to an organization (made by POST /api-keys) is refused (403) in any other one.

The admin functions at the end (seed_dev, create_member, list_keys, revoke_key) back the
`python -m services.gateway` commands; they raise AdminError with a message safe to print
(never a key) when asked for something they cannot do.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import logging
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any

from cachetools import TTLCache
from sqlalchemy import or_, select, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from services.common import db, ids, pb
from services.gateway.models import ApiKey, Membership, Organization, User

Sessions = async_sessionmaker[AsyncSession]
log = logging.getLogger(__name__)

ASSISTANT_ROLES = frozenset({"owner", "admin"})
KEY_PREFIX = "mx_live_"
# The 403 of a caller whose role is not in ASSISTANT_ROLES (worded for every route that checks it).
ROLE_REQUIRED = "This requires the owner or admin role in this organization"
# A stored and listed key prefix has at most this many characters, and at most a quarter of the key.
PREFIX_CHARS = 12
# The shortest LOOPLINE_DEV_API_KEY seed-dev accepts (a minted key has 51 characters).
MIN_DEV_KEY_CHARS = 20


class AdminError(ValueError):
    """An admin operation that cannot be done as asked; its message is safe to print (no key)."""


def hash_key(key: str) -> str:
    """The stored form of an API key: hex SHA-256."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    """A fresh API key: `mx_live_` + 43 URL-safe characters (256 bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_prefix(key: str) -> str:
    """The part of `key` stored beside its hash and listed to recognise it: its first
    PREFIX_CHARS (12) characters, but never more than a quarter of the key (rounded down), so
    a prefix is always shorter than the key and leaves at least three quarters of it unknown.
    A minted key (51 characters) shows 12 (`mx_live_` + 4); a 20-character dev key 5; a key of
    fewer than 4 characters none ("")."""
    return key[: min(PREFIX_CHARS, len(key) // 4)]


def check_dev_key(key: str) -> None:
    """Raise AdminError unless `key` can be a fixed development key (LOOPLINE_DEV_API_KEY): at
    least MIN_DEV_KEY_CHARS (20) printable ASCII characters without spaces (shorter keys are
    guessable and a listed prefix would show most of them; other characters never arrive
    intact in an Authorization header). The message gives the length, never the key."""
    if len(key) < MIN_DEV_KEY_CHARS or not all(33 <= ord(c) <= 126 for c in key):
        raise AdminError(
            f"LOOPLINE_DEV_API_KEY must be at least {MIN_DEV_KEY_CHARS} printable ASCII characters"
            f" without spaces (it has {len(key)} characters); leave it unset to have a key minted"
        )


def check_dev_org_id(org_id: str) -> None:
    """Raise AdminError when `org_id` (LOOPLINE_DEV_ORG_ID) cannot be an organization's id
    (services.common.ids); the message says why."""
    problem = ids.org_id_error(org_id)
    if problem is not None:
        raise AdminError(f"LOOPLINE_DEV_ORG_ID: {problem}")


@dataclass(frozen=True)
class Principal:
    """The authenticated caller: user, organization and role there ("" for both on a route
    that takes no organization), and the facts of the API key used that later checks need:
    its id, the organization it is bound to (None: unbound), when it expires (Unix time;
    None: never) and its own per-minute request limit (None: the deployment's)."""

    user_id: str
    organization_id: str
    role: str
    key_id: str = ""
    key_organization_id: str | None = None
    expires_at: float | None = None
    rate_limit_per_minute: int | None = None


class AuthError(Exception):
    """Authentication (401) or authorization (403) failed; `status` and a safe `detail`."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


#: Roles of a member of an organization (`GET /auth/me` takes any of them).
MEMBER_ROLES = frozenset({"owner", "admin", "member"})
NO_KEY = "Missing or invalid Authorization header; use 'Bearer <api key>'"
INVALID_KEY = "Invalid API key"
EXPIRED_KEY = "API key expired"
BOUND_ELSEWHERE = "This API key is bound to another organization"
NOT_A_MEMBER = "The API key's user is not a member of this organization"
#: `last_used_at` is written when a look-up finds it older than this (or the cache TTL, if
#: longer): at most one write per key per minute, never one per request.
LAST_USED_EVERY_S = 60.0


class Authenticator:
    """Resolves (api key, organization id) to a Principal, caching results for `ttl_s` seconds.

    Two caches with the same entries and ages: by (key hash, organization) — what the database
    look-up fills — and by the request's (Authorization header, organization) exactly as sent,
    so that a repeat caller costs one dict look-up (gateway CPU per turn). The second
    holds header values in process memory only (never logged, never stored). Each holds at
    most `max_entries` entries (least recently used evicted first); an entry's value carries
    the time of its database look-up, which decides its age in both. The role and the key's
    expiry are checked on every request, after the cache (`_admit`); `forget` drops a key
    revoked through this gateway from both at once.
    """

    def __init__(self, sessions: Sessions, ttl_s: float = 30.0, max_entries: int = 10_000) -> None:
        self.sessions = sessions
        self.ttl_s = ttl_s
        self._cache: TTLCache[tuple[str, str], tuple[float, Principal | AuthError]] = TTLCache(
            max_entries, ttl_s, timer=time.monotonic
        )
        # keyed by the headers as sent (absent ones are None)
        self._by_header: TTLCache[
            tuple[str | None, str | None], tuple[float, Principal | AuthError]
        ] = TTLCache(max_entries, ttl_s, timer=time.monotonic)
        self._inflight: dict[tuple[str, str], asyncio.Future[Principal | AuthError]] = {}
        # bumped by `forget`: a look-up that started before is answered but not cached
        self._epoch = 0

    async def authenticate(
        self, authorization: str | None, organization_id: str | None
    ) -> Principal:
        """The caller, or AuthError(401) for a missing/unknown/revoked/expired key, AuthError(403)
        for a key bound to another organization or a role other than owner or admin.

        A missing X-Organization-ID, or one no organization can have (`ids.org_id_error`: 1 to
        128 visible ASCII characters), is 400 (AuthError with status 400).
        """
        cached = self._by_header.get((authorization, organization_id))
        if cached is not None and time.monotonic() - cached[0] < self.ttl_s:
            return _admit(cached[1], ASSISTANT_ROLES)
        digest = hash_key(_bearer_key(authorization))
        organization = _organization(organization_id)
        if organization is None:
            raise AuthError(400, "X-Organization-ID header is required")
        epoch = self._epoch
        entry = await self._entry(digest, organization)
        if epoch == self._epoch:  # the same age as the hash-keyed entry
            self._by_header[(authorization, organization_id)] = entry
        return _admit(entry[1], ASSISTANT_ROLES)

    async def identify(self, authorization: str | None, organization_id: str | None) -> Principal:
        """The caller of a route where X-Organization-ID is optional and any member may call
        (`GET /auth/me`): with the header as `authenticate` but any of MEMBER_ROLES (403 for
        no membership); without it the key's user, with organization and role "". A missing,
        unknown, revoked or expired key is 401 either way."""
        digest = hash_key(_bearer_key(authorization))
        organization = _organization(organization_id)
        entry = await self._entry(digest, organization or "")
        if not organization:
            return _admit(entry[1], None)
        return _admit(entry[1], MEMBER_ROLES)

    def forget(self, key_id: str) -> None:
        """Drop every cached look-up of the key `key_id` (revoked here: refused at once), and
        keep look-ups already running from caching what they read before."""
        self._epoch += 1
        _drop_key(self._cache, key_id)
        _drop_key(self._by_header, key_id)

    async def _entry(self, digest: str, organization: str) -> tuple[float, Principal | AuthError]:
        """The hash-keyed cache entry of (key, organization), looked up when absent or old."""
        entry = self._cache.get((digest, organization))
        now = time.monotonic()
        if entry and now - entry[0] < self.ttl_s:
            return entry
        return await self._resolve_once((digest, organization), now)

    async def _resolve_once(
        self, cache_key: tuple[str, str], now: float
    ) -> tuple[float, Principal | AuthError]:
        """One database look-up per (key, organization) at a time: concurrent requests that miss
        the cache together (e.g. 10,000 listeners connecting when the entry expires) share it.
        Returns the cache entry (`now`, result)."""
        pending = self._inflight.get(cache_key)
        if pending is None:
            epoch = self._epoch
            pending = asyncio.ensure_future(self._resolve(*cache_key))
            self._inflight[cache_key] = pending
            try:
                result = await asyncio.shield(pending)
            finally:
                if self._inflight.get(cache_key) is pending:
                    del self._inflight[cache_key]
            entry = (now, result)
            if epoch == self._epoch:
                self._cache[cache_key] = entry
            return entry
        return now, await asyncio.shield(pending)

    async def _resolve(self, digest: str, organization_id: str) -> Principal | AuthError:
        """The key's Principal in `organization_id` (role "" when its user is not a member
        there, or when no organization is given), or the AuthError of a key refused whatever
        the role. Refreshes the key's `last_used_at` when it is older than LAST_USED_EVERY_S."""
        now = datetime.datetime.now(datetime.UTC)
        async with self.sessions() as session:
            key = (
                (await session.execute(select(ApiKey).where(ApiKey.key_hash == digest)))
                .scalars()
                .first()
            )
            if key is None or key.revoked_at is not None:
                return AuthError(401, INVALID_KEY)
            expires = db.utc(key.expires_at)
            if expires is not None and expires <= now:
                return AuthError(401, EXPIRED_KEY)
            bound = key.organization_id
            if organization_id and bound is not None and bound != organization_id:
                return AuthError(403, BOUND_ELSEWHERE)
            role = ""
            if organization_id:
                role = (
                    await session.execute(
                        select(Membership.role).where(
                            Membership.user_id == key.user_id,
                            Membership.organization_id == organization_id,
                        )
                    )
                ).scalar() or ""
            who = Principal(
                user_id=key.user_id,
                organization_id=organization_id,
                role=role,
                key_id=key.id,
                key_organization_id=bound,
                expires_at=expires.timestamp() if expires is not None else None,
                rate_limit_per_minute=key.rate_limit_per_minute,
            )
            await self._touch(session, key, now)
        return who

    async def _touch(self, session: AsyncSession, key: ApiKey, now: datetime.datetime) -> None:
        """Set `last_used_at` of `key` to `now` when it is unset or older than LAST_USED_EVERY_S
        (or the cache TTL): one write per key a minute at most, on a look-up that reads the key
        anyway. Best effort: a failed write is logged and the request goes on."""
        last = db.utc(key.last_used_at)
        every = datetime.timedelta(seconds=max(self.ttl_s, LAST_USED_EVERY_S))
        if last is not None and now - last < every:
            return
        try:
            await session.execute(
                update(ApiKey)
                .where(
                    ApiKey.id == key.id,
                    or_(ApiKey.last_used_at.is_(None), ApiKey.last_used_at < now - every),
                )
                .values(last_used_at=now)
                # not evaluated against the loaded row (SQLite hands its times back naive)
                .execution_options(synchronize_session=False)
            )
            await session.commit()
        except SQLAlchemyError as error:
            await session.rollback()
            log.warning(
                "could not record an API key's last use",
                extra={"fields": {"error": type(error).__name__}},
            )


def _drop_key(cache: TTLCache[Any, tuple[float, Principal | AuthError]], key_id: str) -> None:
    """Remove from `cache` every entry that admitted the key `key_id`."""
    for name in list(cache.keys()):
        entry = cache.get(name)
        if entry is not None and isinstance(entry[1], Principal) and entry[1].key_id == key_id:
            cache.pop(name, None)


def _bearer_key(authorization: str | None) -> str:
    """The key of a `Bearer <key>` header; AuthError 401 when there is none."""
    if not authorization or not authorization.lower().startswith("bearer "):
        raise AuthError(401, NO_KEY)
    key = authorization[7:].strip()
    if not key:
        raise AuthError(401, NO_KEY)
    return key


def _organization(organization_id: str | None) -> str | None:
    """The X-Organization-ID value without surrounding whitespace (RFC 9110 §5.5), None when
    absent or blank; AuthError 400 when no organization can have it (`ids.org_id_error`)."""
    if organization_id:
        organization_id = organization_id.strip(" \t")
    if not organization_id:
        return None
    malformed = ids.org_id_error(organization_id)
    if malformed is not None:  # no organization can have it: 400 like a missing one, not 403
        raise AuthError(400, f"X-Organization-ID is malformed: {malformed}")
    return organization_id


def _admit(result: Principal | AuthError, roles: frozenset[str] | None) -> Principal:
    """`result` when the caller may go on: raises it when it is an AuthError, 401 when the key
    has expired since its look-up, 403 when `roles` is given and the caller's role is not in it
    (owner or admin: ROLE_REQUIRED; any member: NOT_A_MEMBER)."""
    if isinstance(result, AuthError):
        raise result
    if result.expires_at is not None and time.time() >= result.expires_at:
        raise AuthError(401, EXPIRED_KEY)
    if roles is not None and result.role not in roles:
        raise AuthError(403, ROLE_REQUIRED if roles is ASSISTANT_ROLES else NOT_A_MEMBER)
    return result


async def user_email(sessions: Sessions, user_id: str) -> str | None:
    """The email of the user `user_id`, or None (an empty id, or no such user)."""
    if not user_id:
        return None
    async with sessions() as session:
        return (
            await session.execute(select(User.email).where(User.id == user_id))
        ).scalar_one_or_none()


async def seed_dev(sessions: Sessions, api_key: str = "", org_id: str = "") -> dict[str, str]:
    """Ensure a development organization, owner and API key exist (idempotent).

    Fixed values come from `api_key`/`org_id` (LOOPLINE_DEV_API_KEY / LOOPLINE_DEV_ORG_ID);
    otherwise the existing dev organization is reused and a new key is minted, because
    stored keys cannot be read back. Returns {organization_id, api_key, user_id}.

    Raises:
        AdminError: `api_key` is given but unusable (`check_dev_key`: shorter than 20
            characters, or with spaces or non-ASCII characters), or `org_id` is given but
            unusable (services.common.ids); nothing is written.
    """
    if api_key:
        check_dev_key(api_key)
    if org_id:
        check_dev_org_id(org_id)
    email = "dev@loopline.local"
    async with sessions() as session, session.begin():
        user = (await session.execute(select(User).where(User.email == email))).scalars().first()
        if user is None:
            user = User(id=f"user_{uuid.uuid4().hex[:16]}", email=email)
            session.add(user)
            await session.flush()
        if not org_id:
            org_id = (
                await session.execute(
                    select(Membership.organization_id).where(
                        Membership.user_id == user.id, Membership.role == "owner"
                    )
                )
            ).scalar() or f"org_{uuid.uuid4().hex[:16]}"
        if await session.get(Organization, org_id) is None:
            session.add(Organization(id=org_id, name="Development organization"))
            await session.flush()
        membership = (
            (
                await session.execute(
                    select(Membership).where(
                        Membership.user_id == user.id, Membership.organization_id == org_id
                    )
                )
            )
            .scalars()
            .first()
        )
        if membership is None:
            session.add(Membership(organization_id=org_id, user_id=user.id, role="owner"))
        key = api_key or new_key()
        digest = hash_key(key)
        if (
            await session.execute(select(ApiKey).where(ApiKey.key_hash == digest))
        ).scalars().first() is None:
            session.add(
                ApiKey(
                    id=f"key_{uuid.uuid4().hex[:16]}",
                    user_id=user.id,
                    key_hash=digest,
                    prefix=key_prefix(key),
                    name="development key",
                )
            )
    return {"organization_id": org_id, "api_key": key, "user_id": user.id}


async def create_member(
    sessions: Sessions, organization_id: str, role: str, email: str | None = None
) -> dict[str, str]:
    """Create a user with `role` in `organization_id` (created if absent) and an API key for them.

    Returns {organization_id, user_id, key_id, api_key}. Used by tests and the admin command.

    Raises:
        AdminError: a user with `email` already exists (emails are unique), also when one
            is created concurrently; nothing is written.
    """
    try:
        return await _create_member(sessions, organization_id, role, email)
    except IntegrityError:  # a user with this email created between the check and the insert
        if email:
            raise AdminError(f"a user with email {email!r} already exists") from None
        raise


async def _create_member(
    sessions: Sessions, organization_id: str, role: str, email: str | None
) -> dict[str, str]:
    async with sessions() as session, session.begin():
        if (
            email
            and (await session.execute(select(User.id).where(User.email == email))).first()
            is not None
        ):
            raise AdminError(f"a user with email {email!r} already exists")
        if await session.get(Organization, organization_id) is None:
            session.add(Organization(id=organization_id, name=organization_id))
            await session.flush()
        user = User(
            id=f"user_{uuid.uuid4().hex[:16]}",
            email=email or f"{uuid.uuid4().hex[:12]}@example.test",
        )
        session.add(user)
        await session.flush()
        session.add(Membership(organization_id=organization_id, user_id=user.id, role=role))
        key = new_key()
        key_id = f"key_{uuid.uuid4().hex[:16]}"
        session.add(
            ApiKey(
                id=key_id,
                user_id=user.id,
                key_hash=hash_key(key),
                prefix=key_prefix(key),
                name=f"{role} key",
            )
        )
    return {
        "organization_id": organization_id,
        "user_id": user.id,
        "key_id": key_id,
        "api_key": key,
    }


async def list_keys(sessions: Sessions, organization_id: str) -> list[dict[str, str | None]] | None:
    """The API keys of the organization's members usable there, oldest first: {key_id, prefix,
    name, user_id, role, organization_id, expires_at, created_at, revoked_at} (times ISO 8601,
    UTC; `organization_id` null for an unbound key, valid in every organization of its user).
    A member's key bound to another organization is left out: it is refused here. None when the
    organization does not exist.

    `prefix` is `key_prefix(key)`: enough to recognise a key, always shorter than it. A key
    stored before that rule whose stored prefix is the whole key (a dev key of 12 characters
    or fewer) is shown with `key_prefix` of it, never whole."""
    async with sessions() as session:
        if await session.get(Organization, organization_id) is None:
            return None
        rows = (
            await session.execute(
                select(ApiKey, Membership.role)
                .join(Membership, Membership.user_id == ApiKey.user_id)
                .where(
                    Membership.organization_id == organization_id,
                    or_(
                        ApiKey.organization_id.is_(None),
                        ApiKey.organization_id == organization_id,
                    ),
                )
                .order_by(ApiKey.created_at, ApiKey.id)
            )
        ).all()

    return [
        {
            "key_id": key.id,
            "prefix": shown_prefix(key),
            "name": key.name,
            "user_id": key.user_id,
            "role": role,
            "organization_id": key.organization_id,
            "expires_at": pb.iso(key.expires_at),
            "created_at": pb.iso(key.created_at),
            "revoked_at": pb.iso(key.revoked_at),
        }
        for key, role in rows
    ]


def shown_prefix(key: ApiKey) -> str:
    """The listed prefix of a stored key: its stored prefix, unless that is the whole key."""
    return key_prefix(key.prefix) if hash_key(key.prefix) == key.key_hash else key.prefix


async def revoke_key(
    sessions: Sessions, key_id: str | None = None, key: str | None = None
) -> dict[str, str | None] | None:
    """Revoke an API key named by its id (`key_...`, printed by add-member) or by the key itself.

    Returns {key_id, user_id, revoked_at} (ISO 8601; the first revocation's time when it was
    revoked before), or None when no such key exists. A running gateway stops accepting the
    key within LOOPLINE_AUTH_CACHE_TTL_S (its API-key cache).

    Raises:
        AdminError: neither a key id nor a key was given (both empty).
    """
    if not key_id and not key:
        raise AdminError("no API key given: write the key to standard input, or pass --key-id")
    async with sessions() as session, session.begin():
        query = (
            select(ApiKey).where(ApiKey.id == key_id)
            if key_id
            else select(ApiKey).where(ApiKey.key_hash == hash_key(key or ""))
        )
        found = (await session.execute(query)).scalars().first()
        if found is None:
            return None
        if found.revoked_at is None:
            found.revoked_at = datetime.datetime.now(datetime.UTC)
        return {
            "key_id": found.id,
            "user_id": found.user_id,
            "revoked_at": pb.iso(found.revoked_at),
        }


__all__ = [
    "ASSISTANT_ROLES",
    "MEMBER_ROLES",
    "ROLE_REQUIRED",
    "AdminError",
    "AuthError",
    "Authenticator",
    "Principal",
    "check_dev_key",
    "create_member",
    "hash_key",
    "key_prefix",
    "list_keys",
    "new_key",
    "revoke_key",
    "seed_dev",
    "shown_prefix",
]
