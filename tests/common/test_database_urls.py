"""Database URLs written the way managed PostgreSQL services document them.

`?sslmode=require` (libpq's parameter) made every service and admin command end in a
`TypeError: connect() got an unexpected keyword argument 'sslmode'` traceback: SQLAlchemy's
asyncpg dialect hands query parameters to asyncpg.connect(), which calls it `ssl`.
"""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from services.common import db
from tests.conftest import postgres_databases, release_databases, selected_backend


@pytest.mark.parametrize(
    "url,expected",
    [
        (
            "postgresql+asyncpg://u:p@h/d?sslmode=require",
            "postgresql+asyncpg://u:p@h/d?ssl=require",
        ),
        (
            "postgresql+asyncpg://u:p@h/d?ssl=verify-full",
            "postgresql+asyncpg://u:p@h/d?ssl=verify-full",
        ),
        ("postgresql+asyncpg://u:p@h/d", "postgresql+asyncpg://u:p@h/d"),
        ("sqlite+aiosqlite:///x.db?sslmode=require", "sqlite+aiosqlite:///x.db?sslmode=require"),
    ],
)
def test_libpq_sslmode_becomes_asyncpg_ssl(url, expected):
    assert db.engine_url(url).render_as_string(hide_password=False) == expected


async def test_an_engine_and_a_migration_take_a_url_with_sslmode():
    if selected_backend() != "postgres":
        pytest.skip("needs the PostgreSQL backend")
    urls = await postgres_databases()
    try:
        url = (
            make_url(urls["billing"])
            .update_query_dict({"sslmode": "disable"})
            .render_as_string(hide_password=False)
        )
        engine = db.make_engine(url)
        try:
            async with engine.connect() as connection:
                assert (await connection.execute(text("SELECT 1"))).scalar() == 1
        finally:
            await engine.dispose()
        await db.migrate_async("billing", url)  # already at head: connects and does nothing
    finally:
        release_databases(list(urls.values()))
