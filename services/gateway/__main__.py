"""`python -m services.gateway [serve|migrate|seed-dev|add-member|list-keys|revoke-key|set-default-llm|show-default-llm]`."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from services.common import db, runner
from services.gateway import identity
from services.gateway.config import GatewaySettings
from services.gateway.server import GatewayServer


async def _with_sessions(settings: GatewaySettings, work):  # noqa: ANN001, ANN202
    engine = db.make_engine(settings.database_url, settings.db_pool_size)
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


def _org_id(text: str) -> str:
    """An argparse type for a new organization id: 1 to 128 characters, no whitespace or
    control characters (billing's limit; an empty one could never be sent as X-Organization-ID)."""
    if not 0 < len(text) <= 128 or any(c.isspace() or not c.isprintable() for c in text):
        raise argparse.ArgumentTypeError("an organization id is 1 to 128 printable characters without spaces")
    return text


def main() -> None:
    """Parse the command line: serve (default), migrate, seed-dev, or add-member."""
    parser = argparse.ArgumentParser(prog="python -m services.gateway")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("serve", help="serve HTTP (default)")
    sub.add_parser("migrate", help="apply the identity database migrations")
    sub.add_parser("seed-dev", help="ensure the development organization, owner and API key; prints JSON")
    member = sub.add_parser("add-member", help="create a user with a role in an organization; prints JSON with its API key")
    member.add_argument("--org", required=True, type=_org_id)
    member.add_argument("--role", required=True, choices=["owner", "admin", "member"])
    member.add_argument("--email")
    llm = sub.add_parser("set-default-llm", help="save an organization's default model (used when a turn names none)")
    llm.add_argument("--org", required=True)
    llm.add_argument("--integration", required=True, help="integration_name, e.g. openai or loopline")
    llm.add_argument("--provider", required=True, help="provider_id, e.g. openai, anthropic, scripted")
    llm.add_argument("--model", required=True, help="model_id")
    llm.add_argument("--credential", help="credential_id of the organization's own key (bring your own key)")
    sub.add_parser("show-default-llm", help="print an organization's saved default model").add_argument("--org", required=True)
    sub.add_parser("list-keys", help="the organization's API keys (id, prefix, member, role, created, revoked); never the keys").add_argument(
        "--org", required=True)
    revoke = sub.add_parser("revoke-key", help="revoke an API key by its id (key_..., printed by add-member), or the key read from stdin")
    revoke.add_argument("--key-id", help="the key's id; without it the key itself is read from standard input")
    args = parser.parse_args()
    settings = GatewaySettings()
    missing = db.missing_sqlite_file(settings.database_url)
    if missing is not None and args.command in ("add-member", "set-default-llm", "show-default-llm", "revoke-key", "list-keys"):
        # pointed elsewhere than the services (LOOPLINE_DATA_DIR / the database URL): migrating
        # would create an empty database and the change would go nowhere
        _answer(None, f"no gateway database at {missing}; run admin commands with the LOOPLINE_DATA_DIR "
                      "(or LOOPLINE_GATEWAY_DATABASE_URL) the services use")
    if args.command == "migrate":
        db.migrate("gateway", settings.database_url)
    elif args.command == "seed-dev":
        db.migrate("gateway", settings.database_url)
        _answer(asyncio.run(_with_sessions(settings, lambda s: identity.seed_dev(s, settings.dev_api_key, settings.dev_org_id))))
    elif args.command == "add-member":
        db.migrate("gateway", settings.database_url)
        _answer(asyncio.run(_with_sessions(settings, lambda s: identity.create_member(s, args.org, args.role, args.email))))
    elif args.command == "list-keys":
        keys = asyncio.run(_with_sessions(settings, lambda s: identity.list_keys(s, args.org)))
        _answer(None if keys is None else {"organization_id": args.org, "keys": keys}, f"no organization {args.org!r}")
    elif args.command == "revoke-key":
        key = None if args.key_id else sys.stdin.readline().strip()
        _answer(asyncio.run(_with_sessions(settings, lambda s: identity.revoke_key(s, args.key_id, key))), "no such API key")
    elif args.command in ("set-default-llm", "show-default-llm"):
        from services.gateway.org_settings import DefaultModels

        db.migrate("gateway", settings.database_url)

        async def work(sessions):  # noqa: ANN001, ANN202
            models = DefaultModels(sessions)
            if not await models.exists(args.org):
                return None
            if args.command == "set-default-llm":
                chosen = {"integration_name": args.integration, "provider_id": args.provider, "model_id": args.model}
                if args.credential:
                    chosen["credential_id"] = args.credential
                await models.set(args.org, chosen)
            return {"organization_id": args.org, "default_llm": await models.get(args.org)}

        _answer(asyncio.run(_with_sessions(settings, work)), f"no organization {args.org!r}")
    else:
        runner.run("gateway", settings.log_level, lambda: GatewayServer.start(settings), settings.shutdown_grace_s)


if __name__ == "__main__":
    main()
