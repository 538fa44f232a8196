"""run archive due: runs.archive_due marks a run whose end is stored but whose event log's end
and archive are not yet (a durable log: Redis); a replica that dies in between leaves it for
`RunSupervisor.settle_ended` instead of an open stream no one ends (partial index: only due runs)

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 04:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("archive_due", sa.DateTime(timezone=True), nullable=True))
    op.create_index(
        "ix_runs_archive_due",
        "runs",
        ["archive_due"],
        unique=False,
        sqlite_where=sa.text("archive_due IS NOT NULL"),
        postgresql_where=sa.text("archive_due IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_runs_archive_due", table_name="runs")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("archive_due")
