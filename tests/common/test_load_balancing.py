"""Internal channels spread their calls over every address their target resolves to.

Two replicas of a service (the tools service's gRPC interface, answered by a servicer that
counts its calls) are put behind one target: a DNS name with two A records (served by a DNS
server the test starts: tests/dns_server.py; the machine's `localhost` has one address here),
and an `ipv4:` list. `internal_channel` (round_robin) gives both replicas calls; a plain channel
(gRPC's default pick_first) gives them all to one, so the test tells the two apart.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest

from loopline.tools.v1 import tools_pb2, tools_pb2_grpc
from services.common.errors import TOOLS_DOMAIN, rpc_handler
from services.common.grpc_server import PortUnavailable, RunningServer, start_grpc_server
from services.common.internal_auth import internal_channel
from services.tools.server import SERVICE_NAME
from tests.dns_server import DnsServer

CALLS = 40


class CountingTools(tools_pb2_grpc.ToolsServiceServicer):
    """A tools "replica" that counts the ListTools calls it answers, by replica name."""

    def __init__(self, name: str, counts: collections.Counter[str]) -> None:
        self.name = name
        self.counts = counts

    @rpc_handler(domain=TOOLS_DOMAIN)
    async def ListTools(self, request, context):  # noqa: N802 - gRPC method name
        self.counts[self.name] += 1
        return tools_pb2.ListToolsResponse()


@contextlib.asynccontextmanager
async def _replicas(
    *addresses: tuple[str, int | None],
) -> AsyncIterator[tuple[list[int], collections.Counter[str]]]:
    """Replicas on `addresses` ((host, port): port 0 = any free one, None = the first replica's);
    yields their ports and the call counts by host:port."""
    counts: collections.Counter[str] = collections.Counter()
    running: list[RunningServer] = []
    try:
        for host, port in addresses:
            servicer = CountingTools("", counts)
            binding = (tools_pb2_grpc.add_ToolsServiceServicer_to_server, servicer, SERVICE_NAME)
            bind = running[0].port if port is None else port
            started = await start_grpc_server([binding], host, bind)
            servicer.name = f"{host}:{started.port}"
            running.append(started)
        yield [server.port for server in running], counts
    finally:
        for server in running:
            await server.stop(0)


async def _call(channel: grpc.aio.Channel, times: int = CALLS) -> None:
    stub = tools_pb2_grpc.ToolsServiceStub(channel)
    await channel.channel_ready()
    for _ in range(times):
        await stub.ListTools(tools_pb2.ListToolsRequest(), timeout=5)


async def test_replicas_behind_one_dns_name_with_two_addresses_both_receive_calls():
    dns = DnsServer("tools.loopline.test", ["127.0.0.1", "127.0.0.2"])
    await dns.start()
    try:
        try:
            # the second replica takes the first one's port on the other address
            replicas = _replicas(("127.0.0.1", 0), ("127.0.0.2", None))
            async with replicas as (ports, counts):
                target = f"dns://127.0.0.1:{dns.port}/tools.loopline.test:{ports[0]}"
                async with internal_channel(target, "") as channel:
                    await _call(channel)
                balanced = dict(counts)
                counts.clear()
                async with grpc.aio.insecure_channel(target) as default_channel:  # pick_first
                    await _call(default_channel)
                picked_first = dict(counts)
        except PortUnavailable:
            pytest.skip("127.0.0.2 cannot be bound here (not every 127/8 address is loopback)")
    finally:
        dns.close()
    assert dns.answered >= 1
    assert set(balanced) == {f"127.0.0.1:{ports[0]}", f"127.0.0.2:{ports[0]}"}
    assert min(balanced.values()) >= CALLS // 4, balanced  # round-robin: about half each
    assert len(picked_first) == 1, picked_first  # what round_robin changes


async def test_an_ipv4_list_spreads_the_calls_over_every_address():
    async with _replicas(("127.0.0.1", 0), ("127.0.0.1", 0)) as (ports, counts):
        target = "ipv4:" + ",".join(f"127.0.0.1:{port}" for port in ports)
        async with internal_channel(target, "") as channel:
            await _call(channel)
        balanced = dict(counts)
        counts.clear()
        async with grpc.aio.insecure_channel(target) as default_channel:  # pick_first
            await _call(default_channel)
        picked_first = dict(counts)
    assert set(balanced) == {f"127.0.0.1:{port}" for port in ports}
    assert min(balanced.values()) >= CALLS // 4, balanced
    assert len(picked_first) == 1, picked_first  # what round_robin changes
