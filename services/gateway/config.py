"""Gateway settings (environment variables with the LOOPLINE_ prefix)."""

from __future__ import annotations

import os

from pydantic import Field

from services.common.config import MAX_PORT, MAX_SECONDS, CommonSettings


def _default_write_threads() -> int:
    """One fewer than the cores this process may run on (the event loop's thread writes too),
    at most 3."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(0, min(3, cores - 1))


class GatewaySettings(CommonSettings):
    """Settings of the gateway.

    Attributes:
        http_port: HTTP port (0 = any free port, else 1-65535); LOOPLINE_HTTP_PORT, default 8000.
        http_host: interface the HTTP server binds.
        gateway_grpc_port: port of the gateway's gRPC health service (0 = any).
        gateway_database_url: identity database URL; empty = SQLite `<data_dir>/gateway.db`.
        auto_migrate: apply Alembic migrations at start.
        heartbeat_interval_s: seconds of silence on a listen stream before a heartbeat frame
            (spec: 15; more than 0, since 0 would send heartbeats in a busy loop).
        max_body_bytes: largest request body accepted (larger -> 413); at least 1 (0 would
            refuse every POST).
        dev_api_key / dev_org_id: fix the key and organization that `seed-dev` creates (the key: at
            least 20 printable ASCII characters without spaces, else seed-dev refuses it).
        auth_cache_ttl_s: how long a resolved API key (and an organization's default model) is
            cached in memory; 0 = not cached, read the database on every request.
        idempotency_ttl_s: how long an Idempotency-Key and its response are kept (24 h); more
            than 0 (a key kept for no time would not protect a retry).
        fanout_write_threads: helper threads that write a large fan-out round's frames to the
            listeners' sockets beside the event loop's thread (services/gateway/parallel_write.py);
            0 = the event loop's thread writes every frame; -1 (the default) = one fewer than the
            cores this process may run on, at most 3 (`write_threads` resolves it).
        key_requests_per_minute: requests one API key may make per minute on every authenticated
            route (more: 429 with the rate denial envelope); 0 = not limited (ratelimit.py).
        max_api_keys_per_organization: active (neither revoked nor expired) API keys that may be
            bound to one organization through POST /api-keys; one more is 409.
        failed_auths_per_minute: failed authentications (401: no, an unknown, a revoked or an
            expired key; not a 403) one client (IP address, an IPv6 /64) may make per minute;
            past it every request of that client is 429 until the minute ends; 0 = not limited.
        gateway_rate_limit_storage_url: `limits` storage of those counters; empty selects
            LOOPLINE_REDIS_URL when set (shared by replicas), else process memory (`memory://`).
        http_max_header_bytes / http_max_headers: the most bytes (request line and header lines
            together) and header lines one request's head may have; more is 431 and the connection
            is closed, before authentication (services/gateway/http_limits.py, docs/security.md).
        http_header_timeout_s: seconds a request's head may take to arrive, from the connection's
            opening or its first byte; then the connection is closed (408 when part of it came).
        http_body_timeout_s / http_body_min_rate: a request body must bring at least
            `http_body_min_rate` bytes a second (at least one byte) over every
            `http_body_timeout_s`; else 408 and the connection is closed.
        http_send_timeout_s: seconds a client may take none of a response's waiting bytes (the
            connection's buffer full) before its connection is aborted; streams too.
        http_max_connections: open connections (or requests being served) past which a request
            is answered 503 with Retry-After and its connection closed (uvicorn's
            `limit_concurrency`, answered in the API's error shape).
        http_listens_per_key: concurrent listens (event streams) one API key may hold on this
            gateway process; one more is 429 with the rate denial envelope and Retry-After.
        tcp_keepalive_idle_s / tcp_keepalive_interval_s / tcp_keepalive_count: TCP keepalive of
            the HTTP connections: probes after this much silence, this far apart, this many
            unanswered before the kernel drops the connection (an idle peer that vanished).
        tcp_user_timeout_s: TCP_USER_TIMEOUT of the HTTP connections: seconds sent data may stay
            unacknowledged before the kernel drops the connection (a peer that vanished while
            bytes were owed to it); 0 = the kernel's default (~15 minutes of retransmissions).
    """

    http_port: int = Field(default=8000, ge=0, le=MAX_PORT)
    http_host: str = "127.0.0.1"
    gateway_grpc_port: int = Field(default=50050, ge=0, le=MAX_PORT)
    gateway_database_url: str = ""
    auto_migrate: bool = True
    heartbeat_interval_s: float = Field(default=15.0, gt=0, le=MAX_SECONDS)
    max_body_bytes: int = Field(default=1_048_576, gt=0)
    dev_api_key: str = ""
    dev_org_id: str = ""
    auth_cache_ttl_s: float = Field(default=30.0, ge=0, le=MAX_SECONDS)
    idempotency_ttl_s: float = Field(default=86_400.0, gt=0, le=MAX_SECONDS)
    fanout_write_threads: int = Field(default=-1, ge=-1, le=16)
    key_requests_per_minute: int = Field(default=6_000, ge=0, le=100_000_000)
    max_api_keys_per_organization: int = Field(default=100, ge=1, le=1_000_000)
    failed_auths_per_minute: int = Field(default=30, ge=0, le=100_000_000)
    gateway_rate_limit_storage_url: str = ""
    http_max_header_bytes: int = Field(default=65_536, ge=1_024, le=16_777_216)
    http_max_headers: int = Field(default=100, ge=10, le=10_000)
    http_header_timeout_s: float = Field(default=10.0, gt=0, le=MAX_SECONDS)
    http_body_timeout_s: float = Field(default=10.0, gt=0, le=MAX_SECONDS)
    http_body_min_rate: int = Field(default=1_024, ge=0, le=1_073_741_824)
    http_send_timeout_s: float = Field(default=60.0, gt=0, le=MAX_SECONDS)
    http_max_connections: int = Field(default=20_000, ge=1, le=10_000_000)
    http_listens_per_key: int = Field(default=1_000, ge=1, le=10_000_000)
    tcp_keepalive_idle_s: int = Field(default=30, ge=1, le=32_767)
    tcp_keepalive_interval_s: int = Field(default=10, ge=1, le=32_767)
    tcp_keepalive_count: int = Field(default=3, ge=1, le=127)
    tcp_user_timeout_s: int = Field(default=60, ge=0, le=2_147_483)

    @property
    def rate_limit_storage_url(self) -> str:
        """`gateway_rate_limit_storage_url`, else `redis_url`, else "memory://"."""
        return self.gateway_rate_limit_storage_url or self.redis_url or "memory://"

    @property
    def write_threads(self) -> int:
        """`fanout_write_threads`, -1 resolved: one fewer than this process's cores, at most 3."""
        return (
            _default_write_threads() if self.fanout_write_threads < 0 else self.fanout_write_threads
        )

    @property
    def database_url(self) -> str:
        """The effective database URL."""
        return self.gateway_database_url or self.sqlite_url("gateway")
