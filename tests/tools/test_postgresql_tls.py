"""An organization's PostgreSQL DSN requires TLS unless it says otherwise.

With no `sslmode` the driver would use `prefer`, which goes on without TLS when the server
refuses it, and then answers a request for a clear-text password. A server that
refuses TLS here is a fake one that records what the client sends after its refusal.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator

import pytest

from services.tools.catalogue import ActionContext, ActionError
from services.tools.integrations import postgresql
from services.tools.integrations.postgresql import _connect_args
from services.tools.integrations.postgresql_dsn import DEFAULT_SSLMODE

PASSWORD = "Clear-Text-Canary-7781"
SSL_REQUEST = struct.pack("!ii", 8, 80877103)


class NoTlsServer:
    """A fake PostgreSQL server on 127.0.0.1 that refuses TLS ('N'), then asks for a clear-text
    password and records every byte it receives."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            first = await reader.readexactly(8)
            self.received += first
            if first == SSL_REQUEST:
                writer.write(b"N")  # no TLS here
                await writer.drain()
                first = await reader.readexactly(8)
                self.received += first
            length = struct.unpack("!i", first[:4])[0]
            self.received += await reader.readexactly(length - 8)  # the rest of the startup message
            writer.write(b"R" + struct.pack("!ii", 8, 3))  # AuthenticationCleartextPassword
            await writer.drain()
            self.received += await asyncio.wait_for(reader.read(4096), 2)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> NoTlsServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()


@pytest.fixture
async def no_tls_server() -> AsyncIterator[NoTlsServer]:
    async with NoTlsServer() as server:
        yield server


def _context(dsn: str) -> ActionContext:
    return ActionContext(
        secret={"dsn": dsn},
        auth_type="api_key",
        timeout_s=5,
        max_output_bytes=100_000,
        allow_private_network=True,
    )


async def test_a_dsn_without_sslmode_never_sends_the_password_to_a_server_that_refuses_tls(
    no_tls_server,
):
    dsn = f"postgresql://reader:{PASSWORD}@127.0.0.1:{no_tls_server.port}/sales"
    with pytest.raises(ActionError) as failure:
        await postgresql.list_schemas(_context(dsn), {})
    assert "TLS" in str(failure.value) and PASSWORD not in str(failure.value)
    assert bytes(no_tls_server.received[:8]) == SSL_REQUEST  # TLS was asked for
    assert PASSWORD.encode() not in no_tls_server.received
    assert b"reader" not in no_tls_server.received  # not even the startup message went out in clear


async def test_sslmode_disable_in_the_dsn_connects_without_tls(no_tls_server):
    """The DSN may ask for a plain connection explicitly (a server without TLS on a trusted
    network)."""
    dsn = f"postgresql://reader:{PASSWORD}@127.0.0.1:{no_tls_server.port}/sales?sslmode=disable"
    with pytest.raises(ActionError):  # the fake server does not finish the handshake
        await postgresql.list_schemas(_context(dsn), {})
    assert bytes(no_tls_server.received[:8]) != SSL_REQUEST
    assert PASSWORD.encode() in no_tls_server.received  # what sslmode=disable means


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("", DEFAULT_SSLMODE),
        ("?sslmode=disable", "disable"),
        ("?sslmode=prefer", "prefer"),
        ("?sslmode=verify-full", "verify-full"),
    ],
)
async def test_the_driver_gets_require_unless_the_dsn_names_an_sslmode(
    monkeypatch, query, expected
):
    async def public(host: str, port: int, allow_private: bool) -> list[str]:
        return ["93.184.216.34"]

    monkeypatch.setattr(postgresql, "resolve_checked", public)
    assert DEFAULT_SSLMODE == "require"
    checked = await _connect_args(
        f"postgresql://u:p@db.example.com:5432/x{query}", allow_private=False
    )
    assert checked["ssl"] == expected
    private = await _connect_args(f"postgresql://u:p@10.0.0.5:5432/x{query}", allow_private=True)
    assert private["ssl"] == expected
