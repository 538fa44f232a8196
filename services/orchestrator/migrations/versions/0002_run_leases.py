"""run leases: runs.lease_until, renewed by the replica running the loop (crash recovery)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 11:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True))
        batch_op.create_index("ix_runs_status_lease", ["status", "lease_until"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_index("ix_runs_status_lease")
        batch_op.drop_column("lease_until")
