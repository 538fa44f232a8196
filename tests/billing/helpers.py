"""Small helpers shared by the billing tests."""

from __future__ import annotations

import pathlib
from typing import Any

import grpc

from loopline.billing.v1 import billing_pb2
from services.billing.config import BillingSettings
from services.common.errors import StatusDetails, status_details

SHIPPED_PLANS = pathlib.Path(__file__).resolve().parents[2] / "services" / "billing" / "plans.toml"

TEST_PLANS = """
# 7 run credits, nothing else: the concurrency plan.
[plans.seven]
monthly_run_credits = 7
wallet_overage = false
wallet_price_minor = 0

# No allowance; every run is paid from the wallet at 5 minor units a credit.
[plans.wallet_only]
monthly_run_credits = 0
wallet_overage = true
wallet_price_minor = 5

# Two runs a day.
[plans.two_a_day]
monthly_run_credits = 100
max_runs_per_day = 2
wallet_overage = false
wallet_price_minor = 0

# Three sync_exec admissions a minute.
[plans.three_a_minute]
monthly_run_credits = 100
wallet_overage = false
wallet_price_minor = 0
[plans.three_a_minute.rate_limits]
sync_exec = "3/minute"

# Every layer would refuse: shows the order rate -> quota -> credit.
[plans.all_closed]
monthly_run_credits = 0
max_runs_per_day = 0
wallet_overage = false
wallet_price_minor = 0
[plans.all_closed.rate_limits]
sync_exec = "1/minute"

# The state machine's plan: 3 allowance credits, then the wallet.
[plans.machine]
monthly_run_credits = 3
wallet_overage = true
wallet_price_minor = 5
"""


def make_settings(tmp_path: pathlib.Path, **overrides: Any) -> BillingSettings:
    """Settings for a test server: port 0, SQLite in `tmp_path`, no background sweeper."""
    plans = tmp_path / "plans.toml"
    if not plans.exists():
        plans.write_text(SHIPPED_PLANS.read_text() + TEST_PLANS)
    values: dict[str, Any] = {
        "data_dir": tmp_path,
        "billing_port": 0,
        "billing_sweep_interval_s": 0,
        "billing_plans_path": plans,
        "billing_rate_limit_storage_url": "memory://",
    }
    values.update(overrides)
    return BillingSettings(**values)


def admit_request(org: str, turn_key: str, credits: int = 0) -> billing_pb2.AdmitRequest:
    """An assistant-turn admission: usage type "run", rate class "sync_exec"."""
    return billing_pb2.AdmitRequest(
        organization_id=org,
        turn_key=turn_key,
        usage_type="run",
        rate_class="sync_exec",
        credits=credits,
    )


def refusal(error: BaseException) -> StatusDetails:
    """The status of a refused call (an outcome of `asyncio.gather(..., return_exceptions=True)`,
    or a caught exception), which must be a gRPC error."""
    assert isinstance(error, grpc.RpcError), error
    return status_details(error)
