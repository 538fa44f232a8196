"""services/common/grpc_server.py: a burst of calls at once is served, none cancelled."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_server import start_grpc_server

BURST = 2_500  # past gRPC core's default of 1,000 calls waiting for the server to take them


async def test_thousands_of_streams_opened_at_once_are_all_served():
    """Each call waits for the server's event loop to take it; gRPC's core cancelled those past
    1,000 waiting (CANCELLED, as if the caller had), so a crowd of listens reconnecting at once
    lost most of its streams."""
    running = await start_grpc_server([], "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            calls = [stub.Watch(health_pb2.HealthCheckRequest(service="")) for _ in range(BURST)]
            first = await asyncio.gather(*(call.read() for call in calls), return_exceptions=True)
            for call in calls:
                call.cancel()
    finally:
        await running.server.stop(0)
    failed = [r for r in first if isinstance(r, BaseException)]
    assert not failed, f"{len(failed)} of {BURST} failed, e.g. {failed[0]!r}"
    assert all(getattr(r, "status", None) == health_pb2.HealthCheckResponse.SERVING for r in first)
