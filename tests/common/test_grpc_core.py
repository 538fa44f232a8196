"""gRPC core settings (services/grpc_core.py): applied before grpc is imported, operator's kept."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from services import grpc_core

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_configure_sets_the_default_and_keeps_an_operators_value() -> None:
    environ: dict[str, str] = {}
    assert grpc_core.configure(environ) is True
    assert environ == {"GRPC_EXPERIMENTS": grpc_core.EXPERIMENTS}
    for chosen in ("event_engine_client", ""):  # an operator's choice, even "none", is theirs
        environ = {"GRPC_EXPERIMENTS": chosen}
        assert grpc_core.configure(environ) is False
        assert environ == {"GRPC_EXPERIMENTS": chosen}


@pytest.mark.parametrize("service", ["gateway", "orchestrator", "billing", "tools"])
def test_every_service_sets_it_before_grpc_is_imported(service: str) -> None:
    """gRPC's C core reads GRPC_EXPERIMENTS once, when grpc is imported: a service's import
    chain (what `python -m services.<name>` runs) must set it first."""
    probe = textwrap.dedent(f"""
        import importlib.abc, os, sys
        seen = []
        class Watch(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "grpc":
                    seen.append(os.environ.get("GRPC_EXPERIMENTS"))
                return None
        sys.meta_path.insert(0, Watch())
        import services.{service}.__main__
        print(repr(seen))
    """)
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == repr([grpc_core.EXPERIMENTS])


EE_PROBE = textwrap.dedent("""
    import asyncio, os
    import services  # the services' settings, as `python -m services.<name>` applies them
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    def event_engine_switches():
        total = 0
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/comm") as comm:
                if comm.read().strip() != "event_engine":
                    continue
            with open(f"/proc/self/task/{task}/status") as status:
                total += sum(
                    int(line.split()[1])
                    for line in status
                    if line.startswith("voluntary_ctxt_switches")
                )
        return total

    async def main():
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            await stub.Check(health_pb2.HealthCheckRequest())
            before = event_engine_switches()
            for _ in range(300):
                await stub.Check(health_pb2.HealthCheckRequest())
            print(event_engine_switches() - before)
        await server.stop(0)

    asyncio.run(main())
""")


@pytest.mark.skipif(
    not os.path.isdir("/proc/self/task"), reason="reads thread names and switches from /proc"
)
def test_calls_do_not_hop_through_event_engine_threads() -> None:
    """The effect itself: with the EventEngine endpoints on (grpcio's default since 1.80), 300
    unary calls within one process woke grpc's `event_engine` threads ~1,800 times (measured
    1,761-1,817); with the services' settings ~20 (timers). Bounded at one per two calls."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    out = subprocess.run(
        [sys.executable, "-c", EE_PROBE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip().splitlines()[-1]) < 150
