"""`python -m services.billing admin ...` and the migration history."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.billing.__main__ import _parser, admin
from services.common import db
from services.common.sqlite_driver import sqlite3
from tests.billing.helpers import make_settings


async def _admin(settings, *argv: str) -> tuple[int, dict]:
    await db.migrate_async(
        "billing", settings.billing_database_url
    )  # the services created their database
    return await admin(settings, _parser().parse_args(["admin", *argv]))


async def test_admin_commands_adjust_the_account_and_show_the_ledger(settings):
    code, view = await _admin(settings, "set-plan", "--org", "acme", "--plan", "team")
    assert code == 0 and view["plan"]["name"] == "team"
    assert view["allowance"]["period_allowance"] == 10000
    code, view = await _admin(
        settings, "grant-credits", "--org", "acme", "--credits", "25", "--note", "goodwill"
    )
    assert (
        view["allowance"]["period_allowance"] == 10025
        and view["allowance"]["granted_credits"] == 25
    )
    code, view = await _admin(
        settings, "top-up", "--org", "acme", "--minor-units", "1500", "--idempotency-key", "inv-1"
    )
    code, view = await _admin(
        settings, "top-up", "--org", "acme", "--minor-units", "1500", "--idempotency-key", "inv-1"
    )
    assert view["wallet"]["balance_minor"] == 1500  # the same idempotency key posts once
    kinds = [(e["kind"], e["unit"], e["amount"]) for e in view["recent_ledger_entries"]]
    assert sorted(kinds) == [("grant", "credit", 25), ("top_up", "minor", 1500)]


async def test_money_for_an_organization_without_an_account_needs_create_account(settings):
    # a mistyped --org must not silently get a new account and the money
    code, document = await _admin(settings, "top-up", "--org", "org_typo", "--minor-units", "500")
    assert code == 1 and "no billing account" in document["error"]
    assert (await _admin(settings, "show", "--org", "org_typo"))[0] == 1  # nothing was created
    code, view = await _admin(
        settings, "grant-credits", "--org", "org_new", "--credits", "5", "--create-account"
    )
    assert code == 0 and view["allowance"]["granted_credits"] == 5


async def test_an_admin_idempotency_key_reused_for_another_amount_is_refused(settings):
    await _admin(settings, "set-plan", "--org", "acme", "--plan", "team")
    assert (
        await _admin(
            settings, "top-up", "--org", "acme", "--minor-units", "7", "--idempotency-key", "inv-42"
        )
    )[0] == 0
    code, document = await _admin(
        settings, "top-up", "--org", "acme", "--minor-units", "9", "--idempotency-key", "inv-42"
    )
    assert code == 1 and "already used" in document["error"]
    code, view = await _admin(
        settings, "top-up", "--org", "acme", "--minor-units", "7", "--idempotency-key", "inv-42"
    )
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
    """seed-dev keeps a plan an operator set (`set-plan --plan team`): `make run` runs it at
    every start, and it must not put the development organization back on the developer plan."""
    await _admin(settings, "seed-dev", "--org", "demo")
    await _admin(settings, "set-plan", "--org", "demo", "--plan", "team")
    code, view = await _admin(settings, "seed-dev", "--org", "demo")
    assert code == 0 and view["plan"]["name"] == "team"
    assert view["wallet"]["balance_minor"] == 1000  # the one-time top-up is not repeated either


async def test_admin_refuses_a_database_the_services_never_created(settings):
    """An admin command run without the services' LOOPLINE_DATA_DIR exits 1 with "no billing
    database" and creates none, rather than topping up an account in a new ./var/billing.db."""
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
    for bad in (
        "99999999999999999999",
        "-1",
    ):  # refused by argparse, not a traceback or every entry
        with pytest.raises(SystemExit):
            _parser().parse_args(["admin", "show", "--org", "acme", "--entries", bad])


def test_admin_show_runs_as_a_module(tmp_path):
    env = {**os.environ, "LOOPLINE_DATA_DIR": str(tmp_path), "LOOPLINE_LOG_LEVEL": "WARNING"}
    command = [sys.executable, "-m", "services.billing", "admin", "seed-dev", "--org", "demo"]
    result = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(result.stdout)["organization_id"] == "demo"


