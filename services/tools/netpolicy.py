"""The outbound policy for URLs an organization supplies (the `http` integration, MCP servers
over HTTP, the `postgresql` integration's host).

Rule (DESIGN.md "services/tools"): org-supplied URLs may not reach loopback,
link-local or private addresses unless the operator allows them
(`LOOPLINE_TOOLS_ALLOW_PRIVATE_NETWORK`). The check happens where the socket is opened:
the host is resolved once, every address it resolves to is checked, and the connection
goes to a checked address. So a redirect to an internal host, or a DNS answer that
changes between a check and the connection (DNS rebinding), is refused too.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

# httpx and httpcore (~7 MiB resident with what httpx imports) are loaded by the first
# `guarded_client` (or `GuardedBackend`), not at start: an idle service never needs them.


class OutboundPolicyError(Exception):
    """A destination the outbound policy refuses; the message is safe to show the model."""


def classify(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why `address` is not a public destination ("loopback", "private", ...), or None if it is.

    An IPv6 address that carries an IPv4 address is judged by that one: IPv4-mapped
    (::ffff:0:0/96), 6to4 (2002::/16, RFC 3056) and Teredo (2001::/32, RFC 4380: its client
    address), so that 2002:7f00:1:: does not reach 127.0.0.1.
    """
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        elif address.sixtofour is not None:
            address = address.sixtofour
        elif address.teredo is not None:
            address = address.teredo[1]
    if address.is_unspecified:
        return "unspecified"
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local"
    if address.is_multicast:
        return "multicast"
    if address.is_private:
        return "private"
    if address.is_reserved or not address.is_global:
        return "reserved"
    return None


async def resolve_checked(host: str, port: int, allow_private: bool) -> list[str]:
    """The addresses of `host` (IP literal or name), all of them allowed by the policy.

    Raises OutboundPolicyError when the host does not resolve or when any address it
    resolves to is not public and `allow_private` is false (one bad address refuses the
    host: a resolver may answer with any of them).
    """
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise OutboundPolicyError(f"cannot resolve host {host!r}") from exc
    addresses: list[str] = []
    for _family, _type, _proto, _name, sockaddr in infos:
        text = str(sockaddr[0]).split("%", 1)[0]
        if text not in addresses:
            addresses.append(text)
    if not addresses:
        raise OutboundPolicyError(f"cannot resolve host {host!r}")
    if not allow_private:
        for text in addresses:
            kind = classify(ipaddress.ip_address(text))
            if kind is not None:
                article = "an" if kind[0] in "aeiou" else "a"  # "an unspecified address"
                raise OutboundPolicyError(
                    f"destination {host!r} resolves to {article} {kind} address, which the "
                    "outbound policy "
                    "of this deployment does not allow"
                )
    return addresses


_guarded_backends: dict[str, type] = {}


def _guarded_backend_class(core: str = "httpcore") -> type:
    """The GuardedBackend class of the httpcore module named `core`, defined on first use (it
    subclasses that module's network backend). `httpcore` serves httpx (the `http` integration),
    `httpcore2` serves httpx2 (the HTTP client of the `mcp` SDK: MCP servers over HTTP)."""
    backend = _guarded_backends.get(core)
    if backend is None:
        import importlib

        httpcore = importlib.import_module(core)

        class GuardedBackend(httpcore.AsyncNetworkBackend):  # type: ignore[name-defined]
            """An httpcore network backend that checks every TCP destination against the policy.

            The host is resolved here, once per connection; every address it resolves to is
            checked and the socket is opened to one of those addresses (never to the name, which
            a second lookup could resolve elsewhere: DNS rebinding). The connection above keeps
            the name for the Host header and for TLS (SNI and the certificate check).

            Args:
                allow_private: the operator's `tools_allow_private_network`.
            """

            def __init__(self, allow_private: bool) -> None:
                self._allow_private = allow_private
                self._inner = httpcore.AnyIOBackend()

            async def connect_tcp(
                self,
                host: str,
                port: int,
                timeout: float | None = None,
                local_address: str | None = None,
                socket_options: Iterable[Any] | None = None,
            ) -> Any:
                """Resolve and check `host`, then connect to its first allowed address."""
                addresses = await resolve_checked(host, port, self._allow_private)
                last: Exception | None = None
                for address in addresses:
                    try:
                        return await self._inner.connect_tcp(
                            address,
                            port,
                            timeout=timeout,
                            local_address=local_address,
                            socket_options=socket_options,
                        )
                    except httpcore.ConnectError as exc:
                        last = exc
                assert last is not None
                raise last

            async def connect_unix_socket(
                self,
                path: str,
                timeout: float | None = None,
                socket_options: Any = None,
            ) -> Any:
                """Unix sockets are never an allowed destination."""
                raise OutboundPolicyError("unix sockets are not an allowed destination")

            async def sleep(self, seconds: float) -> None:
                """Sleep (used by httpcore's retries)."""
                await self._inner.sleep(seconds)

        backend = _guarded_backends[core] = GuardedBackend
    return backend


def __getattr__(name: str) -> Any:
    # `netpolicy.GuardedBackend` stays importable; the class is built when first asked for.
    if name == "GuardedBackend":
        return _guarded_backend_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def guarded_client(allow_private: bool, timeout_s: float) -> httpx.AsyncClient:
    """An httpx client whose every connection passes the outbound policy.

    No proxies from the environment (`trust_env=False`: a proxy would hide the real
    destination), no redirects followed automatically, `timeout_s` for each phase.
    Relies on httpx 0.28's `AsyncHTTPTransport._pool` (httpx is pinned in pyproject.toml).
    """
    import httpcore
    import httpx

    transport = httpx.AsyncHTTPTransport(trust_env=False)
    transport._pool = httpcore.AsyncConnectionPool(  # noqa: SLF001 - see docstring
        ssl_context=httpx.create_ssl_context(trust_env=True),  # SSL_CERT_FILE/_DIR trusted
        max_connections=10,
        max_keepalive_connections=0,
        network_backend=_guarded_backend_class()(allow_private),
    )
    return httpx.AsyncClient(
        transport=transport, trust_env=False, follow_redirects=False, timeout=timeout_s
    )


def guarded_mcp_client(allow_private: bool, timeout_s: float, headers: dict[str, str]) -> Any:
    """An httpx2 client (the `mcp` SDK's HTTP client) whose every connection passes the outbound
    policy, as `guarded_client`: each connection resolves and checks its host once and connects
    to the checked address (never resolving the name again: DNS rebinding).

    No proxies from the environment, no redirects followed by the client (the SDK follows
    same-origin ones itself, through this client, so through the policy), `timeout_s` for each
    phase, `headers` on every request. Relies on httpx2's `AsyncHTTPTransport._pool` (httpx2
    2.16, the version the pinned mcp brings), as `guarded_client` does on httpx's.
    """
    import httpcore2
    import httpx2

    # one context (loading CAs costs ms) for both uses; SSL_CERT_FILE/_DIR are trusted
    ssl_context = httpx2.create_ssl_context(trust_env=True)
    transport = httpx2.AsyncHTTPTransport(verify=ssl_context, trust_env=False)
    transport._pool = httpcore2.AsyncConnectionPool(  # noqa: SLF001 - see docstring
        ssl_context=ssl_context,
        max_connections=10,
        max_keepalive_connections=10,
        network_backend=_guarded_backend_class("httpcore2")(allow_private),
    )
    return httpx2.AsyncClient(
        transport=transport,
        headers=headers,
        timeout=httpx2.Timeout(timeout_s),
        follow_redirects=False,
        trust_env=False,
    )
