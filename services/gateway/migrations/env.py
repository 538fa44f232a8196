"""Alembic environment of the gateway's database."""

from services.common.alembic_env import run_migrations
from services.gateway.models import Base

run_migrations(Base.metadata)
