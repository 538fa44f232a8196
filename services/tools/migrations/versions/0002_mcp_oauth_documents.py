"""MCP discovery on credentials, OAuth2 states, document size and token count.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("credentials", schema=None) as batch_op:
        batch_op.add_column(sa.Column("discovery", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("discovered_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("knowledge_documents", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("file_size_bytes", sa.Integer(), nullable=False, server_default="0")
        )
        batch_op.add_column(
            sa.Column("token_count", sa.Integer(), nullable=False, server_default="0")
        )
    op.create_table(
        "oauth_states",
        sa.Column("state", sa.String(length=64), nullable=False),
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("user_id", sa.String(length=64), nullable=False),
        sa.Column("integration", sa.String(length=100), nullable=False),
        sa.Column("encrypted_verifier", sa.Text(), nullable=False),
        sa.Column("redirect_uri", sa.Text(), nullable=False),
        sa.Column("scope", sa.Text(), nullable=False),
        sa.Column("display_name", sa.String(length=200), nullable=False),
        sa.Column("make_default", sa.Boolean(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("state"),
    )


def downgrade() -> None:
    op.drop_table("oauth_states")
    with op.batch_alter_table("knowledge_documents", schema=None) as batch_op:
        batch_op.drop_column("token_count")
        batch_op.drop_column("file_size_bytes")
    with op.batch_alter_table("credentials", schema=None) as batch_op:
        batch_op.drop_column("discovered_at")
        batch_op.drop_column("discovery")