BAD_PLAN_FILES = {  # file name -> (content, or None for no file; a fragment of the error)
    "missing.toml": (None, "cannot be read: No such file or directory"),
    "not_toml.toml": ("this is [not toml", "is not valid TOML"),
    "scalar.toml": ("plans = 3", "`plans` must be a table"),
    "no_credits.toml": (
        "[plans.basic]\nwallet_overage = false\n",
        "plan basic: monthly_run_credits is missing",
    ),
    "text_credits.toml": (
        '[plans.basic]\nmonthly_run_credits = "lots"\n',
        "plan basic: monthly_run_credits must be an integer",
    ),
    "plan_scalar.toml": ("[plans]\nbasic = 3\n", "plan basic: must be a table"),
    "limits_scalar.toml": (
        "[plans.basic]\nmonthly_run_credits = 1\nrate_limits = 5\n",
        "plan basic: rate_limits must be a table",
    ),
    "binary.toml": (b"\xff\xfe\x00garbage", "is not UTF-8 text"),
}
BAD_PRICE_FILES = {
    "missing_prices.toml": (None, "cannot be read: No such file or directory"),
    "not_toml_prices.toml": ("[default\ninput = 1", "is not valid TOML"),
    "scalar_models.toml": (
        "[default]\ninput = 1\n[models]\nopenai = 3\n",
        "`models` must be tables",
    ),
    "scalar_default.toml": ("default = 3\n", "price default must be a table"),
}


def _bad_file(tmp_path, name: str, content: str | bytes | None):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    return path


async def test_a_missing_or_malformed_plan_or_price_file_is_a_json_error_naming_the_file(tmp_path):
    """An admin command whose plan file (LOOPLINE_BILLING_PLANS_PATH) or price file is missing,
    a folder or malformed answers {"error": ...} naming the file and what is wrong, exit 1,
    never a traceback (FileNotFoundError, TOMLDecodeError, AttributeError, KeyError)."""
    args = _parser().parse_args(["admin", "seed-dev", "--org", "demo"])
    cases = [
        ("billing_plans_path", name, content, fragment)
        for name, (content, fragment) in BAD_PLAN_FILES.items()
    ]
    cases += [
        ("billing_prices_path", name, content, fragment)
        for name, (content, fragment) in BAD_PRICE_FILES.items()
    ]
    cases.append(("billing_plans_path", "a_folder", None, "cannot be read: Is a directory"))
    (tmp_path / "a_folder").mkdir()
    (tmp_path / "data").mkdir()
    for setting, name, content, fragment in cases:
        path = _bad_file(tmp_path, name, content)
        settings = make_settings(tmp_path / "data", **{setting: path})
        code, document = await admin(settings, args)
        assert code == 1 and list(document) == ["error"], (name, document)
        assert str(path) in document["error"] and fragment in document["error"], (name, document)


