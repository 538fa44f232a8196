"""SIGTERM and SIGINT during a service's start-up, before its event loop catches them.

Each service's `__main__` imports this module first, before its heavy imports (~1.5 s on a
slow machine), so that a server process (no sub-command, or `serve`) that gets SIGTERM or
SIGINT while it imports, migrates or binds remembers it instead of dying by the signal's
default action (exit 143); `services.common.runner.run` stops the service
gracefully as soon as it has started. Other sub-commands (migrate, admin commands) keep
the default actions.
"""

from __future__ import annotations

import signal
import sys

received: list[int] = []  # the signals caught so far


def _remember(signum: int, _frame: object) -> None:
    received.append(signum)


def catch() -> None:
    """Remember SIGTERM and SIGINT (in `received`) until the event loop installs its own
    handlers."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _remember)


if sys.argv[1:2] in ([], ["serve"]):
    catch()
