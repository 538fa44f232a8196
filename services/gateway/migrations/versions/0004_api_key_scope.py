"""api keys bound to an organization, with expiry, last use and their own rate limit

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-14 10:00:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.add_column(sa.Column("organization_id", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("rate_limit_per_minute", sa.Integer(), nullable=True))
        batch_op.create_index(
            batch_op.f("ix_api_keys_organization_id"), ["organization_id"], unique=False
        )
        batch_op.create_foreign_key(
            "fk_api_keys_organization_id_organizations",
            "organizations",
            ["organization_id"],
            ["id"],
            ondelete="CASCADE",
        )


def downgrade() -> None:
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.drop_constraint("fk_api_keys_organization_id_organizations", type_="foreignkey")
        batch_op.drop_index(batch_op.f("ix_api_keys_organization_id"))
        batch_op.drop_column("rate_limit_per_minute")
        batch_op.drop_column("last_used_at")
        batch_op.drop_column("expires_at")
        batch_op.drop_column("organization_id")
