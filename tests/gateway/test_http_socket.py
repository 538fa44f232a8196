"""The gateway's HTTP connections send small responses at once (TCP_NODELAY).

Regression: the gateway binds its listening socket itself and hands it to uvicorn; asyncio
sets TCP_NODELAY on an accepted connection only when the socket's `proto` says TCP, and a
socket made with `socket.socket(AF_INET, SOCK_STREAM)` has proto 0. Without the option,
every response after the first on a keep-alive connection waited ~40 ms for the client's
delayed ACK (Nagle), which was most of a turn's latency (docs/performance.md).
"""

from __future__ import annotations

import socket


async def test_accepted_http_connections_have_tcp_nodelay(stack):
    async with stack.client() as client:
        for _ in range(2):  # a keep-alive connection: the second request reuses it
            assert (await client.get("/healthz")).status_code == 200
        connections = list(stack.gateway.http.server_state.connections)
        assert connections, "the keep-alive connection should still be open"
        for protocol in connections:
            sock = protocol.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
