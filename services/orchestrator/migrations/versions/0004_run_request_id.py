"""run request_id: the turn start's idempotency key (StartTurnRequest.request_id, AIP-155)

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 19:50:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("request_id", sa.String(length=64), nullable=True))
    op.create_index("ix_runs_request_id", "runs", ["request_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_runs_request_id", table_name="runs")
    op.drop_column("runs", "request_id")
