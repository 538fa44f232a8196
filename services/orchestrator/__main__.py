"""`python -m services.orchestrator [serve|migrate]`."""

from __future__ import annotations

from services.common import early_signals  # noqa: F401 - first: a SIGTERM during the imports below stops the server gracefully

# isort: split
import argparse

from services.common import db, runner
from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.server import OrchestratorServer


def main() -> None:
    """Parse the command line and serve (default) or migrate."""
    parser = argparse.ArgumentParser(prog="python -m services.orchestrator")
    parser.add_argument("command", nargs="?", default="serve", choices=["serve", "migrate"])
    args = parser.parse_args()
    settings = OrchestratorSettings()
    if args.command == "migrate":
        code = db.migrate_command("orchestrator", settings.database_url)
        if code:
            raise SystemExit(code)
        return
    runner.run(
        "orchestrator",
        settings.log_level,
        lambda: OrchestratorServer.start(settings),
        settings.shutdown_grace_s,
    )


if __name__ == "__main__":
    main()
