"""Alembic environment of the orchestrator's database."""

from services.common.alembic_env import run_migrations
from services.orchestrator.models import Base

run_migrations(Base.metadata)
