"""A setting out of its range stops the service at start, naming it.

LOOPLINE_HEARTBEAT_INTERVAL_S=0 (or -1) made the gateway flood each SSE listener with
heartbeat frames (197,336 in 4.3 s); LOOPLINE_MAX_BODY_BYTES=0 or -1 started fine and then
answered every POST 413 "Request body exceeds -1 bytes"; negative TTLs were taken. A value
that is not a number was already refused at start (exit 1, pydantic's error); a value that
cannot work now is too (README "Settings", the range column). Each value goes through the
environment, as in a deployment.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from services.billing.config import BillingSettings
from services.common.config import CommonSettings
from services.gateway.config import GatewaySettings
from services.orchestrator.config import OrchestratorSettings
from services.tools.config import ToolsSettings

SETTINGS = [GatewaySettings, OrchestratorSettings, BillingSettings, ToolsSettings]

#: (setting, a value out of its range) read by every service.
COMMON_REFUSED = [
    ("shutdown_grace_s", "-1"),
    ("shutdown_grace_s", "inf"),
    ("log_level", "verbose"),
    ("db_pool_size", "0"),
    ("db_timeout_s", "0"),
]

GATEWAY_REFUSED = [
    ("http_port", "-1"),
    ("http_port", "65536"),
    ("gateway_grpc_port", "-1"),
    ("gateway_grpc_port", "65536"),
    ("heartbeat_interval_s", "0"),
    ("heartbeat_interval_s", "-1"),
    ("heartbeat_interval_s", "nan"),
    ("heartbeat_interval_s", "inf"),
    ("max_body_bytes", "0"),
    ("max_body_bytes", "-1"),
    ("auth_cache_ttl_s", "-1"),
    ("idempotency_ttl_s", "0"),
    ("fanout_write_threads", "-2"),
    ("fanout_write_threads", "17"),
    ("idempotency_ttl_s", "-1"),
    (
        "idempotency_ttl_s",
        "1e12",
    ),  # past a century: `now - timedelta` overflowed on every keyed request
]

ORCHESTRATOR_REFUSED = [
    ("orchestrator_port", "-1"),
    ("orchestrator_port", "65536"),
    ("orchestrator_metrics_port", "-1"),
    ("orchestrator_metrics_port", "65536"),
    ("recursion_limit", "0"),
    ("failure_guidance_threshold", "0"),
    ("llm_call_guidance_every", "-1"),
    ("pending_ttl_s", "0"),
    ("pending_ttl_s", "99999999999999"),
    ("tool_timeout_s", "0"),
    ("event_log_max_runs", "-1"),
    ("event_log_max_bytes", "-1"),
    ("summarization_budget_tokens", "-1"),
    ("summarization_keep_tokens", "-1"),
    ("anthropic_max_tokens", "0"),
    ("llm_max_retries", "-1"),
    ("llm_retry_base_delay_s", "-0.5"),
    ("llm_retry_max_delay_s", "-1"),
    ("llm_timeout_s", "0"),
    ("run_events_max_len", "0"),
    ("run_events_ttl_s", "0"),
    ("chat_claim_ttl_s", "0"),
    ("redis_retry_s", "-1"),
    ("run_lease_s", "0"),
    ("cancel_wait_s", "-1"),
    ("idempotency_ttl_s", "-1"),
]

BILLING_REFUSED = [
    ("billing_port", "-1"),
    ("billing_port", "65536"),
    ("billing_metrics_port", "-1"),
    ("billing_metrics_port", "65536"),
    ("billing_hold_seconds", "0"),
    ("billing_hold_seconds", "-120"),
    ("billing_sweep_interval_s", "-1"),
    ("billing_expiry_grace_s", "-1"),
]

TOOLS_REFUSED = [
    ("tools_port", "-1"),
    ("tools_port", "65536"),
    ("tools_metrics_port", "-1"),
    ("tools_metrics_port", "65536"),
    ("tools_timeout_s", "0"),
    ("tools_max_output_bytes", "0"),
    ("tools_search_millicredits", "-1"),
    ("tools_credential_cache_ttl_s", "-1"),
]

#: Values at the edge of a range that mean something (README, the settings' docstrings): taken.
TAKEN = [
    (GatewaySettings, "http_port", "0", 0),  # any free port
    (GatewaySettings, "http_port", "65535", 65535),
    (GatewaySettings, "auth_cache_ttl_s", "0", 0.0),  # no cache
    (GatewaySettings, "heartbeat_interval_s", "0.5", 0.5),
    (GatewaySettings, "fanout_write_threads", "0", 0),  # the event loop's thread writes every frame
    (GatewaySettings, "shutdown_grace_s", "0", 0.0),
    (GatewaySettings, "log_level", "debug", "DEBUG"),
    (OrchestratorSettings, "orchestrator_port", "0", 0),
    (OrchestratorSettings, "orchestrator_metrics_port", "0", 0),  # any free port
    (OrchestratorSettings, "summarization_budget_tokens", "0", 0),  # summarization off
    (OrchestratorSettings, "summarization_keep_tokens", "0", 0),
    (OrchestratorSettings, "llm_call_guidance_every", "0", 0),  # guidance off
    (OrchestratorSettings, "llm_max_retries", "0", 0),
    (OrchestratorSettings, "llm_retry_base_delay_s", "0", 0.0),
    (OrchestratorSettings, "event_log_max_runs", "0", 0),
    (OrchestratorSettings, "event_log_max_bytes", "0", 0),
    (OrchestratorSettings, "redis_retry_s", "0", 0.0),
    (OrchestratorSettings, "cancel_wait_s", "0", 0.0),
    (BillingSettings, "billing_port", "0", 0),
    (BillingSettings, "billing_metrics_port", "0", 0),
    (BillingSettings, "billing_sweep_interval_s", "0", 0.0),  # no background sweeper
    (BillingSettings, "billing_expiry_grace_s", "0", 0.0),
    (BillingSettings, "billing_hold_seconds", "1", 1),
    (ToolsSettings, "tools_port", "0", 0),
    (ToolsSettings, "tools_metrics_port", "0", 0),
    (ToolsSettings, "tools_credential_cache_ttl_s", "0", 0.0),  # read the database on every call
    (ToolsSettings, "tools_search_millicredits", "0", 0),  # free
]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("LOOPLINE_") and not name.startswith("LOOPLINE_TEST_"):
            monkeypatch.delenv(name)


def _assert_refused(monkeypatch, settings: type[CommonSettings], field: str, value: str) -> None:
    monkeypatch.setenv(f"LOOPLINE_{field.upper()}", value)
    with pytest.raises(ValidationError) as refused:
        settings()
    assert [error["loc"] for error in refused.value.errors()] == [(field,)]
    assert field in str(refused.value)


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda cls: cls.__name__)
@pytest.mark.parametrize(("field", "value"), COMMON_REFUSED)
def test_every_service_refuses_a_common_setting_out_of_range(monkeypatch, settings, field, value):
    _assert_refused(monkeypatch, settings, field, value)


@pytest.mark.parametrize(
    ("settings", "field", "value"),
    [
        *((GatewaySettings, field, value) for field, value in GATEWAY_REFUSED),
        *((OrchestratorSettings, field, value) for field, value in ORCHESTRATOR_REFUSED),
        *((BillingSettings, field, value) for field, value in BILLING_REFUSED),
        *((ToolsSettings, field, value) for field, value in TOOLS_REFUSED),
    ],
    ids=lambda item: item.__name__ if isinstance(item, type) else str(item),
)
def test_each_service_refuses_its_own_settings_out_of_range(monkeypatch, settings, field, value):
    _assert_refused(monkeypatch, settings, field, value)


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda cls: cls.__name__)
def test_the_defaults_load_and_are_within_their_ranges(settings):
    settings()
    given = settings(
        **{field: info.default for field, info in settings.model_fields.items()}
    )  # validated, unlike defaults
    for field, info in settings.model_fields.items():
        if field not in (
            "billing_database_url",
            "billing_rate_limit_storage_url",
        ):  # filled in from data_dir / redis_url
            assert getattr(given, field) == info.default, field


@pytest.mark.parametrize(
    ("settings", "field", "value", "expected"),
    TAKEN,
    ids=[f"{field}={value}" for _, field, value, _ in TAKEN],
)
def test_a_meaningful_edge_value_is_taken(monkeypatch, settings, field, value, expected):
    monkeypatch.setenv(f"LOOPLINE_{field.upper()}", value)
    assert getattr(settings(), field) == expected


@pytest.mark.parametrize(
    ("service", "variable", "value", "field"),
    [
        ("gateway", "LOOPLINE_HEARTBEAT_INTERVAL_S", "0", "heartbeat_interval_s"),
        ("gateway", "LOOPLINE_MAX_BODY_BYTES", "-1", "max_body_bytes"),
        ("orchestrator", "LOOPLINE_RUN_LEASE_S", "0", "run_lease_s"),
        ("billing", "LOOPLINE_BILLING_HOLD_SECONDS", "-1", "billing_hold_seconds"),
        ("tools", "LOOPLINE_TOOLS_TIMEOUT_S", "0", "tools_timeout_s"),
    ],
)
def test_a_service_started_with_a_setting_out_of_range_exits_1_naming_it(
    tmp_path, service, variable, value, field
):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPLINE_")}
    env.update(
        {
            "LOOPLINE_DATA_DIR": str(tmp_path),
            "LOOPLINE_LOG_LEVEL": "WARNING",
            variable: value,
            "LOOPLINE_HTTP_PORT": "0",
            "LOOPLINE_GATEWAY_GRPC_PORT": "0",
            "LOOPLINE_ORCHESTRATOR_PORT": "0",
            "LOOPLINE_BILLING_PORT": "0",
            "LOOPLINE_TOOLS_PORT": "0",
        }
    )
    try:
        result = subprocess.run(
            [sys.executable, "-m", f"services.{service}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{service} started with {variable}={value} instead of refusing it")
    assert result.returncode == 1, result.stderr[-2000:]
    assert "ValidationError" in result.stderr
    assert f"\n{field}\n" in result.stderr  # pydantic's line naming the setting
    assert "Input should be greater than" in result.stderr
