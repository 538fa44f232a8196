"""`python -m services.gateway [COMMAND]`: serve (the default), migrate, seed-dev, add-member,
list-keys, revoke-key, set-default-llm, show-default-llm."""

from __future__ import annotations

# first: a SIGTERM during the imports below stops the server gracefully
from services.common import early_signals  # noqa: F401

# isort: split
import argparse
import asyncio
import json
import sys
from typing import Any

from sqlalchemy.exc import IntegrityError

from services.common import db, ids, runner
from services.gateway import identity
from services.gateway.config import GatewaySettings
from services.gateway.server import GatewayServer


async def _with_sessions(settings: GatewaySettings, work):
    engine = db.make_engine(settings.database_url, settings.db_pool_size, settings.db_timeout_s)
    try:
        return await work(db.sessionmaker(engine))
    finally:
        await engine.dispose()


def _answer(document: Any, error: str = "") -> None:
    """Print an admin command's JSON answer; None prints {"error": error} and exits 1."""
    if document is None:
        print(json.dumps({"error": error}))
        sys.exit(1)
    print(json.dumps(document))


# The answer to a unique-constraint conflict no admin function foresaw (its database text may
# quote values).
CONFLICT = (
    "the change conflicts with an existing record (a value that must be unique is already taken);"
    " nothing was changed"
)


def _run(settings: GatewaySettings, work, error: str = "") -> None:
    """Run `work(sessions)` and print its result with `_answer` (None -> {"error": error}, exit 1).

    An `identity.AdminError` prints {"error": its message} and a unique-constraint conflict
    (sqlalchemy IntegrityError) {"error": CONFLICT}, both exiting 1 instead of a traceback.
    """
    try:
        result = asyncio.run(_with_sessions(settings, work))
    except identity.AdminError as refused:
        _answer(None, str(refused))
    except IntegrityError:
        _answer(None, CONFLICT)
    else:
        _answer(result, error)


def _run_check(check, *args: Any) -> None:
    """Call `check(*args)`; an `identity.AdminError` prints {"error": its message} and exits 1."""
    try:
        check(*args)
    except identity.AdminError as refused:
        _answer(None, str(refused))


