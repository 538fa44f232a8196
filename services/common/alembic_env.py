"""The body every service's `migrations/env.py` runs: online migrations over an async engine."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import MetaData, pool
from sqlalchemy.engine import Connection

from services.common import db


def _do_run(connection: Connection, metadata: MetaData) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


async def _run_async(url: str, metadata: MetaData) -> None:
    engine = db.create_engine(url, poolclass=pool.NullPool)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_do_run, metadata)
            await connection.commit()
    finally:
        await engine.dispose()


def run_migrations(metadata: MetaData) -> None:
    """Run the migrations of the current Alembic context against its `sqlalchemy.url`."""
    url = context.config.get_main_option("sqlalchemy.url")
    if url is None:
        raise RuntimeError("the Alembic configuration has no sqlalchemy.url")
    if context.is_offline_mode():
        context.configure(url=url, target_metadata=metadata, literal_binds=True)
        with context.begin_transaction():
            context.run_migrations()
        return
    asyncio.run(_run_async(url, metadata))
