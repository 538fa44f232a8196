"""billing initial schema: plans, accounts, reservations, ledger_entries, usage_records

Revision ID: 0001
Revises:
Create Date: 2026-11-30 10:16:20
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# One function: the first schema, every table of the service created in one step.
def upgrade() -> None:
    op.create_table(
        "plans",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("monthly_run_credits", sa.BigInteger(), nullable=False),
        sa.Column("max_runs_per_day", sa.BigInteger(), nullable=True),
        sa.Column("rate_limits", sa.JSON(), nullable=False),
        sa.Column("wallet_overage", sa.Boolean(), nullable=False),
        sa.Column("wallet_price_minor", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "accounts",
        sa.Column("org_id", sa.String(length=128), nullable=False),
        sa.Column("plan", sa.String(length=64), nullable=False),
        sa.Column("period_start", sa.Date(), nullable=False),
        sa.Column("period_allowance", sa.BigInteger(), nullable=False),
        sa.Column("granted_credits", sa.BigInteger(), nullable=False),
        sa.Column("allowance_used", sa.BigInteger(), nullable=False),
        sa.Column("allowance_reserved", sa.BigInteger(), nullable=False),
        sa.Column("wallet_balance_minor", sa.BigInteger(), nullable=False),
        sa.Column("wallet_reserved_minor", sa.BigInteger(), nullable=False),
        sa.Column("usage_millicredits", sa.BigInteger(), nullable=False),
        sa.Column("quota_day", sa.String(length=10), nullable=False),
        sa.Column("runs_today", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["plan"],
            ["plans.name"],
        ),
        sa.PrimaryKeyConstraint("org_id"),
    )
    op.create_table(
        "reservations",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("org_id", sa.String(length=128), nullable=False),
        sa.Column("turn_key", sa.String(length=255), nullable=False),
        sa.Column("usage_type", sa.String(length=64), nullable=False),
        sa.Column("rate_class", sa.String(length=64), nullable=False),
        sa.Column("credits", sa.BigInteger(), nullable=False),
        sa.Column("funding", sa.String(length=16), nullable=False),
        sa.Column("wallet_minor", sa.BigInteger(), nullable=False),
        sa.Column("quota_day", sa.String(length=10), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("resolved_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("release_reason", sa.String(length=255), nullable=True),
        sa.ForeignKeyConstraint(
            ["org_id"],
            ["accounts.org_id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("org_id", "turn_key", name="uq_reservations_org_turn_key"),
    )
    with op.batch_alter_table("reservations", schema=None) as batch_op:
        batch_op.create_index(
            "ix_reservations_state_expires_at", ["state", "expires_at"], unique=False
        )

    op.create_table(
        "usage_records",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("org_id", sa.String(length=128), nullable=False),
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("call_index", sa.Integer(), nullable=False),
        sa.Column("chat_id", sa.String(length=128), nullable=False),
        sa.Column("provider_id", sa.String(length=64), nullable=False),
        sa.Column("model_id", sa.String(length=128), nullable=False),
        sa.Column("input_tokens", sa.BigInteger(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cache_read_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cache_write_tokens", sa.BigInteger(), nullable=False),
        sa.Column("byok", sa.Boolean(), nullable=False),
        sa.Column("estimated", sa.Boolean(), nullable=False),
        sa.Column("millicredits", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["org_id"],
            ["accounts.org_id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("run_id", "call_index", name="uq_usage_records_run_call"),
    )
    op.create_table(
        "ledger_entries",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("idempotency_key", sa.String(length=255), nullable=False),
        sa.Column("org_id", sa.String(length=128), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("unit", sa.String(length=16), nullable=False),
        sa.Column("amount", sa.BigInteger(), nullable=False),
        sa.Column("reservation_id", sa.String(length=40), nullable=True),
        sa.Column("usage_id", sa.String(length=40), nullable=True),
        sa.Column("note", sa.String(length=255), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["org_id"],
            ["accounts.org_id"],
        ),
        sa.ForeignKeyConstraint(
            ["reservation_id"],
            ["reservations.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("idempotency_key", name="uq_ledger_entries_idempotency_key"),
    )
    with op.batch_alter_table("ledger_entries", schema=None) as batch_op:
        batch_op.create_index(
            "ix_ledger_entries_org_created", ["org_id", "created_at"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("ledger_entries", schema=None) as batch_op:
        batch_op.drop_index("ix_ledger_entries_org_created")

    op.drop_table("ledger_entries")
    op.drop_table("usage_records")
    with op.batch_alter_table("reservations", schema=None) as batch_op:
        batch_op.drop_index("ix_reservations_state_expires_at")

    op.drop_table("reservations")
    op.drop_table("accounts")
    op.drop_table("plans")
