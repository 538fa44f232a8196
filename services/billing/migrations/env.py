"""Alembic environment of the billing service (one history: services/billing/migrations)."""

from services.billing.models import Base
from services.common.alembic_env import run_migrations

run_migrations(Base.metadata)
