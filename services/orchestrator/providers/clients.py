"""The provider SDK clients of one orchestrator, kept across model calls and runs.

An `openai.AsyncOpenAI` or `anthropic.AsyncAnthropic` client owns a connection pool; built
anew for every call, it opened a new connection (and TLS handshake) for every step of a turn.
`ProviderClients` keeps one client per `ClientSpec` (provider kind, base URL, key and timeout:
everything a client is built from), so the steps and runs that use one provider with one key
reuse its keep-alive connections.

Bounded: beyond `max_clients` the least recently used client is dropped from the cache and
closed as soon as no call is using it (a call in flight keeps its client until it ends);
`aclose()`, at the orchestrator's stop, closes them all. `max_clients=0` keeps none: every
call gets a client of its own, closed when the call ends.

The key (the platform's, or an organization's own) lives in the SDK client only: the cache is
keyed by its SHA-256 digest, and a spec's repr leaves it out.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)

MAX_CLIENTS = 32


class SupportsClose(Protocol):
    """An SDK client: both SDKs close their HTTP connection pool with `await client.close()`."""

    async def close(self) -> None: ...


ClientT = TypeVar("ClientT", bound=SupportsClose)


MAX_CONNECTIONS = 10_000  # a client's HTTP connections at most (LOOPLINE_LLM_MAX_CONNECTIONS)


@dataclass(frozen=True)
class ClientSpec:
    """What a provider client is built from; two calls with equal specs share one client.

    Attributes:
        kind: "openai" (chat-completions wire format) or "anthropic".
        base_url: the API base URL.
        api_key: the key the client sends (kept out of repr and of the cache key).
        timeout_s: the client's per-request timeout in seconds.
        max_connections: the client's HTTP connections at most: each streamed call holds one,
            so this bounds the calls in flight to one provider (LOOPLINE_LLM_MAX_CONNECTIONS).
    """

    kind: str
    base_url: str
    api_key: str = field(repr=False)
    timeout_s: float
    max_connections: int = MAX_CONNECTIONS

    @property
    def cache_key(self) -> tuple[str, str, str, float, int]:
        """The spec with the key replaced by its SHA-256 digest."""
        digest = hashlib.sha256(self.api_key.encode()).hexdigest()
        return (self.kind, self.base_url, digest, self.timeout_s, self.max_connections)


def http_limits(spec: ClientSpec) -> Any:
    """The SDK client's connection pool for `spec` (an `httpx2.Limits`, the SDKs' HTTP library):
    `max_connections` streamed calls at once (the SDKs' own default, 1,000, would queue the
    rest); idle ones close after `keepalive_expiry` (5 s). Given to the SDKs' aiohttp transport
    (http_client.py)."""
    import httpx2  # noqa: PLC0415 - with the provider SDKs, on first use

    return httpx2.Limits(max_connections=spec.max_connections)


@dataclass(eq=False)
class _Entry:
    """A built client, how many calls use it now, and whether it left the cache."""

    client: Any
    leases: int = 0
    dropped: bool = False


class ProviderClients:
    """One SDK client per ClientSpec, least recently used first out; see the module docstring.

    Args:
        max_clients: how many clients are kept at most (0 keeps none).
    """

    def __init__(self, max_clients: int = MAX_CLIENTS) -> None:
        self.max_clients = max(0, max_clients)
        self._entries: OrderedDict[tuple[str, str, str, float, int], _Entry] = OrderedDict()
        self._closed = False

    def __len__(self) -> int:
        """How many clients are kept now."""
        return len(self._entries)

    @asynccontextmanager
    async def lease(
        self, spec: ClientSpec, build: Callable[[ClientSpec], ClientT]
    ) -> AsyncIterator[ClientT]:
        """The client for `spec` (built by `build(spec)` when none is kept) for one call.

        A client dropped meanwhile (evicted, or the cache closed) is closed when its last
        call ends; a client used after `aclose()` is the call's own, closed when it ends.
        """
        entry, evicted = self._checkout(spec, build)
        try:
            if evicted:
                await _close(evicted)
            yield entry.client
        finally:
            entry.leases -= 1
            if entry.dropped and entry.leases == 0:
                await _close([entry])

    def _checkout(
        self, spec: ClientSpec, build: Callable[[ClientSpec], Any]
    ) -> tuple[_Entry, list[_Entry]]:
        """The entry for `spec` (leased once more, most recently used now) and the entries the
        bound pushed out that no call is using (to be closed by the caller)."""
        key = spec.cache_key
        entry = self._entries.get(key)
        if entry is None:
            entry = _Entry(build(spec))
            if self._closed:
                entry.dropped = True
            else:
                self._entries[key] = entry
        else:
            self._entries.move_to_end(key)
        entry.leases += 1
        evicted: list[_Entry] = []
        while len(self._entries) > self.max_clients:
            _, old = self._entries.popitem(last=False)
            old.dropped = True
            if old.leases == 0:
                evicted.append(old)
        return entry, evicted

    async def aclose(self) -> None:
        """Close every kept client (one still in use: when its call ends); later calls get a
        client of their own."""
        self._closed = True
        entries = list(self._entries.values())
        self._entries.clear()
        for entry in entries:
            entry.dropped = True
        await _close([entry for entry in entries if entry.leases == 0])


async def _close(entries: list[_Entry]) -> None:
    """Close the clients of `entries`; a cancelled caller does not stop the closing, and a client
    that fails to close is logged (the error's class only) and never fails a model call."""

    async def close_one(entry: _Entry) -> None:
        try:
            await entry.client.close()
        except Exception as error:  # noqa: BLE001 - a close that fails must not fail the call
            log.warning(
                "closing a provider client failed",
                extra={"fields": {"error_class": type(error).__name__}},
            )

    if entries:
        await asyncio.shield(asyncio.gather(*(close_one(entry) for entry in entries)))
