"""Large fan-out rounds written on every core (services/gateway/parallel_write.py).

Rules: every item of a batch is written once, split between the calling thread and the
helpers; an item a socket did not take whole (full buffer, partial write) or refused
(closed peer) is reported with what the kernel took, for its transport to carry on; only
plain TCP transports are written directly (never TLS); and over the real gateway, a run's
listeners served by parallel rounds — one of them a client that stops reading — each get
exactly the run's frames in order.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import os
import socket
import ssl
import threading
from typing import Any

import orjson
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from services.gateway import parallel_write
from services.gateway.parallel_write import ParallelWriter, socket_fd, write_share
from tests.conftest import script


def _pairs(count: int) -> list[tuple[socket.socket, socket.socket]]:
    pairs = [socket.socketpair() for _ in range(count)]
    for ours, _ in pairs:
        ours.setblocking(False)
    return pairs


def _fill(sock: socket.socket) -> None:
    while True:
        try:
            sock.send(b"x" * 65536)
        except BlockingIOError:
            return


def _read_all(sock: socket.socket) -> bytes:
    sock.setblocking(False)
    data = b""
    while True:
        try:
            piece = sock.recv(1 << 20)
        except BlockingIOError:
            return data
        if not piece:
            return data
        data += piece


def test_write_share_reports_a_full_socket_a_partial_write_and_a_closed_peer():
    (ok, ok_peer), (full, full_peer), (partial, partial_peer), (closed, closed_peer) = _pairs(4)
    try:
        _fill(full)
        partial.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        closed_peer.close()
        big = b"y" * (4 << 20)  # more than any socket buffer takes at once
        items = [
            (ok.fileno(), b"hello"),
            (full.fileno(), b"more"),
            (partial.fileno(), big),
            (closed.fileno(), b"lost"),
        ]
        short = dict(write_share(items, 0, len(items)))
        assert 0 not in short and _read_all(ok_peer) == b"hello"
        assert short[1] == 0, "a full socket took nothing (BlockingIOError)"
        assert 0 < short[2] < len(big), "a partial write reports what the kernel took"
        assert short[3] == -1, "an error (EPIPE) is reported for the transport to see"
        assert _read_all(partial_peer) == big[: short[2]]
    finally:
        for sock in (ok, ok_peer, full, full_peer, partial, partial_peer, closed):
            sock.close()


def test_a_large_batch_is_split_between_the_caller_and_the_helper_threads(monkeypatch):
    pairs = _pairs(300)
    _fill(pairs[250][0])
    threads: set[str] = set()
    real_write = os.write

    def write(fd: int, data: bytes) -> int:
        threads.add(threading.current_thread().name)
        return real_write(fd, data)

    monkeypatch.setattr(parallel_write.os, "write", write)
    writer = ParallelWriter(threads=2, min_batch=100)
    try:
        items = [(ours.fileno(), b"frame %d" % i) for i, (ours, _) in enumerate(pairs)]
        assert writer.write(items) == [(250, 0)]
        assert len(threads) == 3 and threading.current_thread().name in threads
        for i, (_, peer) in enumerate(pairs):
            if i != 250:
                assert _read_all(peer) == b"frame %d" % i
        threads.clear()
        assert writer.write(items[:99]) == []  # under min_batch: inline, no hand-off
        assert threads == {threading.current_thread().name}
    finally:
        writer.close()
        for ours, peer in pairs:
            ours.close()
            peer.close()
    assert not writer.enabled_for(1000), "a closed writer writes inline"


def _self_signed() -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    return (
        cert.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )


async def _server_transport(
    tmp_path, tls: bool
) -> tuple[Any, asyncio.AbstractServer, asyncio.StreamWriter]:
    accepted: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    class Server(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            if not accepted.done():
                accepted.set_result(transport)

    server_ctx = client_ctx = None
    if tls:
        cert, key = _self_signed()
        (tmp_path / "cert.pem").write_bytes(cert)
        (tmp_path / "key.pem").write_bytes(key)
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_ctx.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
        client_ctx = ssl.create_default_context(cafile=tmp_path / "cert.pem")
    server = await asyncio.get_running_loop().create_server(Server, "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    _, client = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx)
    return await asyncio.wait_for(accepted, 5), server, client


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_only_plain_tcp_transports_are_written_directly_never_tls(tmp_path, loop_kind):
    """A TLS connection's socket must never be written directly: the bytes would bypass the
    encryption. Only uvloop's and asyncio's plain TCP transports give a descriptor."""
    if loop_kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.SelectorEventLoop()

    async def check() -> None:
        for tls in (False, True):
            transport, server, client = await _server_transport(tmp_path, tls)
            try:
                fd = socket_fd(transport)
                if tls:
                    assert fd == -1
                else:
                    assert fd == transport.get_extra_info("socket").fileno() >= 0
            finally:
                client.close()
                transport.close()
                server.close()
                await server.wait_closed()

    try:
        loop.run_until_complete(check())
    finally:
        loop.close()
    assert socket_fd(object()) == -1


async def _get_stream(
    port: int, path: str, headers: dict[str, str], rcvbuf: int | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 22)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}\r\n".encode())
    await writer.drain()
    status = await reader.readuntil(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 200"), status[:200]
    return reader, writer


async def _frames(reader: asyncio.StreamReader) -> list[dict[str, Any]]:
    """The body's frames, read to the last chunk (RFC 9112 section 7.1), heartbeats left out."""
    body = b""
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
        if size == 0:
            break
        body += (await reader.readexactly(size + 2))[:-2]
    frames = []
    for raw in body.split(b"\n\n"):
        if raw:
            assert raw.startswith(b"data: ")
            frame = orjson.loads(raw[6:])
            if frame["type"] != "heartbeat":
                frames.append(frame)
    return frames


