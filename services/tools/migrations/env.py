"""Alembic environment of the tools service (see services/common/alembic_env.py)."""

from services.common.alembic_env import run_migrations
from services.tools.models import Base

run_migrations(Base.metadata)
