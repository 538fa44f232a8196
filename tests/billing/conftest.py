"""Fixtures of the billing tests: a real grpc.aio BillingServer on port 0 over SQLite in tmp_path.

Test plans are the shipped plans.toml plus small plans that make each layer easy to reach.
`postgres_url` creates a uniquely named PostgreSQL database (dropped afterwards) when
LOOPLINE_TEST_POSTGRES_URL is set, e.g. postgresql+asyncpg://postgres@127.0.0.1:5432/test.
"""

from __future__ import annotations

import os
import pathlib
import uuid
from collections.abc import AsyncIterator

import asyncpg
import grpc
import pytest
from sqlalchemy.engine import make_url

from loopline.billing.v1 import billing_pb2_grpc
from services.billing.config import BillingSettings
from services.billing.server import BillingServer

SHIPPED_PLANS = pathlib.Path(__file__).resolve().parents[2] / "services" / "billing" / "plans.toml"

TEST_PLANS = """
# 7 run credits, nothing else: the concurrency plan.
[plans.seven]
monthly_run_credits = 7
wallet_overage = false
wallet_price_minor = 0

# No allowance; every run is paid from the wallet at 5 minor units a credit.
[plans.wallet_only]
monthly_run_credits = 0
wallet_overage = true
wallet_price_minor = 5

# Two runs a day.
[plans.two_a_day]
monthly_run_credits = 100
max_runs_per_day = 2
wallet_overage = false
wallet_price_minor = 0

# Three sync_exec admissions a minute.
[plans.three_a_minute]
monthly_run_credits = 100
wallet_overage = false
wallet_price_minor = 0
[plans.three_a_minute.rate_limits]
sync_exec = "3/minute"

# Every layer would refuse: shows the order rate -> quota -> credit.
[plans.all_closed]
monthly_run_credits = 0
max_runs_per_day = 0
wallet_overage = false
wallet_price_minor = 0
[plans.all_closed.rate_limits]
sync_exec = "1/minute"

# The state machine's plan: 3 allowance credits, then the wallet.
[plans.machine]
monthly_run_credits = 3
wallet_overage = true
wallet_price_minor = 5
"""


def make_settings(tmp_path: pathlib.Path, **overrides: object) -> BillingSettings:
    """Settings for a test server: port 0, SQLite in `tmp_path`, no background sweeper."""
    plans = tmp_path / "plans.toml"
    if not plans.exists():
        plans.write_text(SHIPPED_PLANS.read_text() + TEST_PLANS)
    values: dict[str, object] = {
        "data_dir": tmp_path,
        "billing_port": 0,
        "billing_sweep_interval_s": 0,
        "billing_plans_path": plans,
        "billing_rate_limit_storage_url": "memory://",
    }
    values.update(overrides)
    return BillingSettings(**values)


@pytest.fixture
def settings(tmp_path: pathlib.Path) -> BillingSettings:
    return make_settings(tmp_path)


@pytest.fixture
async def server(settings: BillingSettings) -> AsyncIterator[BillingServer]:
    started = await BillingServer.start(settings)
    try:
        yield started
    finally:
        await started.stop(0)


@pytest.fixture
async def stub(server: BillingServer) -> AsyncIterator[billing_pb2_grpc.BillingServiceStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield billing_pb2_grpc.BillingServiceStub(channel)


@pytest.fixture
def org() -> str:
    return f"org_{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def postgres_url() -> AsyncIterator[str]:
    """A fresh PostgreSQL database for one test (skipped without LOOPLINE_TEST_POSTGRES_URL)."""
    base = os.environ.get("LOOPLINE_TEST_POSTGRES_URL")
    if not base:
        pytest.skip("LOOPLINE_TEST_POSTGRES_URL is not set")
    url = make_url(base)
    name = f"loopline_billing_test_{uuid.uuid4().hex[:12]}"

    async def admin_connection() -> asyncpg.Connection:
        return await asyncpg.connect(
            host=url.host or "127.0.0.1",
            port=url.port or 5432,
            user=url.username,
            password=url.password,
            database=url.database or "postgres",
        )

    connection = await admin_connection()
    try:
        await connection.execute(f'CREATE DATABASE "{name}"')
    finally:
        await connection.close()
    try:
        yield url.set(database=name).render_as_string(hide_password=False)
    finally:
        connection = await admin_connection()
        try:
            await connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await connection.close()
