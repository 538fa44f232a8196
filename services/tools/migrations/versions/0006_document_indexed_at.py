"""When a document's last chunk was embedded: `knowledge_documents.indexed_at`.

Documents already ready get their upload time (what the status route showed until now).

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("knowledge_documents", schema=None) as batch_op:
        batch_op.add_column(sa.Column("indexed_at", sa.DateTime(timezone=True), nullable=True))
    op.execute("UPDATE knowledge_documents SET indexed_at = created_at WHERE status = 'ready'")


def downgrade() -> None:
    with op.batch_alter_table("knowledge_documents", schema=None) as batch_op:
        batch_op.drop_column("indexed_at")
