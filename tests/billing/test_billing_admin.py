"""`python -m services.billing admin ...` and the migration history."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine

from services.billing.__main__ import _parser, admin
from services.billing.models import Base
from services.common import db


async def _admin(settings, *argv: str) -> tuple[int, dict]:
    await db.migrate_async("billing", settings.billing_database_url)  # the services created their database
    return await admin(settings, _parser().parse_args(["admin", *argv]))


async def test_admin_commands_adjust_the_account_and_show_the_ledger(settings):
    code, view = await _admin(settings, "set-plan", "--org", "acme", "--plan", "team")
    assert code == 0 and view["plan"]["name"] == "team"
    assert view["allowance"]["period_allowance"] == 10000
    code, view = await _admin(settings, "grant-credits", "--org", "acme", "--credits", "25", "--note", "goodwill")
    assert view["allowance"]["period_allowance"] == 10025 and view["allowance"]["granted_credits"] == 25
    code, view = await _admin(settings, "top-up", "--org", "acme", "--minor-units", "1500", "--idempotency-key", "inv-1")
    code, view = await _admin(settings, "top-up", "--org", "acme", "--minor-units", "1500", "--idempotency-key", "inv-1")
    assert view["wallet"]["balance_minor"] == 1500  # the same idempotency key posts once
    kinds = [(e["kind"], e["unit"], e["amount"]) for e in view["recent_ledger_entries"]]
    assert sorted(kinds) == [("grant", "credit", 25), ("top_up", "minor", 1500)]


async def test_money_for_an_organization_without_an_account_needs_create_account(settings):
    # second fresh-eyes test: a mistyped --org silently got a new account and the money
    code, document = await _admin(settings, "top-up", "--org", "org_typo", "--minor-units", "500")
    assert code == 1 and "no billing account" in document["error"]
    assert (await _admin(settings, "show", "--org", "org_typo"))[0] == 1  # nothing was created
    code, view = await _admin(settings, "grant-credits", "--org", "org_new", "--credits", "5", "--create-account")
    assert code == 0 and view["allowance"]["granted_credits"] == 5


async def test_an_admin_idempotency_key_reused_for_another_amount_is_refused(settings):
    await _admin(settings, "set-plan", "--org", "acme", "--plan", "team")
    assert (await _admin(settings, "top-up", "--org", "acme", "--minor-units", "7", "--idempotency-key", "inv-42"))[0] == 0
    code, document = await _admin(settings, "top-up", "--org", "acme", "--minor-units", "9", "--idempotency-key", "inv-42")
    assert code == 1 and "already used" in document["error"]
    code, view = await _admin(settings, "top-up", "--org", "acme", "--minor-units", "7", "--idempotency-key", "inv-42")
    assert code == 0 and view["wallet"]["balance_minor"] == 7  # the same posting again: a replay


async def test_admin_rejects_unknown_plans_and_unknown_orgs(settings):
    assert (await _admin(settings, "set-plan", "--org", "acme", "--plan", "platinum"))[0] == 1
    code, document = await _admin(settings, "show", "--org", "ghost")
    assert code == 1 and "no billing account" in document["error"]


async def test_seed_dev_is_idempotent(settings):
    for _ in range(2):
        code, view = await _admin(settings, "seed-dev", "--org", "demo")
    assert code == 0
    assert view["plan"]["name"] == "developer" and view["allowance"]["available"] == 1000
    assert view["wallet"]["balance_minor"] == 1000
    assert len(view["recent_ledger_entries"]) == 1


async def test_seed_dev_keeps_the_plan_an_operator_set(settings):
    """Bug (fresh-eyes test): `make run` runs seed-dev at every start, and it put the development
    organization back on the developer plan after an operator's `set-plan --plan team`."""
    await _admin(settings, "seed-dev", "--org", "demo")
    await _admin(settings, "set-plan", "--org", "demo", "--plan", "team")
    code, view = await _admin(settings, "seed-dev", "--org", "demo")
    assert code == 0 and view["plan"]["name"] == "team"
    assert view["wallet"]["balance_minor"] == 1000  # the one-time top-up is not repeated either


async def test_admin_refuses_a_database_the_services_never_created(settings):
    """Bug (fresh-eyes test): an admin command run without the services' LOOPLINE_DATA_DIR
    created and migrated a new ./var/billing.db, topped up an account there and exited 0."""
    path = db.missing_sqlite_file(settings.billing_database_url)
    if path is None:
        return  # PostgreSQL: the database exists (the fixture made it)
    args = _parser().parse_args(["admin", "top-up", "--org", "acme", "--minor-units", "5000"])
    code, document = await admin(settings, args)
    assert code == 1 and "no billing database" in document["error"] and not path.exists()


def test_admin_amounts_are_bounded():
    for bad in ("99999999999999999999999", "-5", "1e3", "0"):
        with pytest.raises(SystemExit) as exited:
            _parser().parse_args(["admin", "grant-credits", "--org", "acme", "--credits", bad])
        assert exited.value.code == 2
    for bad in ("99999999999999999999", "-1"):  # second fresh-eyes test: a traceback, or every entry
        with pytest.raises(SystemExit):
            _parser().parse_args(["admin", "show", "--org", "acme", "--entries", bad])


def test_admin_show_runs_as_a_module(tmp_path):
    env = {**os.environ, "LOOPLINE_DATA_DIR": str(tmp_path), "LOOPLINE_LOG_LEVEL": "WARNING"}
    command = [sys.executable, "-m", "services.billing", "admin", "seed-dev", "--org", "demo"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(result.stdout)["organization_id"] == "demo"


def test_migrations_match_the_models(tmp_path):
    url = f"sqlite+aiosqlite:///{tmp_path / 'm.db'}"
    db.migrate("billing", url)
    engine = create_engine(f"sqlite:///{tmp_path / 'm.db'}")
    with engine.connect() as connection:
        diff = compare_metadata(MigrationContext.configure(connection, opts={"compare_type": True}), Base.metadata)
    engine.dispose()
    assert diff == []
