"""Run one service as a process: logging, start, wait for SIGTERM/SIGINT, graceful stop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from services.common import logging as loopline_logging
from services.common.grpc_server import wait_for_termination_signal

log = logging.getLogger(__name__)


class Stoppable(Protocol):
    """A started service: `port` it bound, `stop(grace)` to stop it gracefully."""

    port: int

    async def stop(self, grace: float) -> None: ...


def run(service: str, level: str, start: Callable[[], Awaitable[Stoppable]], grace: float) -> None:
    """Start `service` with `start()`, serve until SIGTERM/SIGINT, then stop with `grace` seconds."""
    loopline_logging.setup(service, level)

    async def main() -> None:
        handle = await start()
        log.info("serving", extra={"fields": {"port": handle.port}})
        await wait_for_termination_signal()
        await handle.stop(grace)
        log.info("stopped")

    asyncio.run(main())
