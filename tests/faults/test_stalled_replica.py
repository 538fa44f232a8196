"""A replica that stalls (SIGSTOP) is dropped from the round by the keepalive pings; one that
only lags keeps its calls.

Two tools services run as processes behind one `ipv4:` target; an internal channel with a 1 s
keepalive (LOOPLINE_GRPC_KEEPALIVE_S, timeout 1 s) calls them in turn. One replica is stopped
with SIGSTOP: its connection stays open and its port still accepts (the kernel answers), but
nothing answers a ping, so within the keepalive window its connection is closed and the calls
keep succeeding through the other replica; only a call that went to it meanwhile fails (its
deadline, or UNAVAILABLE when the keepalive closes the connection under it).
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loopline.tools.v1 import tools_pb2, tools_pb2_grpc
from services.common.config import CommonSettings
from services.common.internal_auth import internal_channel
from tests.scale.conftest import ROOT, free_port, wait_port

KEEPALIVE = (1.0, 1.0)  # seconds between pings, seconds an answer may take
DEADLINE_S = 1.0  # of each call
IN_A_ROW = 30  # successful calls in a row once the stalled replica is out of the round
_STALLED = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)


def _spawn_tools(tmp_path: pathlib.Path, name: str) -> tuple[subprocess.Popen, int, pathlib.Path]:
    port = free_port()
    log = tmp_path / f"{name}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPLINE_")}
    env.update(
        LOOPLINE_DATA_DIR=str(tmp_path / name),
        LOOPLINE_TOOLS_PORT=str(port),
        LOOPLINE_TOOLS_METRICS_PORT="0",
        LOOPLINE_LOG_LEVEL="WARNING",
        LOOPLINE_SHUTDOWN_GRACE_S="1",
        PYTHONUNBUFFERED="1",
    )
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.tools"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    return process, port, log


async def test_calls_go_on_through_the_other_replica_once_one_is_stopped(tmp_path):
    replicas = [_spawn_tools(tmp_path, name) for name in ("tools-1", "tools-2")]
    try:
        await asyncio.gather(*(wait_port(port, process, log) for process, port, log in replicas))
        target = "ipv4:" + ",".join(f"127.0.0.1:{port}" for _, port, _ in replicas)
        async with internal_channel(target, "", keepalive=KEEPALIVE) as channel:
            stub = tools_pb2_grpc.ToolsServiceStub(channel)

            async def call() -> bool:
                try:
                    await stub.ListTools(tools_pb2.ListToolsRequest(), timeout=DEADLINE_S)
                except grpc.aio.AioRpcError as error:
                    # its deadline, or the keepalive's end of the stalled replica's connection
                    assert error.code() in _STALLED, error
                    return False
                return True

            for _ in range(10):  # both replicas connected and answering
                assert await call()
            stopped = replicas[0][0]
            stopped.send_signal(signal.SIGSTOP)
            started = time.monotonic()
            in_a_row, failed = 0, 0
            while in_a_row < IN_A_ROW:
                assert time.monotonic() - started < 15, f"{failed} calls failed, still failing"
                if await call():
                    in_a_row += 1
                else:
                    in_a_row, failed = 0, failed + 1
            recovered_s = time.monotonic() - started
            stopped.send_signal(signal.SIGCONT)
        # the calls to the stalled replica failed only until its pings went unanswered
        assert recovered_s < sum(KEEPALIVE) + 3 * DEADLINE_S + IN_A_ROW * 0.2, recovered_s
    finally:
        for process, _, _ in replicas:
            process.send_signal(signal.SIGCONT)
            process.terminate()
        for process, _, _ in replicas:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()


async def test_a_replica_that_lags_less_than_the_keepalive_timeout_keeps_its_streams(tmp_path):
    """An orchestrator far behind its work (10,000 runs streaming at once, `make bench`) reads
    its connections seconds late, pings included: with the default timeout its streams live
    through a lag of several seconds. Here a replica is stopped for 8 s while a stream is open
    and pings go every second: the stream and the connection are there when it goes on."""
    process, port, log = _spawn_tools(tmp_path, "tools-lagging")
    try:
        await wait_port(port, process, log)
        keepalive = (1.0, CommonSettings().grpc_keepalive_timeout_s)
        async with internal_channel(f"127.0.0.1:{port}", "", keepalive=keepalive) as channel:
            stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert (await stream.read()).status == health_pb2.HealthCheckResponse.SERVING
            process.send_signal(signal.SIGSTOP)
            await asyncio.sleep(8)
            process.send_signal(signal.SIGCONT)
            await asyncio.sleep(1)
            assert not stream.done(), await stream.code()
            await tools_pb2_grpc.ToolsServiceStub(channel).ListTools(
                tools_pb2.ListToolsRequest(), timeout=5
            )
            stream.cancel()
    finally:
        process.send_signal(signal.SIGCONT)
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
