"""Every service's Alembic migrations build exactly the tables its models declare."""

from __future__ import annotations

import importlib

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine

from services.common import db


@pytest.mark.parametrize("service", ["billing", "gateway", "orchestrator", "tools"])
def test_migrations_match_the_models(tmp_path, service):
    db.migrate(service, f"sqlite+aiosqlite:///{tmp_path / 'm.db'}")
    base = importlib.import_module(f"services.{service}.models").Base
    engine = create_engine(f"sqlite:///{tmp_path / 'm.db'}")
    with engine.connect() as connection:
        diff = compare_metadata(
            MigrationContext.configure(connection, opts={"compare_type": True}), base.metadata
        )
    engine.dispose()
    # the tools service's full-text index is an SQLite FTS5 virtual table (and its shadow
    # tables), created by its migration and not declared as a model (services/tools/knowledge.py)
    assert [
        d
        for d in diff
        if not (d[0] == "remove_table" and d[1].name.startswith("knowledge_chunks_fts"))
    ] == []
