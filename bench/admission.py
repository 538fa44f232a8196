"""The admission workload: billing's Admit+Charge pairs over gRPC, beside a bare gRPC ceiling.

grpc is imported inside the functions, after `bench.run` has applied the services' gRPC core
settings (they take effect only before grpc is first imported).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from bench.deploy import Deployment
from bench.stats import rounded, summary


async def _drive_pairs(
    pair: Callable[[], Awaitable[tuple[float, float]]],
    pairs: int,
    concurrency: int,
    time_cap_s: float,
    cpu: Callable[[], float],
) -> dict[str, Any]:
    """Run `pairs` calls of `pair()` (returning the seconds of its two calls) on `concurrency`
    workers, capped at `time_cap_s`; pairs/s, percentiles of the pair and of each call, errors,
    and the server's CPU ms per pair (`cpu()` is its CPU seconds)."""
    import grpc

    pair_s: list[float] = []
    first_s: list[float] = []
    second_s: list[float] = []
    errors: dict[str, int] = {}
    remaining = pairs
    deadline = time.monotonic() + time_cap_s

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0 and time.monotonic() < deadline:
            remaining -= 1
            try:
                a, b = await pair()
            except grpc.aio.AioRpcError as error:
                key = f"{error.code().name}: {error.details()}"[:160]
                errors[key] = errors.get(key, 0) + 1
                continue
            first_s.append(a)
            second_s.append(b)
            pair_s.append(a + b)

    for _ in range(20):  # warm-up (the organization's account is created on the first Admit)
        await pair()
    cpu0 = cpu()
    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.monotonic() - started
    server_cpu = cpu() - cpu0
    return {
        "concurrency": concurrency,
        "pairs": len(pair_s),
        "failures": sum(errors.values()),
        "errors": errors,
        "elapsed_s": rounded(elapsed),
        "pairs_per_s": rounded(len(pair_s) / elapsed if elapsed else 0.0),
        "pair": summary(pair_s),
        "first": summary(first_s),
        "second": summary(second_s),
        "server_cpu_ms_per_pair": rounded(server_cpu * 1000 / max(1, len(pair_s))),
    }


async def workload_admission(
    dep: Deployment, pairs: int, concurrency: int, time_cap_s: float
) -> dict[str, Any]:
    """`Admit`+`Charge` pairs on billing over gRPC at `concurrency`, then the same number of pairs
    of two bare `grpc.health.v1` Checks on the same billing process and channel: the ceiling any
    pair of unary calls reaches on this machine with this client (reported as `bare_grpc`)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from loopline.billing.v1 import billing_pb2, billing_pb2_grpc

    org = f"org_bench_admit_{uuid.uuid4().hex[:8]}"  # auto-provisioned on the bench developer plan
    channel = grpc.aio.insecure_channel(
        dep.grpc_addr["billing"], options=[("grpc.enable_http_proxy", 0)]
    )
    stub = billing_pb2_grpc.BillingServiceStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    check = health_pb2.HealthCheckRequest(service="")

    async def admit_charge() -> tuple[float, float]:
        t0 = time.perf_counter()
        admitted = await stub.Admit(
            billing_pb2.AdmitRequest(
                organization_id=org,
                turn_key=f"{uuid.uuid4()}:{uuid.uuid4()}",
                usage_type="run",
                rate_class="sync_exec",
            ),
            timeout=10,
        )
        t1 = time.perf_counter()
        await stub.Charge(
            billing_pb2.ChargeRequest(reservation_id=admitted.reservation_id), timeout=10
        )
        return t1 - t0, time.perf_counter() - t1

    async def two_checks() -> tuple[float, float]:
        t0 = time.perf_counter()
        await health.Check(check, timeout=10)
        t1 = time.perf_counter()
        await health.Check(check, timeout=10)
        return t1 - t0, time.perf_counter() - t1

    def billing_cpu() -> float:
        return dep.cpu()["billing"]

    try:
        result = await _drive_pairs(admit_charge, pairs, concurrency, time_cap_s, billing_cpu)
        bare = await _drive_pairs(two_checks, pairs, concurrency, time_cap_s, billing_cpu)
    finally:
        await channel.close()
    result["admit"], result["charge"] = result.pop("first"), result.pop("second")
    result["billing_cpu_ms_per_pair"] = result.pop("server_cpu_ms_per_pair")
    result["bare_grpc"] = {
        key: bare[key]
        for key in ("pairs", "failures", "pairs_per_s", "pair", "server_cpu_ms_per_pair")
    }
    return result