async def test_listeners_of_parallel_rounds_each_get_every_frame_in_order_even_one_not_reading(
    services, monkeypatch
):
    fanout = services.gateway.app.state.fanout
    assert fanout._writer is not None
    fanout._writer.threads = max(
        fanout._writer.threads, 1
    )  # the rule holds whatever the machine's cores
    batches: list[tuple[int, list[tuple[int, int]]]] = []
    real_write = fanout._writer.write

    def spy(items: list[tuple[int, bytes]]) -> list[tuple[int, int]]:
        short = real_write(items)
        batches.append((len(items), short))
        return short

    monkeypatch.setattr(fanout._writer, "write", spy)
    words = " ".join(f"w{i:05d}" for i in range(40_000))  # ~280 KB of answer in 40 frames
    message = script(
        {"tool": "get_available_integrations", "input": {}, "sleep_ms": 2500},
        {"say": words, "chunks": 40},
    )
    async with services.client() as client:
        started = (await client.post("/assistant/chat", json={"message": message})).json()
    headers = services.headers()
    listeners = [
        await _get_stream(services.gateway.port, started["stream_url"], headers) for _ in range(150)
    ]
    slow_reader, slow_writer = await _get_stream(
        services.gateway.port, started["stream_url"], headers, rcvbuf=4096
    )
    slow_port = slow_writer.get_extra_info("sockname")[1]
    hub = next(iter(fanout._hubs.values()))
    slow = next(
        lst for lst in hub.streams if lst.transport.get_extra_info("peername")[1] == slow_port
    )
    slow.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    assert slow.fd >= 0

    everyone = await asyncio.wait_for(
        asyncio.gather(*(_frames(reader) for reader, _ in listeners)), 60
    )
    await asyncio.sleep(0.5)  # the slow client reads only now, long after the others finished
    slow_frames = await asyncio.wait_for(_frames(slow_reader), 60)
    for _, writer in [*listeners, (None, slow_writer)]:
        writer.close()

    expected = everyone[0]
    assert [f["type"] for f in expected][:3] == ["metadata", "tool_call", "tool_result"]
    assert expected[-1]["type"] == "done" and expected[-1]["data"]["response"] == words
    assert "".join(f["data"]["chunk"] for f in expected if f["type"] == "response_chunk").endswith(
        words
    )
    assert all(frames == expected for frames in everyone)
    assert slow_frames == expected, (
        "the client that stopped reading got every frame, in order, once"
    )
    assert any(size >= 128 for size, _ in batches), "the live frames went out in parallel rounds"
    assert any(short for _, short in batches), "the slow socket's share went back to its transport"
    assert json.dumps(expected)  # plain JSON throughout
