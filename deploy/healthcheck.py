"""Probe a Loopline service on this host: the compose file's healthchecks.

    python deploy/healthcheck.py http PORT PATH        GET http://127.0.0.1:PORT/PATH is 2xx
    python deploy/healthcheck.py grpc PORT [SERVICE]   grpc.health.v1 Check(SERVICE) is SERVING

Exit status 0 when healthy, else 1 with one line on stderr saying why (2: a malformed command
line). The image has neither
curl nor grpc_health_probe, so this uses the standard library and grpcio, which it has.
Health checks need no internal token. Kubernetes probes the same endpoints natively.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

TIMEOUT_S = 3.0


def http_ok(port: int, path: str) -> str:
    """Why GET `path` on 127.0.0.1:`port` is not healthy; "" when it answers 2xx."""
    url = f"http://127.0.0.1:{port}/{path.lstrip('/')}"
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            status = response.status
    except urllib.error.HTTPError as refused:
        status = refused.code
    except (OSError, ValueError) as unreachable:
        return f"GET {url}: {type(unreachable).__name__}"
    return "" if 200 <= status < 300 else f"GET {url}: {status}"


def grpc_serving(port: int, service: str) -> str:
    """Why 127.0.0.1:`port` is not healthy; "" when grpc.health.v1 reports `service` SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = f"127.0.0.1:{port}"
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S
            )
        except grpc.RpcError as failed:
            return f"health check of {service!r} on {target}: {failed.code().name}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return f"health check of {service!r} on {target}: {status}"
    return ""


def main(argv: list[str]) -> int:
    """Run the probe `argv` names; returns the exit status."""
    usage = "usage: healthcheck.py http PORT PATH | grpc PORT [SERVICE]"
    if len(argv) < 2 or not argv[1].isdigit():
        print(usage, file=sys.stderr)
        return 2
    kind, port = argv[0], int(argv[1])
    if kind == "http" and len(argv) == 3:
        problem = http_ok(port, argv[2])
    elif kind == "grpc" and len(argv) in (2, 3):
        problem = grpc_serving(port, argv[2] if len(argv) == 3 else "")
    else:
        print(usage, file=sys.stderr)
        return 2
    if problem:
        print(problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
