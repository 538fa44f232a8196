"""`python -m services.gateway [serve|migrate|seed-dev|add-member]`."""

from __future__ import annotations

import argparse
import asyncio
import json

from services.common import db, runner
from services.gateway import identity
from services.gateway.config import GatewaySettings
from services.gateway.server import GatewayServer


async def _with_sessions(settings: GatewaySettings, work):  # noqa: ANN001, ANN202
    engine = db.make_engine(settings.database_url)
    try:
        return await work(db.sessionmaker(engine))
    finally:
        await engine.dispose()


def main() -> None:
    """Parse the command line: serve (default), migrate, seed-dev, or add-member."""
    parser = argparse.ArgumentParser(prog="python -m services.gateway")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("serve", help="serve HTTP (default)")
    sub.add_parser("migrate", help="apply the identity database migrations")
    sub.add_parser("seed-dev", help="ensure the development organization, owner and API key; prints JSON")
    member = sub.add_parser("add-member", help="create a user with a role in an organization; prints JSON with its API key")
    member.add_argument("--org", required=True)
    member.add_argument("--role", required=True, choices=["owner", "admin", "member"])
    member.add_argument("--email")
    args = parser.parse_args()
    settings = GatewaySettings()
    if args.command == "migrate":
        db.migrate("gateway", settings.database_url)
    elif args.command == "seed-dev":
        db.migrate("gateway", settings.database_url)
        seeded = asyncio.run(_with_sessions(settings, lambda s: identity.seed_dev(s, settings.dev_api_key, settings.dev_org_id)))
        print(json.dumps(seeded))
    elif args.command == "add-member":
        db.migrate("gateway", settings.database_url)
        created = asyncio.run(_with_sessions(settings, lambda s: identity.create_member(s, args.org, args.role, args.email)))
        print(json.dumps(created))
    else:
        runner.run("gateway", settings.log_level, lambda: GatewayServer.start(settings), settings.shutdown_grace_s)


if __name__ == "__main__":
    main()
