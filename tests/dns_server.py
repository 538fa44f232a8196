"""A DNS server for load-balancing tests: one name with several A records, as a Kubernetes
headless Service gives (one record per ready pod).

gRPC dials it as `dns://127.0.0.1:<port>/<name>:<grpc port>` (the DNS server in the target's
authority, c-ares). The machine's own resolver is no use here: `localhost` resolves to one
address only, and the hosts file is not the test's to change. Answers only the A query of its
name (the records' addresses, e.g. 127.0.0.1 and 127.0.0.2: every 127/8 address is loopback
on Linux); any other query gets an answer without records. No DNS library is installed; a reply
to one question is the header, the question echoed, and a fixed-size record per address
(RFC 1035 section 4).
"""

from __future__ import annotations

import asyncio
import socket
import struct

_A, _IN = 1, 1
_RESPONSE_FLAGS = 0x8180  # a response, recursion desired and available, no error
_NAME_POINTER = b"\xc0\x0c"  # the question's name, at offset 12 of the message


class DnsServer(asyncio.DatagramProtocol):
    """Answers the A query of `name` with `addresses` on UDP 127.0.0.1 (`port`, set by `start`);
    counts the A queries of that name it answered (`answered`)."""

    def __init__(self, name: str, addresses: list[str], ttl_s: int = 1) -> None:
        self.name = name.lower().rstrip(".")
        self.addresses = addresses
        self.ttl_s = ttl_s
        self.answered = 0
        self.port = 0
        self._transport: asyncio.DatagramTransport | None = None

    async def start(self) -> int:
        """Listen on a free UDP port of 127.0.0.1; returns it (also `port`)."""
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: self, local_addr=("127.0.0.1", 0)
        )
        self._transport = transport
        self.port = transport.get_extra_info("sockname")[1]
        return self.port

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        reply = self._reply(data)
        if reply is not None and self._transport is not None:
            self._transport.sendto(reply, addr)

    def _reply(self, query: bytes) -> bytes | None:
        """The response to `query` (one question), None when it is malformed."""
        try:
            (query_id,) = struct.unpack("!H", query[:2])
            labels, offset = [], 12
            while query[offset]:
                length = query[offset]
                labels.append(query[offset + 1 : offset + 1 + length].decode("ascii"))
                offset += 1 + length
            kind, klass = struct.unpack("!HH", query[offset + 1 : offset + 5])
        except (struct.error, IndexError, UnicodeDecodeError):
            return None
        question = query[12 : offset + 5]
        records = b""
        if ".".join(labels).lower() == self.name and (kind, klass) == (_A, _IN):
            self.answered += 1
            for address in self.addresses:
                record = struct.pack("!HHIH", _A, _IN, self.ttl_s, 4) + socket.inet_aton(address)
                records += _NAME_POINTER + record
        count = len(self.addresses) if records else 0
        header = struct.pack("!HHHHHH", query_id, _RESPONSE_FLAGS, 1, count, 0, 0)
        return header + question + records
