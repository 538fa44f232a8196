"""Settings shared by every service.

Every service parses its configuration in one place, a subclass of `CommonSettings`
read from environment variables with the `LOOPLINE_` prefix (pydantic-settings).
Every setting has a safe development default; README.md lists them all.
"""

from __future__ import annotations

import os
import pathlib
import tomllib
from typing import Annotated, Any

from pydantic import Field, StringConstraints, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

#: The largest port number; ports take 0 to 65535 (0 = any free port).
MAX_PORT = 65_535

#: The longest span (seconds) any duration setting takes: a century. Past about 2,000 years,
#: `now - timedelta(seconds=...)` (idempotency keys, pending questions, holds, leases) raises
#: OverflowError on every use; anything this long is a typo, not a choice.
MAX_SECONDS = 100 * 365 * 24 * 3600

#: A level name `logging` knows, any case ("debug" is DEBUG); another one made logging's setup
#: raise ValueError after the settings were read.
LogLevel = Annotated[
    str,
    StringConstraints(
        strip_whitespace=True,
        to_upper=True,
        pattern=r"(?i)^\s*(DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL|NOTSET)\s*$",
    ),
]


class CommonSettings(BaseSettings):
    """Settings every service reads.

    Attributes:
        data_dir: folder of the embedded SQLite databases (LOOPLINE_DATA_DIR).
        log_level: "DEBUG", "INFO", "WARNING", "ERROR" or "CRITICAL", any case (LOOPLINE_LOG_LEVEL).
        redis_url: Redis URL; empty selects the in-memory backend (LOOPLINE_REDIS_URL).
        redis_key_prefix: prefix of every Redis key and channel (LOOPLINE_REDIS_KEY_PREFIX), so
            several deployments (or parallel test stacks) can share one Redis database.
        host: interface the gRPC servers bind (LOOPLINE_HOST).
        orchestrator_addr / billing_addr / tools_addr: downstream gRPC addresses
            (LOOPLINE_<NAME>_ADDR). Unset, each follows that service's port setting when it is
            set (LOOPLINE_<NAME>_PORT, on 127.0.0.1), so services started one by one with other
            ports find each other as under `make run` (README "Running it"); else the default port.
        shutdown_grace_s: seconds in-flight RPCs get on SIGTERM before they are cancelled
            (0 = at once).
        internal_token: shared secret every internal gRPC call carries and every service's gRPC
            server requires when set (LOOPLINE_INTERNAL_TOKEN; empty = no check, fine while the
            ports are reachable from this machine only; services/common/internal_auth.py).
        db_pool_size: PostgreSQL connections per pool (LOOPLINE_DB_POOL_SIZE): a process keeps up
            to this many in SQLAlchemy's pool, opens as many again under bursts, and the
            orchestrator and billing have an asyncpg pool of this size for their hot paths; so a
            process holds at most 2x (gateway, tools) or 3x (orchestrator, billing) this. Keep the
            sum over all processes under PostgreSQL's `max_connections` (README "Scale-out").
        db_timeout_s: seconds a PostgreSQL request may wait for a pooled connection, for a new
            one to open and for each statement to answer (LOOPLINE_DB_TIMEOUT_S); past it the
            service answers 503 / UNAVAILABLE ("database unavailable") instead of holding the
            request. 5 s by default: under the orchestrator's 10 s deadline on billing's Admit
            (billing's hot statements have no pre-ping) and, twice over (a pre-ping of a dead
            connection, then a new one), under the gateway's 30 s downstream deadline; longer,
            a database that drops packets answers 504. Not SQLite (its busy timeout is 30 s) nor
            migrations.
        readiness_interval_s / readiness_timeout_s: how often a service probes its database and
            Redis for its readiness (gRPC health, the gateway's /readyz), and how long each probe
            may take before that dependency counts as down (services/common/readiness.py).
        grpc_keepalive_s / grpc_keepalive_timeout_s: every internal gRPC channel pings each
            replica it is connected to after this many seconds without a ping, and drops the
            connection when the answer takes longer than the timeout (a stalled or vanished
            replica; calls go on through the others). The timeout outlasts the lag of a busy
            replica, which reads its connections seconds late (docs/operations.md). The servers
            accept pings every second.

    Every numeric setting has the range it can work in (pydantic constraints: ports 0-65535,
    durations up to MAX_SECONDS, no infinity or NaN), so a value out of range stops the
    service at start with pydantic's ValidationError naming the setting, as a non-number does,
    instead of a gateway that floods heartbeats or answers every POST 413.
    """

    model_config = SettingsConfigDict(env_prefix="LOOPLINE_", extra="ignore", allow_inf_nan=False)

    data_dir: pathlib.Path = pathlib.Path("var")
    log_level: LogLevel = "INFO"
    redis_url: str = ""
    redis_key_prefix: str = "loopline:"
    host: str = "127.0.0.1"
    orchestrator_addr: str = "127.0.0.1:50051"
    billing_addr: str = "127.0.0.1:50052"
    tools_addr: str = "127.0.0.1:50053"
    shutdown_grace_s: float = Field(default=5.0, ge=0, le=MAX_SECONDS)
    internal_token: str = Field(default="", repr=False)
    db_pool_size: int = Field(default=4, ge=1, le=100)
    db_timeout_s: float = Field(default=5.0, gt=0, le=MAX_SECONDS)
    readiness_interval_s: float = Field(default=5.0, gt=0, le=MAX_SECONDS)
    readiness_timeout_s: float = Field(default=2.0, gt=0, le=MAX_SECONDS)
    grpc_keepalive_s: float = Field(default=10.0, ge=1, le=86_400)
    grpc_keepalive_timeout_s: float = Field(default=20.0, ge=0.1, le=86_400)

    @model_validator(mode="after")
    def _addresses_follow_ports(self) -> CommonSettings:
        """An unset LOOPLINE_<NAME>_ADDR follows LOOPLINE_<NAME>_PORT when that is set (a valid
        port other than 0), so services started by hand with other ports find each other rather
        than dial the default ones (where another copy would get their billing records)."""
        for name in ("orchestrator", "billing", "tools"):
            field = f"{name}_addr"
            port = os.environ.get(f"LOOPLINE_{name.upper()}_PORT", "").strip()
            if field not in self.model_fields_set and port.isdigit() and 0 < int(port) < 65536:
                setattr(self, field, f"127.0.0.1:{int(port)}")
        return self

    @property
    def grpc_keepalive(self) -> tuple[float, float]:
        """(grpc_keepalive_s, grpc_keepalive_timeout_s): `internal_channel`'s `keepalive`."""
        return self.grpc_keepalive_s, self.grpc_keepalive_timeout_s

    def sqlite_url(self, name: str) -> str:
        """The default database URL of service `name`:
        `sqlite+aiosqlite:///<data_dir>/<name>.db`."""
        return f"sqlite+aiosqlite:///{(self.data_dir / f'{name}.db').as_posix()}"


def read_toml_file(path: pathlib.Path | str, what: str, setting: str) -> dict[str, Any]:
    """The TOML document in the file at `path` (a `what`, e.g. "plan file", chosen with the
    environment variable `setting`).

    Raises ValueError naming the file, the setting and what is wrong when the file cannot be
    read (missing, a folder, not readable), is not UTF-8 or is not valid TOML, so an admin
    command answers it as one JSON error (README "Administration from the command line")
    and a service fails to start with that one line. The message quotes no file content
    beyond the TOML parser's position (line and column).
    """
    where = f"{what} {path} ({setting})"
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except OSError as unreadable:
        raise ValueError(
            f"{where} cannot be read: {unreadable.strerror or type(unreadable).__name__}"
        ) from None
    except UnicodeDecodeError:
        raise ValueError(f"{where} is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as malformed:
        raise ValueError(f"{where} is not valid TOML: {malformed}") from None
