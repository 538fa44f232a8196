"""Gateway settings (environment variables with the LOOPLINE_ prefix)."""

from __future__ import annotations

from services.common.config import CommonSettings


class GatewaySettings(CommonSettings):
    """Settings of the gateway.

    Attributes:
        http_port: HTTP port (0 = any free port); LOOPLINE_HTTP_PORT, default 8000.
        http_host: interface the HTTP server binds.
        gateway_grpc_port: port of the gateway's gRPC health service (0 = any).
        gateway_database_url: identity database URL; empty = SQLite `<data_dir>/gateway.db`.
        auto_migrate: apply Alembic migrations at start.
        heartbeat_interval_s: seconds of silence on a listen stream before a heartbeat frame (spec: 15).
        max_body_bytes: largest request body accepted (larger -> 413).
        dev_api_key / dev_org_id: fix the key and organization that `seed-dev` creates (the key: at
            least 20 printable ASCII characters without spaces, else seed-dev refuses it).
        auth_cache_ttl_s: how long a resolved API key is cached in memory.
        idempotency_ttl_s: how long an Idempotency-Key and its response are kept (24 h).
    """

    http_port: int = 8000
    http_host: str = "127.0.0.1"
    gateway_grpc_port: int = 50050
    gateway_database_url: str = ""
    auto_migrate: bool = True
    heartbeat_interval_s: float = 15.0
    max_body_bytes: int = 1_048_576
    dev_api_key: str = ""
    dev_org_id: str = ""
    auth_cache_ttl_s: float = 30.0
    idempotency_ttl_s: float = 86_400.0

    @property
    def database_url(self) -> str:
        """The effective database URL."""
        return self.gateway_database_url or self.sqlite_url("gateway")
