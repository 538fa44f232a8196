"""Gateway settings (environment variables with the LOOPLINE_ prefix)."""

from __future__ import annotations

import os

from pydantic import Field

from services.common.config import MAX_PORT, MAX_SECONDS, CommonSettings


def _default_write_threads() -> int:
    """One fewer than the cores this process may run on (the event loop's thread writes too), at most 3."""
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
        heartbeat_interval_s: seconds of silence on a listen stream before a heartbeat frame (spec: 15;
            more than 0: 0 sent each listener heartbeats in a busy loop).
        max_body_bytes: largest request body accepted (larger -> 413); at least 1 (0 or less
            refused every POST).
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

    @property
    def write_threads(self) -> int:
        """`fanout_write_threads` with -1 resolved: one fewer than this process's cores, at most 3."""
        return _default_write_threads() if self.fanout_write_threads < 0 else self.fanout_write_threads

    @property
    def database_url(self) -> str:
        """The effective database URL."""
        return self.gateway_database_url or self.sqlite_url("gateway")
