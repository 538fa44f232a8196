"""Settings of the billing service, parsed in one place from `LOOPLINE_*` variables.

Every field has a safe development default (README.md lists them). Fields are named
service-first, so `billing_port` is read from `LOOPLINE_BILLING_PORT`.
"""

from __future__ import annotations

import pathlib

from pydantic import Field, model_validator

from services.common.config import MAX_PORT, MAX_SECONDS, CommonSettings

_HERE = pathlib.Path(__file__).resolve().parent


class BillingSettings(CommonSettings):
    """Settings of `services/billing`.

    Attributes:
        billing_port: gRPC port (LOOPLINE_BILLING_PORT); 0 binds any free port.
        billing_metrics_port: port of the Prometheus metrics (LOOPLINE_BILLING_METRICS_PORT;
            HTTP on `host`, 0 binds any free port; docs/metrics.md).
        billing_database_url: SQLAlchemy async URL (LOOPLINE_BILLING_DATABASE_URL); empty
            selects `sqlite+aiosqlite:///<data_dir>/billing.db`.
        auto_migrate: upgrade the schema to the newest migration at server start
            (LOOPLINE_AUTO_MIGRATE).
        billing_rate_limit_storage_url: `limits` storage URL for rate counters
            (LOOPLINE_BILLING_RATE_LIMIT_STORAGE_URL); empty selects `memory://`, or the
            shared Redis (`redis_url`) when LOOPLINE_REDIS_URL is set.
        billing_hold_seconds: seconds a reservation stays HELD before the sweeper expires
            it (LOOPLINE_BILLING_HOLD_SECONDS, default 120). A turn start stores its charge
            with its rows and the orchestrator sends it within ~0.2 s (resent at most 60 s apart
            while billing is away); a hold whose turn start died with its orchestrator before
            its commit blocks its credit, and counts against the quota, until it expires (plus
            a sweep). At least 1.
        billing_sweep_interval_s: seconds between sweeper passes while the server runs
            (LOOPLINE_BILLING_SWEEP_INTERVAL_S); 0 disables the background sweeper.
        billing_expiry_grace_s: seconds the sweeper expires nothing after the service starts
            or after a stall of the process (stopped or starved for a second or more): the run
            charges the orchestrators stored meanwhile (resent at most 60 s apart) reach billing
            first, instead of finding their holds expired while other turns were admitted
            against the credits those holds gave back.
        billing_prices_path: TOML price table (millicredits per 1k tokens per provider/model).
        billing_plans_path: TOML plan catalogue, synced into the `plans` table at start.
        billing_default_plan: plan given to an organization auto-provisioned on its first
            Admit or RecordUsage (LOOPLINE_BILLING_DEFAULT_PLAN, default "developer").
    """

    billing_port: int = Field(default=50052, ge=0, le=MAX_PORT)
    billing_metrics_port: int = Field(default=9102, ge=0, le=MAX_PORT)
    billing_database_url: str = ""
    auto_migrate: bool = True
    billing_rate_limit_storage_url: str = ""
    billing_hold_seconds: int = Field(default=120, gt=0, le=MAX_SECONDS)
    billing_sweep_interval_s: float = Field(default=30.0, ge=0, le=MAX_SECONDS)
    billing_expiry_grace_s: float = Field(default=90.0, ge=0, le=MAX_SECONDS)
    billing_prices_path: pathlib.Path = _HERE / "prices.toml"
    billing_plans_path: pathlib.Path = _HERE / "plans.toml"
    billing_default_plan: str = "developer"

    @model_validator(mode="after")
    def _defaults(self) -> BillingSettings:
        if not self.billing_database_url:
            self.billing_database_url = self.sqlite_url("billing")
        if not self.billing_rate_limit_storage_url:
            self.billing_rate_limit_storage_url = self.redis_url or "memory://"
        return self
