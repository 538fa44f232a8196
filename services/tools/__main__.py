"""`python -m services.tools` serves the tools service; `python -m services.tools migrate` upgrades its database.

Other sub-commands:
  `python -m services.tools generate-key` prints a new Fernet key for LOOPLINE_TOOLS_CREDENTIAL_KEY.
"""

from __future__ import annotations

import argparse
import sys

from services.common import db
from services.common.runner import run
from services.tools.config import ToolsSettings


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the chosen command; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m services.tools", description="Loopline tools service")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("serve", help="serve gRPC (the default)")
    sub.add_parser("migrate", help="upgrade the database to the newest migration")
    sub.add_parser("generate-key", help="print a new Fernet key for LOOPLINE_TOOLS_CREDENTIAL_KEY")
    args = parser.parse_args(argv)
    settings = ToolsSettings()
    if args.command == "migrate":
        db.migrate("tools", settings.database_url())
        print(f"tools database migrated: {settings.database_url()}")
        return 0
    if args.command == "generate-key":
        from cryptography.fernet import Fernet

        print(Fernet.generate_key().decode())
        return 0

    from services.tools.server import ToolsServer

    run("tools", settings.log_level, lambda: ToolsServer.start(settings), settings.shutdown_grace_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