def _non_empty(text: str) -> str:
    """An argparse type for a value that must hold more than blanks (argparse reports an empty
    one: exit 2)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _email(text: str) -> str:
    """An argparse type for a new user's email: 3 to 320 characters with an "@", no whitespace or
    control characters (the users table's limit; a longer one failed in the database)."""
    if (
        not 3 <= len(text) <= 320
        or "@" not in text
        or any(c.isspace() or not c.isprintable() for c in text)
    ):
        raise argparse.ArgumentTypeError(
            "an email is 3 to 320 printable characters with an '@' and no spaces"
        )
    return text


def main() -> None:
    """Parse the command line and run the command (see the module docstring); serve is the default.

    Admin commands print one JSON document; on failure {"error": "..."} and exit status 1
    (`_answer`, `_run`), a database that cannot be used included (a malformed URL, a file
    that is not a database, a server that refuses: `db.unusable_database` names the file or
    server, never the URL's password); a malformed argument is argparse's usage error, exit
    status 2.
    """
    args = _parser().parse_args()
    settings = GatewaySettings()
    if args.command in (None, "serve"):
        runner.run(
            "gateway",
            settings.log_level,
            lambda: GatewayServer.start(settings),
            settings.shutdown_grace_s,
        )
        return
    if args.command == "migrate":  # not an admin command: a line of text, not JSON
        code = db.migrate_command("gateway", settings.database_url)
        if code:
            raise SystemExit(code)
        return
    try:
        _command(args, settings)
    except Exception as error:
        problem = db.unusable_database(
            error, settings.database_url, "gateway", "LOOPLINE_GATEWAY_DATABASE_URL"
        )
        if problem is None:
            raise
        _answer(None, problem)


def _parser() -> argparse.ArgumentParser:
    """The command line: one sub-command per command of the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m services.gateway")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("serve", help="serve HTTP (default)")
    sub.add_parser("migrate", help="apply the identity database migrations")
    sub.add_parser(
        "seed-dev", help="ensure the development organization, owner and API key; prints JSON"
    )
    member = sub.add_parser(
        "add-member",
        help="create a user with a role in an organization; prints JSON with its API key",
    )
    member.add_argument("--org", required=True, type=ids.org_id_arg)
    member.add_argument("--role", required=True, choices=["owner", "admin", "member"])
    member.add_argument(
        "--email", type=_email, help="the new user's email (must not belong to an existing user)"
    )
    llm = sub.add_parser(
        "set-default-llm", help="save an organization's default model (used when a turn names none)"
    )
    llm.add_argument("--org", required=True, type=ids.org_id_arg)
    # non-empty: an empty one would be stored, and every turn naming no model then refused
    llm.add_argument(
        "--integration",
        required=True,
        type=_non_empty,
        help="integration_name, e.g. openai or loopline",
    )
    llm.add_argument(
        "--provider",
        required=True,
        type=_non_empty,
        help="provider_id, e.g. openai, anthropic, scripted",
    )
    llm.add_argument("--model", required=True, type=_non_empty, help="model_id")
    llm.add_argument(
        "--credential", help="credential_id of the organization's own key (bring your own key)"
    )
    sub.add_parser(
        "show-default-llm", help="print an organization's saved default model"
    ).add_argument("--org", required=True, type=ids.org_id_arg)
    sub.add_parser(
        "list-keys",
        help="the organization's API keys usable there (id, prefix, member, role, bound"
        " organization, expiry, created, revoked); never the keys",
    ).add_argument("--org", required=True, type=ids.org_id_arg)
    revoke = sub.add_parser(
        "revoke-key",
        help="revoke an API key by its id (key_..., printed by add-member),"
        " or the key read from stdin",
    )
    revoke.add_argument(
        "--key-id", help="the key's id; without it the key itself is read from standard input"
    )
    return parser


def _command(args: argparse.Namespace, settings: GatewaySettings) -> None:
    """Run the admin command `args.command` (any but serve and migrate; see `main`).

    Raises what a database that cannot be used raises (`main` answers it with
    `db.unusable_database`: {"error": ...}, exit 1); `_answer` exits on every other refusal.
    """
    db.check_sqlite_file(settings.database_url)  # first: a folder that is a file is said as such
    missing = db.missing_sqlite_file(settings.database_url)
    if missing is not None and args.command in (
        "add-member",
        "set-default-llm",
        "show-default-llm",
        "revoke-key",
        "list-keys",
    ):
        # pointed elsewhere than the services (LOOPLINE_DATA_DIR / the database URL): migrating
        # would create an empty database and the change would go nowhere
        _answer(
            None,
            f"no gateway database at {missing}; run admin commands with the LOOPLINE_DATA_DIR "
            "(or LOOPLINE_GATEWAY_DATABASE_URL) the services use",
        )
    if args.command == "seed-dev":
        if settings.dev_api_key:
            _run_check(identity.check_dev_key, settings.dev_api_key)  # before anything is written
        if settings.dev_org_id:
            _run_check(identity.check_dev_org_id, settings.dev_org_id)
        db.migrate("gateway", settings.database_url)
        _run(settings, lambda s: identity.seed_dev(s, settings.dev_api_key, settings.dev_org_id))
    elif args.command == "add-member":
        db.migrate("gateway", settings.database_url)
        _run(settings, lambda s: identity.create_member(s, args.org, args.role, args.email))
    elif args.command == "list-keys":

        async def listing(sessions):
            keys = await identity.list_keys(sessions, args.org)
            return None if keys is None else {"organization_id": args.org, "keys": keys}

        _run(settings, listing, f"no organization {args.org!r}")
    elif args.command == "revoke-key":
        if args.key_id is not None and not args.key_id.strip():
            _answer(None, "no key id given: --key-id is empty")
        key = (
            None if args.key_id else sys.stdin.readline().strip()
        )  # an empty key: identity.AdminError
        _run(settings, lambda s: identity.revoke_key(s, args.key_id, key), "no such API key")
    elif args.command in ("set-default-llm", "show-default-llm"):
        from services.gateway.default_models import DefaultModels

        db.migrate("gateway", settings.database_url)

        async def work(sessions):
            models = DefaultModels(sessions)
            if not await models.exists(args.org):
                return None
            if args.command == "set-default-llm":
                chosen = {
                    "integration_name": args.integration,
                    "provider_id": args.provider,
                    "model_id": args.model,
                }
                if args.credential:
                    chosen["credential_id"] = args.credential
                await models.set(args.org, chosen)
            return {"organization_id": args.org, "default_llm": await models.get(args.org)}

        _run(settings, work, f"no organization {args.org!r}")


if __name__ == "__main__":
    main()
