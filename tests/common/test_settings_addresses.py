"""Services started one by one with other ports find each other.

README "Running it" says the port variables are enough; that held under `make run` only
(scripts/dev.py also sets LOOPLINE_*_ADDR): an orchestrator started by hand with
LOOPLINE_BILLING_PORT=18752 still dialed 127.0.0.1:50052.
"""

from __future__ import annotations

import pytest

from services.gateway.config import GatewaySettings
from services.orchestrator.config import OrchestratorSettings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("ORCHESTRATOR", "BILLING", "TOOLS"):
        monkeypatch.delenv(f"LOOPLINE_{name}_ADDR", raising=False)
        monkeypatch.delenv(f"LOOPLINE_{name}_PORT", raising=False)


def test_an_unset_address_follows_the_services_port(monkeypatch):
    monkeypatch.setenv("LOOPLINE_BILLING_PORT", "18752")
    monkeypatch.setenv("LOOPLINE_TOOLS_PORT", "18753")
    monkeypatch.setenv("LOOPLINE_ORCHESTRATOR_PORT", "18751")
    orchestrator = OrchestratorSettings()
    assert (orchestrator.billing_addr, orchestrator.tools_addr) == (
        "127.0.0.1:18752",
        "127.0.0.1:18753",
    )
    assert GatewaySettings().orchestrator_addr == "127.0.0.1:18751"


def test_an_address_given_wins_and_an_unusable_port_keeps_the_default(monkeypatch):
    monkeypatch.setenv("LOOPLINE_BILLING_PORT", "18752")
    monkeypatch.setenv("LOOPLINE_BILLING_ADDR", "billing.internal:7000")
    monkeypatch.setenv("LOOPLINE_TOOLS_PORT", "0")  # any free port: nothing to dial
    settings = OrchestratorSettings()
    assert (
        settings.billing_addr == "billing.internal:7000"
        and settings.tools_addr == "127.0.0.1:50053"
    )
    assert OrchestratorSettings(billing_addr="x:1").billing_addr == "x:1"
