"""Tracing is off unless the standard OTEL_* variables configure an exporter
(services/common/tracing.py): off, nothing is installed — no provider, no interceptors, no
middleware — and a turn through the four services imports nothing of the SDK, its exporters or
the instrumentations.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from services.common import tracing

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({}, []),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}, []),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "Console, otlp"}, ["console", "otlp"]),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, []),
        ({"OTEL_SDK_DISABLED": "TRUE", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, []),
        ({"OTEL_SDK_DISABLED": "false", "OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),
        # metrics or logs exporters alone turn no tracing on
        ({"OTEL_METRICS_EXPORTER": "otlp", "OTEL_LOGS_EXPORTER": "otlp"}, []),
    ],
)
def test_tracing_is_on_only_when_the_otel_variables_configure_a_span_exporter(variables, expected):
    assert tracing.exporters(variables) == expected
    assert tracing.configured(variables) is bool(expected)


def _without_otel() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LOOPLINE_"))}


def _run(code: str, env: dict[str, str]) -> dict:
    """Run `code` in a fresh interpreter at the project root; its last output line as JSON."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


OFF_TURN = """
import asyncio, json, sys, tempfile, pathlib
import httpx
from services.common import tracing
from tests.conftest import script, start_stack, stop_stack
SDK_PARTS = ("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.instrumentation",
             "opentelemetry.proto")

async def main():
    assert tracing.setup("loopline-test") is False
    stack = await start_stack(pathlib.Path(tempfile.mkdtemp()))
    try:
        async with stack.client() as client:
            message = script({"tool": "get_available_integrations", "input": {}}, {"say": "ok"})
            body = (await client.post("/assistant/chat", json={"message": message})).json()
            async with client.stream("GET", body["stream_url"]) as stream:
                async for line in stream.aiter_lines():
                    if line.startswith("data: ") and json.loads(line[6:])["type"] == "done":
                        break
        served_by = type(stack.gateway.http.config.app).__name__
    finally:
        await stop_stack(stack)
    return served_by

served_by = asyncio.run(main())
print(json.dumps({
    "enabled": tracing.enabled(),
    "server_interceptors": len(tracing.server_interceptors()),
    "client_interceptors": len(tracing.client_interceptors()),
    "no_op": tracing.model_call(object()) is tracing.tool_call(object()),
    "served_by": served_by,
    "modules": sorted(m for m in sys.modules if m.startswith(SDK_PARTS)),
    "provider": type(sys.modules["opentelemetry.trace"].get_tracer_provider()).__name__
    if "opentelemetry.trace" in sys.modules else None,
}))
"""


def test_with_the_otel_variables_unset_a_turn_installs_nothing_and_imports_no_sdk():
    found = _run(OFF_TURN, _without_otel())
    assert found == {
        "enabled": False,
        "server_interceptors": 0,
        "client_interceptors": 0,
        "no_op": True,
        "served_by": "GatewayApp",  # the app itself: no ASGI middleware
        # FastAPI imports the OpenTelemetry API itself; the SDK, its exporters and the
        # instrumentations are never imported, and no provider is set
        "modules": [],
        "provider": found["provider"],
    }
    assert found["provider"] in (None, "ProxyTracerProvider")


ON_SETUP = """
import json
from opentelemetry import trace
from services.common import tracing
on = tracing.setup("loopline-billing")
provider = trace.get_tracer_provider()
print(json.dumps({
    "on": on,
    "provider": type(provider).__module__,
    "service": provider.resource.attributes.get("service.name"),
    "server_interceptors": len(tracing.server_interceptors()),
    "client_interceptors": len(tracing.client_interceptors()),
}))
tracing.shutdown()
"""


@pytest.mark.parametrize(
    ("extra", "service"),
    [({}, "loopline-billing"), ({"OTEL_SERVICE_NAME": "billing-eu-1"}, "billing-eu-1")],
)
def test_an_otlp_endpoint_installs_the_sdk_provider_with_the_service_name(extra, service):
    env = {**_without_otel(), "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", **extra}
    assert _run(ON_SETUP, env) == {
        "on": True,
        "provider": "opentelemetry.sdk.trace",
        "service": service,
        "server_interceptors": 1,
        "client_interceptors": 5,  # the resume link, then the four call kinds'
    }


def test_otel_sdk_disabled_keeps_tracing_off_whatever_else_is_set():
    env = {
        **_without_otel(),
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
        "OTEL_SDK_DISABLED": "true",
    }
    code = (
        "import json, sys\nfrom services.common import tracing\n"
        "print(json.dumps([tracing.setup('loopline-tools'), "
        "[m for m in sys.modules if m.startswith('opentelemetry.sdk')]]))"
    )
    assert _run(code, env) == [False, []]


def test_shutdown_turns_a_test_exporter_off_again():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing.install_for_tests(exporter)
    try:
        assert tracing.enabled() and len(tracing.server_interceptors()) == 1
        with tracing.model_call(type("M", (), {"provider_id": "p", "model_id": "m"})()):
            pass
    finally:
        tracing.shutdown()
    assert not tracing.enabled() and tracing.server_interceptors() == []
    (span,) = exporter.get_finished_spans()
    assert span.name == "chat m"
