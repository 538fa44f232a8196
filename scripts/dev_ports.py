"""The fixed development ports, read from the variables the services read."""

from __future__ import annotations

import dataclasses

from scripts.dev_processes import Failure


@dataclasses.dataclass
class Ports:
    """The fixed development ports, from the same variables the services read (a metrics port
    may be 0: any free port, not checked)."""

    host: str
    http_host: str
    http: int
    grpc: dict[str, int]
    metrics: dict[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_env(cls, env: dict[str, str]) -> Ports:
        return cls(
            host=_connect_host(env.get("LOOPLINE_HOST", "127.0.0.1")),
            http_host=_connect_host(env.get("LOOPLINE_HTTP_HOST", "127.0.0.1")),
            http=_port(env, "LOOPLINE_HTTP_PORT", 8000),
            grpc={
                "gateway": _port(env, "LOOPLINE_GATEWAY_GRPC_PORT", 50050),
                "orchestrator": _port(env, "LOOPLINE_ORCHESTRATOR_PORT", 50051),
                "billing": _port(env, "LOOPLINE_BILLING_PORT", 50052),
                "tools": _port(env, "LOOPLINE_TOOLS_PORT", 50053),
            },
            metrics={
                name: _port(env, variable, default, any_free=True)
                for name, (variable, default) in METRICS_PORTS.items()
            },
        )

    def labelled(self) -> list[tuple[str, int, str]]:
        """Every (host, port) with the service and variable it belongs to."""
        labels = [(self.http_host, self.http, "gateway HTTP (LOOPLINE_HTTP_PORT)")]
        variables = {
            "gateway": "LOOPLINE_GATEWAY_GRPC_PORT",
            "orchestrator": "LOOPLINE_ORCHESTRATOR_PORT",
            "billing": "LOOPLINE_BILLING_PORT",
            "tools": "LOOPLINE_TOOLS_PORT",
        }
        labels += [
            (self.host, port, f"{name} gRPC ({variables[name]})")
            for name, port in self.grpc.items()
        ]
        labels += [
            (self.host, port, f"{name} metrics ({METRICS_PORTS[name][0]})")
            for name, port in self.metrics.items()
            if port
        ]
        return labels

    @property
    def url(self) -> str:
        return f"http://{hostport(self.http_host, self.http)}"


#: The metrics port of each gRPC service: (variable, default).
METRICS_PORTS = {
    "orchestrator": ("LOOPLINE_ORCHESTRATOR_METRICS_PORT", 9101),
    "billing": ("LOOPLINE_BILLING_METRICS_PORT", 9102),
    "tools": ("LOOPLINE_TOOLS_METRICS_PORT", 9103),
}


def hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _connect_host(bind: str) -> str:
    """Where to reach a server that binds `bind` (a wildcard is reached on loopback)."""
    bind = bind.strip().strip("[]")
    return "127.0.0.1" if bind in ("", "0.0.0.0", "::") else bind


def _port(env: dict[str, str], name: str, default: int, any_free: bool = False) -> int:
    """The port `name` sets (else `default`); 0 only when `any_free` (a port nothing else needs
    to find)."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        port = int(raw)
    except ValueError:
        raise Failure(f"{name}={raw!r} is not a port number") from None
    if any_free and port == 0:
        return 0
    if not 0 < port < 65536:
        raise Failure(
            f"{name}={port}: the development runner needs fixed ports between 1 and 65535"
        )
    return port
