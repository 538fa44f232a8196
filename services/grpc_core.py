"""gRPC core settings every Loopline process needs before grpc is imported.

`services/__init__.py` imports this module, so `python -m services.<name>` (and anything else
importing a service) applies it before any module imports grpc: gRPC's C core reads its
configuration (environment variables such as GRPC_EXPERIMENTS) once, when grpc is imported.

**EventEngine endpoints off.** grpcio 1.80 turned on the EventEngine experiments for Python
(grpc/grpc#41432: "the only way we can realistically make progress with this migration is by
having people start using it"). With them, every grpc.aio call hops between the event loop,
grpc's poller thread and EventEngine worker threads; measured here with grpcio 1.85.1 on
2 vCPUs (docs/performance.md, "What changed in the fourth round"): a unary call between two uvloop
processes cost 0.38-0.47 ms of client and 0.48-0.59 ms of server CPU with them and
0.22-0.30 / 0.30-0.40 ms without (the iomgr endpoints every grpcio before 1.80 used),
sequential latency 0.8-1.0 → 0.4-0.6 ms. GRPC_EXPERIMENTS is the documented switch
(grpc's `src/core/lib/experiments/experiments.yaml`); an operator who sets it keeps theirs.

**The C core's own log off.** gRPC's C core writes its log lines to stderr as plain text (an
"E1204 ... add_port.cc:83] Failed to add port" before the service's own JSON line naming the
port in use; at INFO, unless GRPC_VERBOSITY says otherwise, a "Got goaway" whenever a peer
restarts), where every line of a service is one JSON object (services/common/logging.py). What
they report reaches the services as errors of their calls, which they log. GRPC_VERBOSITY is
set to NONE unless set: ERROR (or DEBUG, with GRPC_TRACE) shows them again.
"""

from __future__ import annotations

import os

#: The EventEngine experiments turned off unless GRPC_EXPERIMENTS is set (see the module doc).
EXPERIMENTS = "-event_engine_client,-event_engine_listener,-event_engine_for_all_other_endpoints"
#: The C core's log level unless GRPC_VERBOSITY is set (see the module doc).
VERBOSITY = "NONE"


def configure(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Set GRPC_EXPERIMENTS to EXPERIMENTS in `environ` unless it is set (even to "").

    Returns whether it was set. Has an effect only before grpc is first imported in this
    process; child processes inherit it.
    """
    if "GRPC_EXPERIMENTS" in environ:
        return False
    environ["GRPC_EXPERIMENTS"] = EXPERIMENTS
    return True


def quiet(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Set GRPC_VERBOSITY to VERBOSITY in `environ` unless it is set; returns whether it was set
    (an effect only before grpc is first imported in this process; children inherit it)."""
    if "GRPC_VERBOSITY" in environ:
        return False
    environ["GRPC_VERBOSITY"] = VERBOSITY
    return True


configure()
quiet()
