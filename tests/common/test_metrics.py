"""services/common/metrics.py: bounded labels, what each helper counts, the metrics port.

The metrics live on the process's default registry, shared by every test: each test reads the
samples it moves before and after (`_value`), never absolute values.
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import httpx
import pytest
import redis.exceptions
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import exc

from services.common import metrics
from services.common.grpc_server import PortUnavailable
from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.providers.base import TokenUsage
from services.orchestrator.run_state import model_catalogue
from services.tools.config import ToolsSettings
from services.tools.server import ToolsServer


def _value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class _Model:
    def __init__(self, provider_id: str, model_id: str) -> None:
        self.provider_id, self.model_id = provider_id, model_id


CATALOGUE = metrics.ModelCatalogue(
    {"openai": ["gpt-4o", "gpt-4o-mini"], "vllm": None, "scripted": ["default"]}
)


@pytest.mark.parametrize(
    ("provider", "model", "labels"),
    [
        ("openai", "gpt-4o", ("openai", "gpt-4o")),  # in the provider's list: its own label
        ("openai", "gpt-5-secret-finetune", ("openai", "other")),  # not in it
        ("vllm", "org_1234/my-private-model", ("vllm", "other")),  # the provider allows any
        ("made-up", "gpt-4o", ("other", "other")),  # not a configured provider
        ("scripted", "default", ("scripted", "default")),
    ],
)
def test_a_model_is_labelled_by_its_id_only_when_its_providers_list_names_it(
    provider, model, labels
):
    assert CATALOGUE.labels(provider, model) == labels


def test_the_orchestrator_catalogue_is_its_configured_model_lists():
    catalogue = model_catalogue(
        OrchestratorSettings(openai_models="gpt-4o", anthropic_models="*")
    ).providers
    assert catalogue["openai"] == frozenset({"gpt-4o"})
    assert catalogue["anthropic"] is None  # any model: each is "other"
    assert catalogue["scripted"] == frozenset({"default"})
    disabled = model_catalogue(OrchestratorSettings(scripted_model_enabled=False)).providers
    assert "scripted" not in disabled


def test_free_text_model_ids_share_one_series():
    """Ids a client makes up never become series of their own (nor entries of a cache)."""
    for index in range(50):
        CATALOGUE.series("vllm", f"model-{index}")
    assert CATALOGUE.series("vllm", "x") is CATALOGUE.series("vllm", "y")
    assert ("vllm", "model-7") not in CATALOGUE._series


async def test_a_turn_meter_counts_model_calls_by_outcome_tokens_and_its_end():
    labels = {"provider": "openai", "model": "gpt-4o"}
    ok = _value("loopline_model_calls_total", **labels, outcome="ok")
    failed = _value("loopline_model_calls_total", **labels, outcome="error")
    cancelled = _value("loopline_model_calls_total", **labels, outcome="cancelled")
    observed = _value("loopline_model_call_duration_seconds_count", **labels)
    read = _value("loopline_model_tokens_total", **labels, type="input")
    written = _value("loopline_model_tokens_total", **labels, type="output")
    started = _value("loopline_turns_started_total")
    ended = _value("loopline_turns_ended_total", outcome="completed")
    first = _value("loopline_turn_first_frame_seconds_count")

    meter = CATALOGUE.turn(_Model("openai", "gpt-4o"))

    async def answer() -> str:
        return "reply"

    async def fail() -> str:
        raise RuntimeError("the provider failed")

    assert await meter.model_call(answer()) == "reply"
    with pytest.raises(RuntimeError):
        await meter.model_call(fail())
    stuck = asyncio.ensure_future(meter.model_call(asyncio.sleep(10)))
    await asyncio.sleep(0)
    stuck.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stuck
    meter.tokens(TokenUsage(input_tokens=100, output_tokens=7, cache_read_tokens=20))
    meter.first_frame()
    meter.first_frame()  # only the first one is observed
    meter.ended("completed")

    assert _value("loopline_model_calls_total", **labels, outcome="ok") == ok + 1
    assert _value("loopline_model_calls_total", **labels, outcome="error") == failed + 1
    assert _value("loopline_model_calls_total", **labels, outcome="cancelled") == cancelled + 1
    # a cancelled call's duration says nothing about the model
    assert _value("loopline_model_call_duration_seconds_count", **labels) == observed + 2
    assert _value("loopline_model_tokens_total", **labels, type="input") == read + 120
    assert _value("loopline_model_tokens_total", **labels, type="output") == written + 7
    assert _value("loopline_turns_started_total") == started + 1
    assert _value("loopline_turns_ended_total", outcome="completed") == ended + 1
    assert _value("loopline_turn_first_frame_seconds_count") == first + 1


async def test_a_tool_the_model_made_up_is_labelled_other():
    known = [{"name": "search_knowledge"}, {"name": "ask_user_yes_no"}]
    meter = metrics.TurnMeter()
    made_up = "drop_table_org_5f2c"
    ok = _value("loopline_tool_calls_total", tool="search_knowledge", outcome="ok")
    failed = _value("loopline_tool_calls_total", tool="other", outcome="error")
    not_run = _value("loopline_tool_calls_total", tool="search_knowledge", outcome="not_run")
    asked = _value("loopline_tool_calls_total", tool="ask_user_yes_no", outcome="asked")

    async def result(ok: bool) -> tuple[Any, bool, bytes]:
        return {}, ok, b"{}"

    await meter.tool_call("search_knowledge", known, result(True))
    await meter.tool_call(made_up, known, result(False))
    await meter.tool_call("search_knowledge", known, result(False), run=False)
    meter.question("ask_user_yes_no", known, asked=True)

    assert _value("loopline_tool_calls_total", tool="search_knowledge", outcome="ok") == ok + 1
    assert _value("loopline_tool_calls_total", tool="other", outcome="error") == failed + 1
    assert (
        _value("loopline_tool_calls_total", tool="search_knowledge", outcome="not_run")
        == not_run + 1
    )
    assert _value("loopline_tool_calls_total", tool="ask_user_yes_no", outcome="asked") == asked + 1
    assert made_up not in metrics.exposition(None)[0].decode()


@pytest.mark.parametrize(
    ("error", "labels"),
    [
        (redis.exceptions.ConnectionError("refused"), ("redis", "unavailable")),
        (exc.TimeoutError("pool timeout"), ("database", "unavailable")),
        (ConnectionRefusedError(111, "refused"), ("database", "unavailable")),
        (ValueError("a bug"), None),  # not a storage error: not counted
    ],
)
def test_storage_errors_are_counted_by_service_store_and_kind(error, labels):
    series = ("tools", *labels) if labels else ("tools", "database", "unavailable")
    names = dict(zip(("service", "store", "kind"), series, strict=True))
    before = _value("loopline_storage_errors_total", **names)
    metrics.storage_error("tools", error)
    assert _value("loopline_storage_errors_total", **names) == before + (1 if labels else 0)


def test_admissions_count_only_known_layers_and_decisions():
    before = _value("loopline_billing_admissions_total", layer="quota", decision="denied")
    metrics.admission("quota", "denied")
    metrics.admission("org_123", "denied")  # never a series of its own
    assert (
        _value("loopline_billing_admissions_total", layer="quota", decision="denied") == before + 1
    )
    assert _value("loopline_billing_admissions_total", layer="org_123", decision="denied") == 0


def test_the_delivery_delay_is_measured_from_the_events_own_time():
    class Stamp:
        seconds, nanos = int(time.time()) - 1, 0

    class Event:
        time = Stamp()

    class Unset:
        time = type("T", (), {"seconds": 0, "nanos": 0})()

    created = metrics.event_created(Event())
    assert 1.0 <= time.time() - created < 2.0
    assert metrics.event_created(Unset()) == 0.0
    count = _value("loopline_gateway_event_delivery_delay_seconds_count")
    total = _value("loopline_gateway_event_delivery_delay_seconds_sum")
    metrics.event_delivered(created)
    metrics.event_delivered(time.time() + 5)  # another host's clock ahead: 0, never negative
    assert _value("loopline_gateway_event_delivery_delay_seconds_count") == count + 2
    assert 1.0 <= _value("loopline_gateway_event_delivery_delay_seconds_sum") - total < 2.0


def test_every_metric_follows_the_naming_conventions():
    families = {
        family.name: family
        for family in text_string_to_metric_families(metrics.exposition(None)[0].decode())
        if family.name.startswith("loopline_")
    }
    assert len(families) >= 15
    for name, family in families.items():
        if family.type == "counter":
            assert not name.endswith("_total")  # the parser strips it: the metric has it
        if family.type == "histogram":
            assert name.endswith("_seconds"), name
        assert family.documentation, name


async def test_the_metrics_port_serves_the_registry_and_frees_the_port_on_stop():
    server = await metrics.MetricsServer.start("127.0.0.1", 0, "LOOPLINE_TEST_METRICS_PORT")
    port = server.port
    try:
        async with httpx.AsyncClient() as client:
            response = await client.get(f"http://127.0.0.1:{port}/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")
        assert "loopline_turns_started_total" in response.text
    finally:
        await server.stop()
    await server.stop()  # a second stop does nothing
    with socket.socket() as again:  # the port is free again at once
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))


async def test_a_metrics_port_in_use_fails_start_naming_the_address_and_the_setting():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortUnavailable) as refused:
            await metrics.MetricsServer.start("127.0.0.1", port, "LOOPLINE_TOOLS_METRICS_PORT")
    message = str(refused.value)
    assert message.startswith(f"cannot bind the metrics port 127.0.0.1:{port} ")
    assert "LOOPLINE_TOOLS_METRICS_PORT" in message and "\n" not in message


async def test_a_service_whose_metrics_port_is_in_use_fails_to_start_and_leaves_nothing_bound(
    tmp_path,
):
    """The tools service binds its gRPC port first: that port is free again after the failed
    start (a second start on it succeeds)."""
    grpc_port = _free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        settings = ToolsSettings(
            data_dir=tmp_path,
            tools_port=grpc_port,
            tools_metrics_port=taken.getsockname()[1],
        )
        with pytest.raises(PortUnavailable, match="LOOPLINE_TOOLS_METRICS_PORT"):
            await ToolsServer.start(settings)
    server = await ToolsServer.start(settings.model_copy(update={"tools_metrics_port": 0}))
    try:
        assert server.port == grpc_port and server.metrics_port > 0
    finally:
        await server.stop(0)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
