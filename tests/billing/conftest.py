"""Fixtures of the billing tests: a real grpc.aio BillingServer on port 0 over SQLite in tmp_path.

Settings and test plans come from tests.billing.helpers.make_settings.
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
from tests.billing.helpers import make_settings


@pytest.fixture
def settings(tmp_path: pathlib.Path, request: pytest.FixtureRequest) -> BillingSettings:
    """Test server settings: SQLite in tmp_path, or with LOOPLINE_TEST_BACKEND=postgres
    (`make test-pg`) a fresh PostgreSQL database, so every server test also runs billing's
    PostgreSQL statements."""
    if os.environ.get("LOOPLINE_TEST_BACKEND", "sqlite").strip().lower() == "postgres":
        return make_settings(tmp_path, billing_database_url=request.getfixturevalue("postgres_url"))
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