def _billing(env: dict[str, str], *argv: str) -> tuple[int, dict, str]:
    """(exit code, the JSON on stdout, stderr) of `python -m services.billing admin ...`."""
    result = subprocess.run(
        [sys.executable, "-m", "services.billing", "admin", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, json.loads(result.stdout), result.stderr


def test_admin_commands_answer_a_bad_plan_file_or_database_as_json_without_a_traceback(tmp_path):
    """`python -m services.billing admin ...` answers a missing plan file, and a database that
    is not one (LOOPLINE_DATA_DIR or the URL naming garbage, a folder, a data directory that is
    a file), with one JSON error naming the file, exit 1, and no traceback."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("LOOPLINE_")}
    base["LOOPLINE_LOG_LEVEL"] = "WARNING"
    code, document, _ = _billing(
        {
            **base,
            "LOOPLINE_DATA_DIR": str(tmp_path / "fresh"),
            "LOOPLINE_BILLING_PLANS_PATH": str(tmp_path / "nope.toml"),
        },
        "seed-dev",
        "--org",
        "demo",
    )
    assert code == 1 and f"plan file {tmp_path / 'nope.toml'}" in document["error"]

    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "billing.db").write_bytes(os.urandom(4096))
    for action in (["show", "--org", "demo"], ["seed-dev", "--org", "demo"]):
        code, document, _ = _billing({**base, "LOOPLINE_DATA_DIR": str(garbage)}, *action)
        assert (
            code == 1
            and f"billing database at {garbage / 'billing.db'} cannot be used" in document["error"]
        )
        assert "not a SQLite database" in document["error"]
    folder = tmp_path / "folder"
    (folder / "billing.db").mkdir(parents=True)
    code, document, _ = _billing(
        {**base, "LOOPLINE_DATA_DIR": str(folder)}, "show", "--org", "demo"
    )
    assert code == 1 and "is a folder" in document["error"]
    for action in (
        ["seed-dev", "--org", "demo"],
        ["show", "--org", "demo"],
    ):  # show said "no billing database at FILE/billing.db"
        code, document, _ = _billing(
            {**base, "LOOPLINE_DATA_DIR": str(garbage / "billing.db")}, *action
        )
        assert (
            code == 1 and f"its folder {garbage / 'billing.db'} is a file" in document["error"]
        ), action


async def test_a_database_url_that_cannot_be_used_is_a_json_error_without_its_password(tmp_path):
    """The kind of fault behind the garbage file: a malformed URL, an unknown dialect, a
    PostgreSQL server that refuses or a SQLite file of another service are {"error": ...} (exit 1)
    naming the database, never the URL's password."""
    other = tmp_path / "other.db"  # a database with another service's migration history
    await db.migrate_async("gateway", f"sqlite+aiosqlite:///{other}")
    urls = {
        "not a url": "is not a database URL",
        "nosuchdialect://reader:pa55word-x@db.example/sales": "names no installed database dialect",
        "postgresql+asyncpg://reader:pa55word-x@127.0.0.1:1/sales": (
            "(postgresql database 'sales' on 127.0.0.1:1) cannot be used"
        ),
        # the host and port as query parameters are named, not "localhost:default port"
        "postgresql+asyncpg://reader:pa55word-x@/sales?host=127.0.0.1&port=1": (
            "(postgresql database 'sales' on 127.0.0.1:1) cannot be used"
        ),
        f"sqlite+aiosqlite:///{other}": "its migration history is not billing's",
    }
    for url, fragment in urls.items():
        settings = make_settings(tmp_path, billing_database_url=url)
        code, document = await admin(
            settings, _parser().parse_args(["admin", "show", "--org", "demo"])
        )
        assert code == 1 and fragment in document["error"], (url, document)
        assert (
            "pa55word-x" not in document["error"]
            and "LOOPLINE_BILLING_DATABASE_URL" in document["error"]
        )


def test_commands_that_create_accounts_refuse_an_organization_id_no_organization_can_have(tmp_path):
    """set-plan, grant-credits/top-up --create-account and seed-dev refuse (argparse, exit 2) an
    id the gateway never lets an organization have (services/common/ids.py), e.g. "org é", "  "
    or 300 characters, and write nothing: no account or money for an organization that can't be."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("LOOPLINE_")},
        "LOOPLINE_DATA_DIR": str(tmp_path),
    }
    subprocess.run(
        [sys.executable, "-m", "services.billing", "migrate"],
        env=env,
        capture_output=True,
        timeout=60,
        check=True,
    )
    for org in ("org é", "  ", "a" * 300, ""):
        for argv in (
            ["set-plan", "--org", org, "--plan", "free"],
            ["grant-credits", "--org", org, "--credits", "5", "--create-account"],
            ["top-up", "--org", org, "--minor-units", "5", "--create-account"],
            ["seed-dev", "--org", org],
            ["show", "--org", org],
        ):  # show too: exit 2 like the others, not exit 1 "has no billing account"
            result = subprocess.run(
                [sys.executable, "-m", "services.billing", "admin", *argv],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert result.returncode == 2 and "visible ASCII" in result.stderr, (
                argv,
                result.stdout,
                result.stderr,
            )
    with sqlite3.connect(tmp_path / "billing.db") as database:
        assert database.execute("SELECT count(*) FROM accounts").fetchone() == (0,)
