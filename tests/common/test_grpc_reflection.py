"""Server reflection answers on grpc.reflection.v1 as well as v1alpha (every service)."""

from __future__ import annotations

import asyncio

import pytest

from services.common import grpc_server


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
async def test_reflection_lists_the_services_on_both_versions(version):
    """Reflection answers on v1 as well as v1alpha: grpcio-reflection ships v1alpha only, and
    grpcurl and Postman try /grpc.reflection.v1.ServerReflection/ServerReflectionInfo first."""
    import grpc
    from grpc_health.v1 import health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2

    running = await grpc_server.start_grpc_server(
        [
            (
                health_pb2_grpc.add_HealthServicer_to_server,
                grpc_server.health.aio.HealthServicer(),
                "example.v1.Example",
            )
        ],
        "127.0.0.1",
        0,
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            call = channel.stream_stream(
                f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
            )
            answers = [
                answer
                async for answer in call(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")])
                )
            ]
        names = sorted(service.name for service in answers[0].list_services_response.service)
        assert names == [
            "example.v1.Example",
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        ]
    finally:
        await running.server.stop(0)
        await asyncio.sleep(0)
