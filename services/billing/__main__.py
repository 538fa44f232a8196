"""`python -m services.billing [serve|migrate|admin ...]`.

    python -m services.billing                      serve (LOOPLINE_BILLING_PORT, default 50052)
    python -m services.billing migrate              upgrade the billing database to head
    python -m services.billing admin show --org ORG [--entries N]
    python -m services.billing admin set-plan --org ORG --plan NAME
    python -m services.billing admin grant-credits --org ORG --credits N [--idempotency-key K]
                                                   [--note T]
    python -m services.billing admin top-up --org ORG --minor-units N [--idempotency-key K]
                                            [--note T]
    python -m services.billing admin seed-dev --org ORG [--plan NAME] [--wallet-minor-units N]

Admin commands print one JSON document (the account view of `admin show`) on stdout and
exit 1 with {"error": ...} on a refused command (unknown plan, unknown organization for
`show`, a plan or price file that is missing or malformed, a database that cannot be used);
a malformed or missing option (e.g. a non-positive amount) is argparse's usage message on
stderr, exit 2.
"""

from __future__ import annotations

from services.common import early_signals  # noqa: F401 - first: a SIGTERM during the imports below stops the server gracefully

# isort: split
import argparse
import asyncio
import logging
import sys
from collections.abc import Callable
from typing import Any

import orjson

from services.billing.admin import Admin
from services.billing.config import BillingSettings
from services.billing.server import BillingServer, open_billing_store
from services.common import db, ids
from services.common import logging as loopline_logging
from services.common.runner import run

MAX_AMOUNT = 10**12  # the most credits or minor units one admin command adds


