"""Run one service as a process: logging, start, wait for SIGTERM/SIGINT, graceful stop."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Protocol

from services.common import db, early_signals, tracing
from services.common import logging as loopline_logging
from services.common.grpc_server import (
    PortUnavailable,
    catch_termination_signals,
    wait_for_termination_signal,
)

log = logging.getLogger(__name__)


class Stoppable(Protocol):
    """A started service: `port` it bound, `stop(grace)` to stop it gracefully."""

    port: int

    async def stop(self, grace: float) -> None: ...


# glibc's mallopt parameter number of M_ARENA_MAX (malloc.h).
_M_ARENA_MAX = -8
MALLOC_ARENAS = 2


def limit_malloc_arenas(count: int = MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc arenas at `count` for this process, unless MALLOC_ARENA_MAX is set.

    glibc gives threads that allocate concurrently their own arena (up to 8 per core), and
    each keeps its freed memory; a service's gRPC, SQLite and executor threads thus hold
    several MiB more after load than one asyncio process needs (measured: -5 MiB resident
    over the four services after the throughput workload with 2 arenas, CPU unchanged).
    Same effect as starting the process with MALLOC_ARENA_MAX=2, which an operator can set
    to choose another value. Returns whether the cap was applied (False off glibc).
    """
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(_M_ARENA_MAX, count))


def use_uvloop() -> bool:
    """Make new event loops uvloop's (libuv) when uvloop is installed; returns whether it is.

    Measured on the reference machine (docs/performance.md): a grpc.aio unary call costs
    ~0.34 ms of client and ~0.48 ms of server CPU on uvloop against ~0.44 and ~0.67 ms on
    asyncio's own loop, whose Python code was a quarter or more of every service's samples.
    grpc.aio supports uvloop; without it (e.g. on Windows) the services run on plain asyncio.
    """
    try:
        import uvloop  # noqa: PLC0415 - optional accelerator
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


class CannotStart(Exception):
    """A service cannot start for a reason outside it that its message names (a backing server
    that does not answer, e.g. Redis); `run` prints it as one line and exits 2, as a port in use."""


def run(service: str, level: str, start: Callable[[], Awaitable[Stoppable]], grace: float) -> None:
    """Start `service` with `start()`, serve until SIGTERM/SIGINT, then stop with `grace` seconds.

    Caps glibc's malloc arenas first (`limit_malloc_arenas`), before any server thread starts,
    and serves on uvloop when it is installed (`use_uvloop`). Tracing is set up before the
    service starts (`tracing.setup`: on only when the OTEL_* variables configure an exporter;
    service.name loopline-<service>) and its queued spans are sent when it has stopped.
    """
    limit_malloc_arenas()
    loopline_logging.setup(service, level)
    tracing.setup(f"loopline-{service}")

    async def main() -> None:
        stop = (
            catch_termination_signals()
        )  # a signal during start-up stops the service once started
        if early_signals.received:
            stop.set()
        handle = await start()
        fields = {"port": handle.port}
        metrics_port = getattr(handle, "metrics_port", None)  # the gateway's is its HTTP port
        if metrics_port:
            fields["metrics_port"] = metrics_port
        log.info("serving", extra={"fields": fields})
        await wait_for_termination_signal(stop)
        await handle.stop(grace)
        log.info("stopped")

    use_uvloop()
    # until the event loop's handlers (`catch_termination_signals`); done at import by __main__
    early_signals.catch()
    try:
        asyncio.run(main())
    except (
        db.UnusableDatabase,
        PortUnavailable,
        CannotStart,
    ) as unusable:  # e.g. LOOPLINE_DATA_DIR names a file, a port in use: one line
        # a JSON line like every other, whose message reads alone: "<service>: cannot start: ..."
        log.error(
            f"{service}: cannot start: {unusable}", extra={"fields": {"reason": str(unusable)}}
        )
        raise SystemExit(2) from None
    finally:
        tracing.shutdown()
