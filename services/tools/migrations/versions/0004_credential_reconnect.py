"""An OAuth2 credential that must be connected again (its refresh was refused): `needs_reconnect`.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("credentials", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "needs_reconnect", sa.Boolean(), nullable=False, server_default=sa.text("false")
            )
        )


def downgrade() -> None:
    with op.batch_alter_table("credentials", schema=None) as batch_op:
        batch_op.drop_column("needs_reconnect")
