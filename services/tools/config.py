"""Settings of the tools service, read from `LOOPLINE_*` environment variables.

Every setting has a safe development default (docs/CONVENTIONS.md). The one exception
to "safe" is the credential encryption key: its default is derived from a fixed,
public string so that development works without configuration, and it must be set in
any real deployment (a warning is logged at start while the development key is used).
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

from pydantic import Field

from services.common.config import MAX_PORT, MAX_SECONDS, CommonSettings

# DEVELOPMENT ONLY. The Fernet key used when LOOPLINE_TOOLS_CREDENTIAL_KEY is empty:
# urlsafe-base64(sha256(b"loopline-development-credential-key")). It is public (it is
# in this file), so anything encrypted with it is effectively plain text.
DEV_CREDENTIAL_KEY = base64.urlsafe_b64encode(
    hashlib.sha256(b"loopline-development-credential-key").digest()
).decode()


# Where `make venv` puts the interpreter of the integration workers (Python >= 3.12); a
# relative path is taken from the project's root (`integrations_python`).
PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_INTEGRATIONS_PYTHON = ".venv-integrations/bin/python"


class ToolsSettings(CommonSettings):
    """Settings of `services/tools`.

    Attributes:
        tools_port: gRPC port (LOOPLINE_TOOLS_PORT, default 50053; 0 = any free port).
        tools_metrics_port: port of the Prometheus metrics (LOOPLINE_TOOLS_METRICS_PORT, default
            9103; HTTP on `host`, 0 = any free port; docs/metrics.md).
        tools_database_url: SQLAlchemy async URL (LOOPLINE_TOOLS_DATABASE_URL); empty
            means `sqlite+aiosqlite:///<data_dir>/tools.db`.
        auto_migrate: apply Alembic migrations when the server starts (LOOPLINE_AUTO_MIGRATE).
        tools_timeout_s: seconds an integration action may run before it is stopped and
            an error result is returned (LOOPLINE_TOOLS_TIMEOUT_S, default 30). PostgreSQL
            queries also get it as their `statement_timeout`.
        tools_max_output_bytes: the largest tool output, in bytes of UTF-8 JSON
            (LOOPLINE_TOOLS_MAX_OUTPUT_BYTES, default 65536 = 64 KiB); larger outputs
            are cut and marked; at least 1.
        tools_credential_key: a Fernet key (32 url-safe base64-encoded bytes, e.g. from
            `cryptography.fernet.Fernet.generate_key()`) that encrypts credential secrets
            at rest (LOOPLINE_TOOLS_CREDENTIAL_KEY). Several keys separated by commas
            rotate: the first encrypts, all decrypt. Empty means DEV_CREDENTIAL_KEY,
            for development only.
        tools_allow_private_network: let org-supplied URLs (the `http` integration)
            reach loopback, link-local and private addresses
            (LOOPLINE_TOOLS_ALLOW_PRIVATE_NETWORK, default false; tests turn it on).
        tools_search_millicredits: what one `search_knowledge` call costs, in
            millicredits (LOOPLINE_TOOLS_SEARCH_MILLICREDITS, default 100; 0 = free; never
            negative, which was silently free).
        tools_mcp_stdio_servers: operator-configured stdio MCP servers, a JSON list of
            {"name", "command", "args"?, "env"?, "description"?}; each becomes an
            integration called `name` that needs no credential
            (LOOPLINE_TOOLS_MCP_STDIO_SERVERS, default empty: none).
        tools_oauth2_integrations: OAuth2 integrations, a JSON list of {"name",
            "display_name"?, "description"?, "authorize_url", "token_url", "client_id",
            "client_secret"?, "scope"? or "scopes"?, "token_endpoint_auth_method"?, "use_pkce"?,
            "authorize_params"?, "api_base_url"} (LOOPLINE_TOOLS_OAUTH2_INTEGRATIONS, default
            empty: none). An entry named like a catalogue integration with OAuth2 needs only the
            client: the rest comes from its manifest. See services/tools/oauth.py.
        tools_credential_cache_ttl_s: seconds one process reuses what it read of an
            organization's credentials for tool calls — which integrations are connected,
            its MCP servers and their discovered tools; never a secret
            (LOOPLINE_TOOLS_CREDENTIAL_CACHE_TTL_S, default 5; 0 = read the database on
            every call). A write through this process (create, delete, set default, MCP
            refresh) is seen at once; with several replicas, another replica's write is
            seen after at most this long (an MCP integration not yet in the cache is
            always looked up in the database).
        tools_integrations_python: the interpreter of the integration workers, which has the
            pinned `modulex-integrations` installed (LOOPLINE_TOOLS_INTEGRATIONS_PYTHON; a
            relative path is from the project's root; default the .venv-integrations that
            `make venv` makes; empty: the community catalogue is off).
        tools_integration_workers: at most this many worker processes at once, each running one
            action at a time (LOOPLINE_TOOLS_INTEGRATION_WORKERS, default 4).
        tools_integration_worker_idle_s: a worker with nothing to do exits after this long
            (LOOPLINE_TOOLS_INTEGRATION_WORKER_IDLE_S, default 60).
        tools_integration_worker_memory_mb: a worker's address-space limit in MiB; an action
            that leaks past it fails and its worker is replaced
            (LOOPLINE_TOOLS_INTEGRATION_WORKER_MEMORY_MB, default 2048; 0 = no limit).
        tools_integration_hosts: fixed addresses for host names the workers connect to, a JSON
            object {"api.github.com": "10.0.0.5:8443"} (LOOPLINE_TOOLS_INTEGRATION_HOSTS; for a
            private mirror, or a test's fake API). The outbound policy still judges the address.
        tools_integration_costs: credit costs of catalogue actions in millicredits, a JSON object
            {"github.create_issue": 500, "github": 300, "*": 200} (most specific first;
            LOOPLINE_TOOLS_INTEGRATION_COSTS, default: 200 each).
        embedding_openai_base_url: the OpenAI-compatible embeddings API that knowledge bases
            with embedding provider "openai" use, with their organization's key
            (LOOPLINE_EMBEDDING_OPENAI_BASE_URL).
    """

    tools_port: int = Field(default=50053, ge=0, le=MAX_PORT)
    tools_metrics_port: int = Field(default=9103, ge=0, le=MAX_PORT)
    tools_database_url: str = ""
    auto_migrate: bool = True
    tools_timeout_s: float = Field(default=30.0, gt=0, le=MAX_SECONDS)
    tools_max_output_bytes: int = Field(default=64 * 1024, gt=0)
    tools_credential_key: str = ""
    tools_allow_private_network: bool = False
    tools_search_millicredits: int = Field(default=100, ge=0)
    tools_mcp_stdio_servers: str = ""
    tools_oauth2_integrations: str = ""
    tools_credential_cache_ttl_s: float = Field(default=5.0, ge=0, le=MAX_SECONDS)
    tools_integrations_python: str = DEFAULT_INTEGRATIONS_PYTHON
    tools_integration_workers: int = Field(default=4, ge=1, le=256)
    tools_integration_worker_idle_s: float = Field(default=60.0, gt=0, le=MAX_SECONDS)
    tools_integration_worker_memory_mb: int = Field(default=2048, ge=0)
    tools_integration_hosts: str = ""
    tools_integration_costs: str = ""
    embedding_openai_base_url: str = "https://api.openai.com/v1"

    def integrations_python(self) -> str:
        """The absolute path of `tools_integrations_python`, or "" when the catalogue is off."""
        python = self.tools_integrations_python
        return str(PROJECT_ROOT / python) if python else ""

    def database_url(self) -> str:
        """The database URL to use: `tools_database_url`, or the embedded SQLite default."""
        return self.tools_database_url or self.sqlite_url("tools")

    def credential_keys(self) -> list[str]:
        """The Fernet keys, first one encrypting; `[DEV_CREDENTIAL_KEY]` when none is set."""
        keys = [k.strip() for k in self.tools_credential_key.split(",") if k.strip()]
        return keys or [DEV_CREDENTIAL_KEY]

    def uses_dev_credential_key(self) -> bool:
        """Whether credentials are encrypted with the public development key."""
        return not self.tools_credential_key.strip()
