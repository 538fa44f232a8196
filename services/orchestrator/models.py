"""The orchestrator's tables: chats, messages, runs, run events, interrupts.

Chats of both kinds share one store, told apart by `kind` (spec: "Storage and
execution model"); every query is scoped by kind and organization.
"""

from __future__ import annotations

import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime.datetime:
    """The current time, timezone-aware UTC."""
    return datetime.datetime.now(datetime.UTC)


class Base(DeclarativeBase):
    """Declarative base of the orchestrator's tables."""


class Chat(Base):
    """A conversation; its id is also its checkpoint thread id (thread_id == chat_id)."""

    __tablename__ = "chats"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    organization_id: Mapped[str] = mapped_column(
        String(64)
    )  # looked up through ix_chats_org_kind_created
    user_id: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(16))
    title: Mapped[str] = mapped_column(String(64))
    workflow_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    running_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    deleted_at: Mapped[datetime.datetime | None] = mapped_column(
        DateTime(timezone=True), nullable=True
    )
    created_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    __table_args__ = (Index("ix_chats_org_kind_created", "organization_id", "kind", "created_at"),)


class Message(Base):
    """One entry of a chat's thread: a user, assistant or tool message, or a history marker.

    `content` is the text (user/assistant) or the JSON output (tool). `extra` holds
    `tool_calls` [{id, name, input}] of an assistant message, `tool_call_id` and
    `name` of a tool message, or `{request_id, kind}` of an `interrupted` marker.
    """

    __tablename__ = "messages"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(36), unique=True)
    chat_id: Mapped[str] = mapped_column(ForeignKey("chats.id", ondelete="CASCADE"), index=True)
    run_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    role: Mapped[str] = mapped_column(String(16))
    content: Mapped[Any] = mapped_column(JSON, nullable=True)
    extra: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Run(Base):
    """One execution of the loop. `durable_id` is the stable durable identifier of the spec.

    `lease_until` (UTC) is pushed forward by the replica whose loop runs the run (see
    `services/orchestrator/recovery.py`); NULL until the first renewal. `archive_due` (UTC) is
    set when a run's end is stored before its event log holds that end and is archived (a
    durable log: Redis) and cleared by the archive; a run still due once its lease lapsed lost
    its replica there, and `RunSupervisor.settle_ended` ends its log and archives it.
    """

    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    durable_id: Mapped[str] = mapped_column(String(64), unique=True)
    chat_id: Mapped[str] = mapped_column(ForeignKey("chats.id", ondelete="CASCADE"), index=True)
    organization_id: Mapped[str] = mapped_column(String(64))
    parent_run_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    status: Mapped[str] = mapped_column(String(16))
    llm: Mapped[dict[str, Any]] = mapped_column(JSON)
    reservation_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    usage: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # renewed by the replica running the loop; a `running` run past it is failed by the reaper
    lease_until: Mapped[datetime.datetime | None] = mapped_column(
        DateTime(timezone=True), nullable=True
    )
    # the turn start's idempotency key (StartTurnRequest.request_id, AIP-155); NULL: none
    request_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # the end is stored, its log's end and archive not yet (migration 0006); NULL: nothing due
    archive_due: Mapped[datetime.datetime | None] = mapped_column(
        DateTime(timezone=True), nullable=True
    )

    __table_args__ = (
        Index("ix_runs_status_lease", "status", "lease_until"),
        # partial: only the few runs whose archive is due have an entry (the settle pass's scan)
        Index(
            "ix_runs_archive_due",
            "archive_due",
            sqlite_where=text("archive_due IS NOT NULL"),
            postgresql_where=text("archive_due IS NOT NULL"),
        ),
        # partial: a turn started without a key (most) writes no index entry (migration 0005)
        Index(
            "ix_runs_request_id",
            "request_id",
            sqlite_where=text("request_id IS NOT NULL"),
            postgresql_where=text("request_id IS NOT NULL"),
        ),
    )


class RunEvent(Base):
    """A run's event, serialized `loopline.assistant.v1.Event`, kept after the run ends."""

    __tablename__ = "run_events"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    payload: Mapped[bytes] = mapped_column(LargeBinary)


class Interrupt(Base):
    """The audit row of a HITL question: outcome pending, answered, cancelled or expired."""

    __tablename__ = "interrupts"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)  # the request_id
    chat_id: Mapped[str] = mapped_column(ForeignKey("chats.id", ondelete="CASCADE"), index=True)
    run_id: Mapped[str] = mapped_column(String(36))
    tool_call_id: Mapped[str] = mapped_column(String(64))
    tool: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(32))
    request: Mapped[dict[str, Any]] = mapped_column(JSON)
    outcome: Mapped[str] = mapped_column(String(16))
    response: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    resumed_run_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    expires_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    resolved_at: Mapped[datetime.datetime | None] = mapped_column(
        DateTime(timezone=True), nullable=True
    )


class BillingRedelivery(Base):
    """A billing call kept until billing takes it: one that failed its quick retries, or one
    written in the transaction it belongs to (a transactional outbox: a turn start's run
    charge, a run end's usage records; `usage.StoredBatches`).

    `method` is the BillingService method (`ChargeBatch`, `RecordUsageBatch`,
    `RecordToolUsage`, `Release`) and `request` its serialized request; the calls are
    idempotent, so sending one twice only replays. `log_fields` are the ids logged if it is
    finally given up (one object per record). Written and sent by `usage.Redelivery` (in
    services/orchestrator/usage/redelivery.py), by any replica.
    """

    __tablename__ = "billing_redeliveries"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    method: Mapped[str] = mapped_column(String(64))
    request: Mapped[bytes] = mapped_column(LargeBinary)
    failure_message: Mapped[str] = mapped_column(String(200))
    log_fields: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    next_attempt_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), index=True)
