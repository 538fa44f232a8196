"""Gateway settings (environment variables with the LOOPLINE_ prefix)."""

from __future__ import annotations

from pydantic import Field

from services.common.config import MAX_PORT, MAX_SECONDS, CommonSettings


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

    @property
    def database_url(self) -> str:
        """The effective database URL."""
        return self.gateway_database_url or self.sqlite_url("gateway")
