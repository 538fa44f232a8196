"""Run all of Loopline on one machine for development: what `make run` starts.

1. Checks that the five development ports and the three metrics ports are free.
2. Applies every service's migrations (`python -m services.<name> migrate`).
3. Seeds a development organization, owner and API key (`python -m services.gateway
   seed-dev`, which honors LOOPLINE_DEV_API_KEY and LOOPLINE_DEV_ORG_ID) and gives it a
   plan with credits (`python -m services.billing admin seed-dev --org ORG`).
4. Starts orchestrator, billing and tools, waits until each reports SERVING on
   grpc.health.v1, then starts the gateway and waits for its gRPC health and `GET /healthz`.
5. Prints the gateway URL, the organization id, the API key and a curl pair to try a turn.
6. Runs until Ctrl-C / SIGTERM (then stops every child: SIGTERM, wait, SIGKILL) or until
   a child dies (then reports it and stops the rest, exit code 1).

Every child gets the same environment (plus the downstream addresses derived from the
ports, unless set) and writes to var/logs/<service>.log; `--logs` also echoes the logs
here with a prefix. Works without a TTY. Run it with the project's virtual environment:
`make run` (options through `make run DEV_ARGS='--logs'`).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Sequence

try:  # checked first, so that outside the virtual environment the runner explains itself
    import grpc  # noqa: F401
    import httpx  # noqa: F401
    from grpc_health.v1 import health_pb2  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on how it is started
    sys.exit(f"dev.py: {exc}; run it with the project's virtual environment: `make run`")

sys.path.append(str(pathlib.Path(__file__).resolve().parent.parent))  # as a script: the root

from scripts.dev_processes import Failure, Stop, console
from scripts.dev_runner import Runner


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--logs",
        action="store_true",
        help="also echo every service's log here, prefixed with its name",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds to wait for all services to be healthy (60)",
    )
    parser.add_argument(
        "--stop-timeout",
        type=float,
        default=10.0,
        help="seconds a child gets after SIGTERM before SIGKILL (10)",
    )
    parser.add_argument(
        "--log-dir",
        type=pathlib.Path,
        default=None,
        help="folder of the service logs ($LOOPLINE_DATA_DIR/logs, by default var/logs)",
    )
    parser.add_argument(
        "--exit-when-ready",
        action="store_true",
        help="stop everything once all services are healthy (a check)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="once ready, run the printed turn over HTTP, check it ends with done, stop",
    )
    parser.add_argument(
        "--module",
        default="services.{name}",
        help="module run for each service, {name} replaced (for testing this runner)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    stop = Stop()
    stop.install()
    try:
        runner = Runner(args, stop)
    except Failure as failure:
        console.error(f"[dev] ERROR: {failure}")
        return 2
    try:
        return runner.run()
    except Failure as failure:  # raised before anything started (ports)
        console.error(f"[dev] ERROR: {failure}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