def _whole(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer from `low` to `high` (a larger amount would overflow the
    ledger's 64-bit columns after a few commands); argparse reports anything else (exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m services.billing", description="Loopline billing service"
    )
    commands = parser.add_subparsers(dest="command")
    commands.add_parser("serve", help="serve gRPC (the default)")
    commands.add_parser("migrate", help="upgrade the database to the newest migration")
    admin_parser = commands.add_parser("admin", help="inspect and adjust accounts")
    admin = admin_parser.add_subparsers(dest="action", required=True)
    show = admin.add_parser("show", help="account, plan, balances and recent ledger entries")
    show.add_argument("--org", required=True, type=ids.org_id_arg)
    show.add_argument(
        "--entries",
        type=_whole(0, 1000),
        default=20,
        metavar="N",
        help="how many of the newest ledger entries to list (0-1000, default 20)",
    )
    set_plan = admin.add_parser("set-plan", help="move an organization to a plan")
    set_plan.add_argument("--org", required=True, type=ids.org_id_arg)
    set_plan.add_argument("--plan", required=True)
    grant = admin.add_parser("grant-credits", help="add run credits to this period's allowance")
    grant.add_argument("--org", required=True, type=ids.org_id_arg)
    grant.add_argument("--credits", type=_whole(1, MAX_AMOUNT), required=True)
    grant.add_argument("--idempotency-key", default="")
    grant.add_argument("--note", default="")
    grant.add_argument(
        "--create-account",
        action="store_true",
        help="create the billing account if the organization has none",
    )
    top_up = admin.add_parser("top-up", help="add minor units (cents) to the prepaid wallet")
    top_up.add_argument("--org", required=True, type=ids.org_id_arg)
    top_up.add_argument("--minor-units", type=_whole(1, MAX_AMOUNT), required=True)
    top_up.add_argument("--idempotency-key", default="")
    top_up.add_argument("--note", default="")
    top_up.add_argument(
        "--create-account",
        action="store_true",
        help="create the billing account if the organization has none",
    )
    seed = admin.add_parser(
        "seed-dev",
        help="idempotently give the demo organization an account (on --plan when new) with credits",
    )
    seed.add_argument("--org", required=True, type=ids.org_id_arg)
    seed.add_argument("--plan", default="developer")
    seed.add_argument("--wallet-minor-units", type=_whole(0, MAX_AMOUNT), default=1000)
    return parser


async def seed_dev(admin: Admin, org_id: str, plan: str, wallet_minor_units: int) -> None:
    """Ensure `org_id` has an account (created on `plan`) and a one-time wallet top-up (idempotent).

    `make run` runs this at every start: an account that exists keeps its plan (an operator's
    `set-plan` survives restarts). The top-up uses idempotency key "seed-dev:{org_id}:wallet",
    so rerunning never adds money twice; the plan's monthly allowance supplies the run credits.
    """
    if await admin.store.account(org_id, provision=False) is None:
        await admin.set_plan(org_id, plan)
    if wallet_minor_units > 0:
        await admin.top_up(
            org_id, wallet_minor_units, f"seed-dev:{org_id}:wallet", "development seed"
        )


async def admin(settings: BillingSettings, args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    """Run one admin action; returns (exit code, JSON document): the account view (0) or
    {"error": ...} (1).

    Every action but `seed-dev` (which `make run` uses on a new data directory) refuses a
    SQLite database file that does not exist: the command is pointed elsewhere than the
    services (LOOPLINE_DATA_DIR or LOOPLINE_BILLING_DATABASE_URL) and would create one.
    A plan or price file that is missing or malformed (`load_plans`, `PriceTable.load`: the
    message names the file) and a database that cannot be used (a malformed URL, a file that
    is not a database, a server that refuses: `db.unusable_database`, which names the file or
    server and never the URL's password) are answered the same way, never as a traceback
    (README "Administration from the command line"). Other errors propagate.
    """
    try:
        return await _admin(settings, args)
    except Exception as error:
        problem = db.unusable_database(
            error, settings.billing_database_url, "billing", "LOOPLINE_BILLING_DATABASE_URL"
        )
        if problem is None:
            raise
        return 1, {"error": problem}


async def _admin(settings: BillingSettings, args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    """`admin` without its answer to an unusable database."""
    # first: a folder that is a file is said as such
    db.check_sqlite_file(settings.billing_database_url)
    missing = db.missing_sqlite_file(settings.billing_database_url)
    if missing is not None and args.action != "seed-dev":
        return 1, {
            "error": f"no billing database at {missing}; run admin commands with the "
            "LOOPLINE_DATA_DIR (or LOOPLINE_BILLING_DATABASE_URL) the services use"
        }
    try:
        store, _ = await open_billing_store(settings)
    except ValueError as bad_file:  # the plan or price file, or a default plan it lacks
        return 1, {"error": str(bad_file)}
    admin = Admin(store)
    try:
        if (
            args.action in ("grant-credits", "top-up")
            and not args.create_account
            and await store.account(args.org, provision=False) is None
        ):
            # a mistyped organization would get a new account and the money
            return 1, {
                "error": f"organization {args.org!r} has no billing account; check the id, or pass "
                "--create-account (set-plan also creates one)"
            }
        if args.action == "set-plan":
            await admin.set_plan(args.org, args.plan)
        elif args.action == "grant-credits":
            await admin.grant_credits(args.org, args.credits, args.idempotency_key, args.note)
        elif args.action == "top-up":
            await admin.top_up(args.org, args.minor_units, args.idempotency_key, args.note)
        elif args.action == "seed-dev":
            await seed_dev(admin, args.org, args.plan, args.wallet_minor_units)
        view = await admin.show(args.org, getattr(args, "entries", 20))
        if view is None:
            return 1, {"error": f"organization {args.org!r} has no billing account"}
        return 0, view
    except ValueError as exc:
        return 1, {"error": str(exc)}
    finally:
        await store.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = _parser().parse_args(argv)
    settings = BillingSettings()
    if args.command in (None, "serve"):
        run(
            "billing",
            settings.log_level,
            lambda: BillingServer.start(settings),
            settings.shutdown_grace_s,
        )
        return 0
    loopline_logging.setup("billing", settings.log_level)
    if args.command == "migrate":
        return db.migrate_command("billing", settings.billing_database_url)
    logging.getLogger("alembic").setLevel(logging.WARNING)  # an admin command's output is its JSON
    code, document = asyncio.run(admin(settings, args))
    sys.stdout.write(orjson.dumps(document, option=orjson.OPT_INDENT_2).decode() + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
