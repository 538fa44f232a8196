"""Billing tables (SQLAlchemy 2 declarative, the service's own `Base`).

Money and credits are integers everywhere: run credits, millicredits (1/1000 of a run
credit, for token usage) and wallet minor units (cents). No floats touch a balance.

Balance columns on `accounts` are kept in step with the append-only `ledger_entries`
in the same transaction:

- `allowance_used` = -(sum of `run_charge` entries in unit "credit" since `period_start`)
- `wallet_balance_minor` = sum of every entry in unit "minor"
- `usage_millicredits` = -(sum of `token_usage` entries since `period_start`)

Holds are not ledger postings: `allowance_reserved` / `wallet_reserved_minor` are the
sums of the HELD reservations funded by each source. The invariants
`allowance_used + allowance_reserved <= period_allowance` and
`wallet_reserved_minor <= wallet_balance_minor` (both never negative) are enforced by
conditional UPDATEs (`services.billing.statements`), so they hold under concurrency.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Date,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    String,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator


class UTCDateTime(TypeDecorator):
    """A timezone-aware UTC datetime on every backend (SQLite stores naive UTC)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=datetime.UTC)
        value = value.astimezone(datetime.UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        if value is None:
            return None
        return (
            value.replace(tzinfo=datetime.UTC)
            if value.tzinfo is None
            else value.astimezone(datetime.UTC)
        )


def utcnow() -> datetime.datetime:
    """The current time, timezone-aware UTC."""
    return datetime.datetime.now(datetime.UTC)


def month_start(day: datetime.date) -> datetime.date:
    """The first day of `day`'s calendar month (billing periods are calendar months, UTC)."""
    return day.replace(day=1)


def new_id(prefix: str) -> str:
    """`prefix` + "_" + 32 random hex digits (128 bits from os.urandom, like uuid4().hex)."""
    return f"{prefix}_{os.urandom(16).hex()}"


class Base(DeclarativeBase):
    """Declarative base of the billing tables (one Alembic history: services/billing/migrations)."""


# Reservation states (stored lower-case; mirrored by loopline.billing.v1.ReservationState).
HELD, CHARGED, RELEASED, EXPIRED = "held", "charged", "released", "expired"
# Funding sources of a reservation.
ALLOWANCE, WALLET = "allowance", "wallet"
# Ledger units.
UNIT_CREDIT, UNIT_MINOR, UNIT_MILLICREDIT = "credit", "minor", "millicredit"


class Plan(Base):
    """A billing plan, synced from plans.toml.

    `rate_limits` maps a rate class to a `limits` expression ("600/minute");
    `max_runs_per_day` NULL means no daily quota.
    """

    __tablename__ = "plans"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    monthly_run_credits: Mapped[int] = mapped_column(BigInteger, nullable=False)
    max_runs_per_day: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    rate_limits: Mapped[dict[str, str]] = mapped_column(JSON, nullable=False, default=dict)
    wallet_overage: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    wallet_price_minor: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    updated_at: Mapped[datetime.datetime] = mapped_column(
        UTCDateTime, nullable=False, default=utcnow
    )


class Account(Base):
    """An organization's billing account: plan, period allowance, wallet and holds.

    `period_allowance` = the plan's monthly run credits + `granted_credits` for the
    current period (calendar month UTC starting `period_start`). `quota_day`/`runs_today`
    count admitted runs of the current UTC day for the plan's daily quota.
    """

    __tablename__ = "accounts"

    org_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    plan: Mapped[str] = mapped_column(ForeignKey("plans.name"), nullable=False)
    period_start: Mapped[datetime.date] = mapped_column(Date, nullable=False)
    period_allowance: Mapped[int] = mapped_column(BigInteger, nullable=False)
    granted_credits: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    allowance_used: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    allowance_reserved: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    wallet_balance_minor: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    wallet_reserved_minor: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    usage_millicredits: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    quota_day: Mapped[str] = mapped_column(String(10), nullable=False, default="")
    runs_today: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    created_at: Mapped[datetime.datetime] = mapped_column(
        UTCDateTime, nullable=False, default=utcnow
    )


class Reservation(Base):
    """A hold of credits for one admission, idempotent by (org_id, turn_key).

    State machine: held -> charged | released | expired, each transition at most once.
    `wallet_minor` is the wallet amount held when `funding` is "wallet" (else 0).
    """

    __tablename__ = "reservations"
    __table_args__ = (
        UniqueConstraint("org_id", "turn_key", name="uq_reservations_org_turn_key"),
        Index("ix_reservations_state_expires_at", "state", "expires_at"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    org_id: Mapped[str] = mapped_column(ForeignKey("accounts.org_id"), nullable=False)
    turn_key: Mapped[str] = mapped_column(String(255), nullable=False)
    usage_type: Mapped[str] = mapped_column(String(64), nullable=False)
    rate_class: Mapped[str] = mapped_column(String(64), nullable=False)
    credits: Mapped[int] = mapped_column(BigInteger, nullable=False)
    funding: Mapped[str] = mapped_column(String(16), nullable=False)
    wallet_minor: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    quota_day: Mapped[str] = mapped_column(String(10), nullable=False, default="")
    state: Mapped[str] = mapped_column(String(16), nullable=False, default=HELD)
    created_at: Mapped[datetime.datetime] = mapped_column(
        UTCDateTime, nullable=False, default=utcnow
    )
    expires_at: Mapped[datetime.datetime] = mapped_column(UTCDateTime, nullable=False)
    resolved_at: Mapped[datetime.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    release_reason: Mapped[str | None] = mapped_column(String(255), nullable=True)


class LedgerEntry(Base):
    """An append-only posting; never updated nor deleted.

    `amount` is signed (debits negative) in `unit`: "credit" (run credits), "minor"
    (wallet minor units) or "millicredit" (token usage). `idempotency_key` is unique:
    "charge:{reservation_id}", "usage:{run_id}:{call_index}", "grant:{uuid}", "topup:{uuid}".
    """

    __tablename__ = "ledger_entries"
    __table_args__ = (
        UniqueConstraint("idempotency_key", name="uq_ledger_entries_idempotency_key"),
        Index("ix_ledger_entries_org_created", "org_id", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    idempotency_key: Mapped[str] = mapped_column(String(255), nullable=False)
    org_id: Mapped[str] = mapped_column(ForeignKey("accounts.org_id"), nullable=False)
    kind: Mapped[str] = mapped_column(String(32), nullable=False)
    unit: Mapped[str] = mapped_column(String(16), nullable=False)
    amount: Mapped[int] = mapped_column(BigInteger, nullable=False)
    reservation_id: Mapped[str | None] = mapped_column(ForeignKey("reservations.id"), nullable=True)
    usage_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    note: Mapped[str | None] = mapped_column(String(255), nullable=True)
    created_at: Mapped[datetime.datetime] = mapped_column(
        UTCDateTime, nullable=False, default=utcnow
    )


class UsageRecord(Base):
    """The token usage of one model call, idempotent by (run_id, call_index).

    `input_tokens` counts uncached input only; cache reads/writes are separate columns.
    `millicredits` is 0 for bring-your-own-key calls.
    """

    __tablename__ = "usage_records"
    __table_args__ = (UniqueConstraint("run_id", "call_index", name="uq_usage_records_run_call"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    org_id: Mapped[str] = mapped_column(ForeignKey("accounts.org_id"), nullable=False)
    run_id: Mapped[str] = mapped_column(String(128), nullable=False)
    call_index: Mapped[int] = mapped_column(Integer, nullable=False)
    chat_id: Mapped[str] = mapped_column(String(128), nullable=False, default="")
    provider_id: Mapped[str] = mapped_column(String(64), nullable=False)
    model_id: Mapped[str] = mapped_column(String(128), nullable=False)
    input_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    output_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    cache_read_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    cache_write_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    byok: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    estimated: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    millicredits: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    created_at: Mapped[datetime.datetime] = mapped_column(
        UTCDateTime, nullable=False, default=utcnow
    )
