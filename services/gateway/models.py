"""The gateway's identity tables: organizations, users, memberships (roles), API keys (hashed)."""

from __future__ import annotations

import datetime

from sqlalchemy import JSON, DateTime, ForeignKey, String, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime.datetime:
    """The current time, timezone-aware UTC."""
    return datetime.datetime.now(datetime.UTC)


class Base(DeclarativeBase):
    """Declarative base of the gateway's tables."""


class Organization(Base):
    """An organization (tenant)."""

    __tablename__ = "organizations"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # the saved default model {integration_name, provider_id, model_id, credential_id?} used when a
    # turn names none (DESIGN.md "Models"); None = the deployment's default
    default_llm: Mapped[dict | None] = mapped_column(JSON, nullable=True)


class User(Base):
    """A user who owns API keys and belongs to organizations."""

    __tablename__ = "users"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    email: Mapped[str] = mapped_column(String(320), unique=True)
    created_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Membership(Base):
    """A user's role in an organization: owner, admin or member."""

    __tablename__ = "memberships"
    __table_args__ = (UniqueConstraint("organization_id", "user_id"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    organization_id: Mapped[str] = mapped_column(ForeignKey("organizations.id", ondelete="CASCADE"))
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    role: Mapped[str] = mapped_column(String(16))


class ApiKey(Base):
    """An API key, stored only as its SHA-256 hash (the key itself is shown once, at creation).

    `organization_id` binds the key to one organization (keys made by POST /api-keys); a key
    without one (made by the CLI) works in every organization its user is a member of.
    `rate_limit_per_minute` is the key's own request limit (None: the deployment's);
    `last_used_at` is refreshed at most once a minute or so (identity.Authenticator).
    """

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    name: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime.datetime | None] = mapped_column(
        DateTime(timezone=True), nullable=True
    )
    organization_id: Mapped[str | None] = mapped_column(
        ForeignKey("organizations.id", ondelete="CASCADE"), nullable=True, index=True
    )
    expires_at: Mapped[datetime.datetime | None] = mapped_column(
        DateTime(timezone=True), nullable=True
    )
    last_used_at: Mapped[datetime.datetime | None] = mapped_column(
        DateTime(timezone=True), nullable=True
    )
    rate_limit_per_minute: Mapped[int | None] = mapped_column(nullable=True)


class IdempotencyRecord(Base):
    """A POST made with an `Idempotency-Key` header (AIP-155): its body hash and its response.

    The row is claimed (response empty) before the request runs and filled with the
    response when it succeeds; a failed request removes its claim so it can be retried.
    Rows older than `idempotency_ttl_s` are ignored and swept.
    """

    __tablename__ = "idempotency_records"

    organization_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    user_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    route: Mapped[str] = mapped_column(String(200))
    body_hash: Mapped[str] = mapped_column(String(64))
    status_code: Mapped[int | None] = mapped_column(nullable=True)
    response: Mapped[str | None] = mapped_column(String, nullable=True)
    created_at: Mapped[datetime.datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, index=True
    )
