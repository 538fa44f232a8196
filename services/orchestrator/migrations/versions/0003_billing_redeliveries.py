"""billing redeliveries: billing calls that failed their quick retries, kept until delivered

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 04:20:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "billing_redeliveries",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("method", sa.String(length=64), nullable=False),
        sa.Column("request", sa.LargeBinary(), nullable=False),
        sa.Column("failure_message", sa.String(length=200), nullable=False),
        sa.Column("log_fields", sa.JSON(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        "ix_billing_redeliveries_next_attempt_at",
        "billing_redeliveries",
        ["next_attempt_at"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index("ix_billing_redeliveries_next_attempt_at", table_name="billing_redeliveries")
    op.drop_table("billing_redeliveries")
