"""services/common/grpc_server.py: a port in use is an error at start, not a shared port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from services.common.grpc_server import PortUnavailable, start_grpc_server


async def test_a_second_server_on_a_port_in_use_fails_to_start():
    """A second server on a port in use fails to start. With gRPC's default SO_REUSEPORT two
    orchestrators would both serve 127.0.0.1:PORT, the gateway's calls landing on either, and a
    listener of a run of the other copy would get HTTP 200 with an empty stream."""
    first = await start_grpc_server([], "127.0.0.1", 0)
    try:
        with pytest.raises(PortUnavailable, match="in use"):
            await start_grpc_server([], "127.0.0.1", first.port)
    finally:
        await first.server.stop(0)


def _free_port() -> int:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    return port


@pytest.mark.parametrize(
    ("service", "setting", "what"),
    [
        ("billing", "LOOPLINE_BILLING_PORT", "gRPC port"),
        # bound after the gRPC port (the service stops what it started)
        ("billing", "LOOPLINE_BILLING_METRICS_PORT", "metrics port"),
        (
            "gateway",
            "LOOPLINE_HTTP_PORT",
            "HTTP port",
        ),  # bound by the gateway itself, not by start_grpc_server
    ],
)
def test_a_service_started_on_a_port_in_use_says_so_in_one_line_and_exits_2(
    tmp_path, service, setting, what
):
    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("LOOPLINE_")},
            "LOOPLINE_LOG_LEVEL": "WARNING",
            "LOOPLINE_DATA_DIR": str(tmp_path),
            "LOOPLINE_BILLING_PORT": "0",
            "LOOPLINE_BILLING_METRICS_PORT": "0",
            setting: str(port),
            "LOOPLINE_GATEWAY_GRPC_PORT": str(_free_port()),
        }
        result = subprocess.run(
            [sys.executable, "-m", f"services.{service}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        taken.close()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert (
        f"{service}: cannot start: cannot bind the {what} " in result.stderr
        and f":{port}" in result.stderr
    ), result.stderr
