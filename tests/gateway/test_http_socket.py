"""The gateway's HTTP connections send small responses at once (TCP_NODELAY).

The gateway binds its listening socket itself and hands it to uvicorn; asyncio sets
TCP_NODELAY on an accepted connection only when the socket's `proto` says TCP, and a socket
made with `socket.socket(AF_INET, SOCK_STREAM)` has proto 0. Without the option, every
response after the first on a keep-alive connection waits ~40 ms for the client's delayed ACK
(Nagle), most of a turn's latency (docs/performance.md).
"""

from __future__ import annotations

import socket


async def test_accepted_http_connections_have_tcp_nodelay(services):
    async with services.client() as client:
        for _ in range(2):  # a keep-alive connection: the second request reuses it
            assert (await client.get("/healthz")).status_code == 200
        connections = list(services.gateway.http.server_state.connections)
        assert connections, "the keep-alive connection should still be open"
        for protocol in connections:
            sock = protocol.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1


async def test_a_stream_asked_for_over_http_1_0_is_505_not_a_chunked_body_it_cannot_read(services):
    """Over HTTP/1.0 the listen route answers 505 and says why: an event stream is only sent
    chunked, and uvicorn would send chunks even to an HTTP/1.0 client, which has no chunked
    encoding and reads the chunk sizes as data."""
    import asyncio
    import json

    from tests.orchestrator.helpers import run_turn

    async with services.client() as client:
        body, _ = await run_turn(client, {"say": "hi"})
    port = int(services.base_url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    headers = "".join(f"{k}: {v}\r\n" for k, v in services.headers().items())
    writer.write(f"GET {body['stream_url']} HTTP/1.0\r\nHost: 127.0.0.1\r\n{headers}\r\n".encode())
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 10)  # HTTP/1.0: the server closes after the answer
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0].split(b" ")[1] == b"505"
    assert b"transfer-encoding" not in head.lower()
    assert json.loads(payload) == {
        "detail": "Event streams need HTTP/1.1 (they are sent with chunked transfer encoding);"
        " retry with HTTP/1.1"
    }
