"""Billing replicas that start together each write the plan file's plans (Procfile.scale)."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import select

from services.billing.models import Base, Plan
from services.billing.plans import PlanTerms, sync_plans
from services.common import db
from tests.conftest import postgres_url, selected_backend


def _terms(credits: int) -> dict[str, PlanTerms]:
    return {
        name: PlanTerms(
            name=name,
            monthly_run_credits=credits,
            max_runs_per_day=50,
            rate_limits={},
            wallet_overage=False,
            wallet_price_minor=0,
        )
        for name in ("free", "developer", "team")
    }


async def test_two_replicas_writing_the_plans_at_once_both_start_and_the_file_wins(tmp_path):
    """Two billing replicas started together on a fresh database both start: the plans are
    written with INSERT ... ON CONFLICT DO UPDATE, so two that both find no plan and insert it
    do not meet a unique violation on plans_pkey."""
    if selected_backend() == "postgres":
        pytest.skip("runs on the SQLite pass; the PostgreSQL pass below")
    url = f"sqlite+aiosqlite:///{tmp_path / 'billing.db'}"
    await _race(url)


async def test_two_replicas_writing_the_plans_at_once_on_postgresql():
    if selected_backend() != "postgres":
        pytest.skip("PostgreSQL pass only (make test-pg)")
    import uuid

    import asyncpg

    base = postgres_url().replace("postgresql+asyncpg://", "postgresql://")
    name = f"plans_race_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(base)
    await admin.execute(f"CREATE DATABASE {name}")
    try:
        await _race(postgres_url().rsplit("/", 1)[0] + f"/{name}")
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.close()


async def _race(url: str) -> None:
    engines = [db.make_engine(url, 2) for _ in range(2)]
    try:
        async with engines[0].begin() as connection:
            await connection.run_sync(Base.metadata.create_all)
        for credits in (100, 200, 300):  # fresh plans, then updates of existing ones, all at once
            await asyncio.gather(
                *(sync_plans(db.sessionmaker(engine), _terms(credits)) for engine in engines)
            )
        async with db.sessionmaker(engines[0])() as session:
            plans = {
                plan.name: plan.monthly_run_credits
                for plan in (await session.execute(select(Plan))).scalars()
            }
        assert plans == {"free": 300, "developer": 300, "team": 300}
    finally:
        for engine in engines:
            await engine.dispose()
