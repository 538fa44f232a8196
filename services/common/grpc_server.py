"""Start a `grpc.aio` server with the standard health service and server reflection.

Modelled on grpc/grpc's `examples/python/health_checking` and
`helloworld/async_greeter_server_with_graceful_shutdown.py`.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common import tracing
from services.common.internal_auth import server_interceptors

log = logging.getLogger(__name__)

REFLECTION_SERVICE_NAME = "grpc.reflection.v1alpha.ServerReflection"
REFLECTION_V1_SERVICE_NAME = (
    "grpc.reflection.v1.ServerReflection"  # the same messages on the wire as v1alpha
)
#: The health service name that reports SERVING while the process serves, whatever its
#: dependencies do (liveness probes); "" and the service names report readiness (readiness.py).
LIVENESS = "liveness"
#: The shortest interval between the pings of a client that the servers accept (half the
#: shortest client keepalive, LOOPLINE_GRPC_KEEPALIVE_S >= 1 s): more often is a GOAWAY.
MIN_PING_INTERVAL_MS = 500
#: Calls that may wait for the server's Python side to take them. gRPC's core answers those past
#: its defaults (1,000, 3,000 at most) CANCELLED, as if their callers had cancelled, so a burst
#: of a few thousand calls at once (a crowd of listens reconnecting) would lose most of them.
MAX_PENDING_CALLS = 20_000


@dataclass(frozen=True)
class _CallDetails:
    method: str
    invocation_metadata: Any


class LazyReflection(grpc.GenericRpcHandler):
    """gRPC server reflection (grpc.reflection.v1 and v1alpha) whose implementation is imported on
    first use.

    The same service as `grpc_reflection.v1alpha.reflection.enable_server_reflection(names,
    server)`; but `grpc_reflection` imports protobuf's `descriptor_pb2` (~3 MiB resident in
    every process), which only a reflection call needs, so it is imported when the first
    reflection call arrives (a one-time ~50 ms import on the event loop). grpcio-reflection
    ships v1alpha only; v1 (what current tools such as grpcurl try first)
    has the same messages field for field, so its calls are served by the same handler.

    Args:
        service_names: the fully-qualified service names reflection lists.
    """

    def __init__(self, service_names: Sequence[str]) -> None:
        self.service_names = tuple(service_names)
        self._prefix = f"/{REFLECTION_SERVICE_NAME}/"
        self._v1_prefix = f"/{REFLECTION_V1_SERVICE_NAME}/"
        self._handler: grpc.GenericRpcHandler | None = None

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        """The reflection method's handler, or None for any other method."""
        method = handler_call_details.method
        if not isinstance(method, str):
            return None
        details: Any = handler_call_details  # a _CallDetails (read-only fields) below
        if method.startswith(self._v1_prefix):
            details = _CallDetails(
                self._prefix + method[len(self._v1_prefix) :],
                handler_call_details.invocation_metadata,
            )
        elif not method.startswith(self._prefix):
            return None
        if self._handler is None:
            self._handler = _reflection_handler(self.service_names)
        return self._handler.service(details)


class _Handlers:
    """Collects what an `add_..._to_server` function registers (a stand-in for the server)."""

    def __init__(self) -> None:
        self.generic: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self.generic.extend(handlers)

    def add_registered_method_handlers(self, service_name: str, handlers: Any) -> None:
        pass


def _reflection_handler(service_names: Sequence[str]) -> grpc.GenericRpcHandler:
    from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

    collected = _Handlers()
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
        reflection.aio.ReflectionServicer(service_names), collected
    )
    (handler,) = collected.generic
    return handler


# (add_XServicer_to_server, servicer instance, full service name)
ServiceBinding = tuple[Callable[[Any, grpc.aio.Server], None], Any, str]


@dataclass
class RunningServer:
    """A started gRPC server: the server, the port it bound, its health servicer and the full
    names of the services it serves."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    service_names: tuple[str, ...] = ()

    async def stop(self, grace: float) -> None:
        """Mark every service NOT_SERVING, then stop, giving in-flight RPCs `grace` seconds."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


class PortUnavailable(RuntimeError):
    """The server's port cannot be bound (in use by another process, or not available here)."""


async def start_grpc_server(
    bindings: Sequence[ServiceBinding],
    host: str,
    port: int,
    options: Sequence[tuple[str, Any]] = (),
    internal_token: str = "",
) -> RunningServer:
    """Start a server on host:port (port 0 picks a free one) serving `bindings`.

    Adds grpc.health.v1 (every service, "" and LIVENESS reported SERVING; `readiness.Readiness`
    sets all but LIVENESS from then on) and reflection. With
    `internal_token`, every call but a health check must carry it (internal_auth.TokenCheck).
    Raises PortUnavailable (a RuntimeError) when the port cannot be bound (in use by another
    process too: no SO_REUSEPORT).
    """
    server = grpc.aio.server(
        # the trace context of every call (tracing on only), then the internal token's check
        interceptors=[*tracing.server_interceptors(), *server_interceptors(internal_token)],
        options=[
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            # the internal channels' keepalive pings (internal_auth.internal_channel), also on
            # connections without calls
            ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
            # gRPC sets SO_REUSEPORT on Linux by default: a second copy of a service on a port in
            # use would start and share it silently (a listener of a run on the other copy gets an
            # empty stream). A port in use is an error at start instead.
            ("grpc.so_reuseport", 0),
            ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
            ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
            *options,
        ],
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = []
    for add, servicer, name in bindings:
        add(servicer, server)
        names.append(name)
    server.add_generic_rpc_handlers(
        (
            LazyReflection(
                [*names, health.SERVICE_NAME, REFLECTION_V1_SERVICE_NAME, REFLECTION_SERVICE_NAME]
            ),
        )
    )
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpc's "Failed to bind to address ..."
        bound = 0
    if bound == 0:
        raise PortUnavailable(
            f"cannot bind the gRPC port {host}:{port}: it is in use (another copy of the service?) "
            "or not available"
        )
    await server.start()
    for name in [*names, "", LIVENESS]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(
        server=server, port=bound, health=health_servicer, service_names=tuple(names)
    )


def catch_termination_signals() -> asyncio.Event:
    """From now on SIGTERM and SIGINT set the returned event instead of ending the process.

    Installed before a service starts (migrations, binding), so that a signal during start-up
    stops it gracefully once it has started, not by the signal's default action (exit 143)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def wait_for_termination_signal(stop: asyncio.Event | None = None) -> None:
    """Return when the process receives SIGTERM or SIGINT (`stop`: the event of
    `catch_termination_signals`, when they were caught earlier)."""
    await (stop or catch_termination_signals()).wait()
    log.info("termination signal received, stopping")
