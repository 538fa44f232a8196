"""The caller's account in the gateway database: its organizations, and the API keys the
`/api-keys` routes manage (the store behind routes/account.py and routes/api_keys.py).

Which keys a caller sees in an organization: the keys bound to it (any member's) and, when the
caller's own key is unbound, the caller's own unbound keys (made by the CLI, valid in every
organization of their user). A caller whose key is bound to the organization sees only the keys
bound to it: a bound key reaches nothing else of its user. A key outside that set is treated as
missing. Only an owner revokes a key of another owner of the organization (`OwnersKey`, 403 for
an admin); an admin revokes the other keys it sees, and anyone its own.

At most `cap` active keys (neither revoked nor expired) are bound to one organization;
`create_key` counts them in the transaction that adds one, after locking the organization's row
(PostgreSQL; SQLite has one writer at a time and the count follows the insert), so concurrent
creations cannot pass the cap together.
"""

from __future__ import annotations

import datetime
import uuid
from dataclasses import dataclass

from sqlalchemy import ColumnElement, and_, func, or_, select

from services.common import db
from services.gateway.identity import Principal, Sessions, hash_key, key_prefix, new_key
from services.gateway.models import ApiKey, Membership, Organization, User, utcnow


@dataclass(frozen=True)
class Joined:
    """An organization the user belongs to, with the user's role there."""

    id: str
    name: str
    role: str


class OwnersKey(Exception):
    """A caller other than an owner asked to revoke a key of an owner of the organization (403)."""


class KeyCapReached(Exception):
    """The organization already has `cap` active API keys bound to it (409)."""

    def __init__(self, cap: int) -> None:
        super().__init__(cap)
        self.cap = cap


async def profile(
    sessions: Sessions, user_id: str, only: str | None = None
) -> tuple[str | None, list[Joined]]:
    """The user's email and organizations (oldest organization first); with `only`, just that
    organization when the user belongs to it (a key bound to one organization sees that one)."""
    query = (
        select(Organization.id, Organization.name, Membership.role)
        .join(Membership, Membership.organization_id == Organization.id)
        .where(Membership.user_id == user_id)
        .order_by(Organization.created_at, Organization.id)
    )
    if only is not None:
        query = query.where(Organization.id == only)
    async with sessions() as session:
        email = (
            await session.execute(select(User.email).where(User.id == user_id))
        ).scalar_one_or_none()
        rows = (await session.execute(query)).all()
    return email, [Joined(id=row[0], name=row[1], role=row[2]) for row in rows]


def primary(joined: list[Joined], header: str, bound: str | None) -> str | None:
    """The primary organization: the request's X-Organization-ID when given, else the key's
    bound organization, else the oldest one where the user is owner, else the first (None when
    the user belongs to none)."""
    if header:
        return header
    if bound is not None:
        return bound
    owned = [org.id for org in joined if org.role == "owner"]
    if owned:
        return owned[0]
    return joined[0].id if joined else None


def _visible(who: Principal) -> ColumnElement[bool]:
    """The keys `who` sees in its organization (see the module docstring)."""
    bound_here = ApiKey.organization_id == who.organization_id
    if who.key_organization_id is not None:
        return bound_here
    return or_(bound_here, and_(ApiKey.organization_id.is_(None), ApiKey.user_id == who.user_id))


def _active(now: datetime.datetime) -> ColumnElement[bool]:
    return and_(
        ApiKey.revoked_at.is_(None), or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > now)
    )


async def create_key(
    sessions: Sessions,
    *,
    user_id: str,
    organization_id: str,
    name: str,
    expires_at: datetime.datetime | None,
    rate_limit_per_minute: int | None,
    cap: int,
) -> tuple[ApiKey, str]:
    """A new key of `user_id` bound to `organization_id`: (its row, the key itself, which is
    never stored). Raises KeyCapReached when the organization has `cap` active keys already."""
    key = new_key()
    row = ApiKey(
        id=f"key_{uuid.uuid4().hex[:16]}",
        user_id=user_id,
        key_hash=hash_key(key),
        prefix=key_prefix(key),
        name=name,
        created_at=utcnow(),
        organization_id=organization_id,
        expires_at=expires_at,
        rate_limit_per_minute=rate_limit_per_minute,
    )
    async with sessions() as session, session.begin():
        # one creation per organization at a time on PostgreSQL (SQLite ignores FOR UPDATE)
        await session.execute(
            select(Organization.id).where(Organization.id == organization_id).with_for_update()
        )
        session.add(row)
        await session.flush()
        active = (
            await session.execute(
                select(func.count())
                .select_from(ApiKey)
                .where(ApiKey.organization_id == organization_id, _active(row.created_at))
            )
        ).scalar_one()
        if active > cap:
            raise KeyCapReached(cap)  # the transaction is rolled back
    return row, key


async def visible_keys(sessions: Sessions, who: Principal, include_revoked: bool) -> list[ApiKey]:
    """The keys `who` sees in its organization, newest first (revoked ones only with
    `include_revoked`)."""
    query = select(ApiKey).where(_visible(who))
    if not include_revoked:
        query = query.where(ApiKey.revoked_at.is_(None))
    async with sessions() as session:
        return list(
            (await session.execute(query.order_by(ApiKey.created_at.desc(), ApiKey.id.desc())))
            .scalars()
            .all()
        )


async def visible_key(sessions: Sessions, who: Principal, key_id: str) -> ApiKey | None:
    """The key `key_id` when `who` sees it in its organization, else None."""
    async with sessions() as session:
        return (
            await session.execute(select(ApiKey).where(ApiKey.id == key_id, _visible(who)))
        ).scalar_one_or_none()


async def revoke_visible(sessions: Sessions, who: Principal, key_id: str) -> ApiKey | None:
    """Revoke the key `key_id` when `who` sees it in its organization (idempotent: a revoked key
    keeps its first revocation time); None when `who` does not see it. Raises OwnersKey when the
    key is another user's who is an owner of the organization and `who` is not an owner."""
    async with sessions() as session, session.begin():
        row = (
            await session.execute(select(ApiKey).where(ApiKey.id == key_id, _visible(who)))
        ).scalar_one_or_none()
        if row is None:
            return None
        if who.role != "owner" and row.user_id != who.user_id:
            role = (
                await session.execute(
                    select(Membership.role).where(
                        Membership.user_id == row.user_id,
                        Membership.organization_id == who.organization_id,
                    )
                )
            ).scalar()
            if role == "owner":
                raise OwnersKey(key_id)
        if row.revoked_at is None:
            row.revoked_at = utcnow()
    return row


def is_expired(key: ApiKey, now: datetime.datetime) -> bool:
    """Whether `key` has an expiry time that has passed."""
    expires = db.utc(key.expires_at)
    return expires is not None and expires <= now
