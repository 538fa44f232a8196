"""Who created a credential or a knowledge base (NULL for rows created before it was recorded).

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("credentials", schema=None) as batch_op:
        batch_op.add_column(sa.Column("created_by", sa.String(length=64), nullable=True))
    with op.batch_alter_table("knowledge_bases", schema=None) as batch_op:
        batch_op.add_column(sa.Column("created_by", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("knowledge_bases", schema=None) as batch_op:
        batch_op.drop_column("created_by")
    with op.batch_alter_table("credentials", schema=None) as batch_op:
        batch_op.drop_column("created_by")
