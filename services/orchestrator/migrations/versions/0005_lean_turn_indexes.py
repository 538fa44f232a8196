"""lean turn indexes: drop ix_chats_organization_id (ix_chats_org_kind_created serves every
lookup by organization), and make ix_runs_request_id partial (request_id IS NOT NULL), so a
turn writes two index entries fewer (each is a page written per transaction)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 01:10:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_chats_organization_id", table_name="chats")
    op.drop_index("ix_runs_request_id", table_name="runs")
    op.create_index(
        "ix_runs_request_id",
        "runs",
        ["request_id"],
        unique=False,
        sqlite_where=sa.text("request_id IS NOT NULL"),
        postgresql_where=sa.text("request_id IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_runs_request_id", table_name="runs")
    op.create_index("ix_runs_request_id", "runs", ["request_id"], unique=False)
    op.create_index("ix_chats_organization_id", "chats", ["organization_id"], unique=False)
