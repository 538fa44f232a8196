"""Prometheus metrics across the four services (services/common/metrics.py, docs/metrics.md).

A turn with a tool call runs through the `services` fixture; the gateway's GET /metrics and the
metrics ports of the orchestrator, billing and tools are scraped before and after it. The
counters move with the turn's labels (provider, model, tool, integration, outcome, layer), and no
label value, nor the scrape's text, holds an id of the turn (run, chat, organization, tool call,
API key) or a name the model made up. The four services share one process here, so each sample is
compared with its value before the turn.
"""

from __future__ import annotations

import re
import uuid

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Stack
from tests.orchestrator.helpers import run_turn, types, wait_for

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

# what an id looks like here: a uuid, hex runs, or a prefixed id (org_..., run ids, mx_live_...)
ID_LIKE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}|[0-9a-f]{12}|^(org|run|chat|call|res)_|mx_live_")


async def _scrape(client: httpx.AsyncClient, url: str) -> tuple[str, Samples]:
    response = await client.get(url)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return response.text, samples


def _urls(services: Stack) -> dict[str, str]:
    return {
        "gateway": f"{services.base_url}/metrics",
        "orchestrator": f"http://127.0.0.1:{services.orchestrator.metrics_port}/metrics",
        "billing": f"http://127.0.0.1:{services.billing.metrics_port}/metrics",
        "tools": f"http://127.0.0.1:{services.tools.metrics_port}/metrics",
    }


def _get(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_a_turn_with_a_tool_call_moves_the_counters_with_bounded_labels(services):
    made_up = f"invented_tool_{uuid.uuid4().hex}"
    urls = _urls(services)
    async with services.client() as client:
        before = {name: (await _scrape(client, url))[1] for name, url in urls.items()}
        body, frames = await run_turn(
            client,
            {
                "tool": "execute_integration_tool",
                "input": {
                    "integration": "loopline",
                    "action": "echo",
                    "parameters": {"message": "hi"},
                },
                "usage": {"input_tokens": 120, "output_tokens": 8},
            },
            {"tool": made_up, "input": {}, "usage": {"input_tokens": 150, "output_tokens": 4}},
            # a pause, then the answer: its frames reach the gateway live (delivery delay)
            {"say": "done", "sleep_ms": 200, "usage": {"input_tokens": 200, "output_tokens": 5}},
        )
        assert types(frames)[-1] == "done"
        after: dict[str, Samples] = {}
        texts: dict[str, str] = {}

        async def ended() -> bool:
            texts["orchestrator"], after["orchestrator"] = await _scrape(
                client, urls["orchestrator"]
            )
            return _get(
                after["orchestrator"], "loopline_turns_ended_total", outcome="completed"
            ) > _get(before["orchestrator"], "loopline_turns_ended_total", outcome="completed")

        await wait_for(ended)  # the run's end is counted just after `done` is published
        for name in ("gateway", "billing", "tools"):
            texts[name], after[name] = await _scrape(client, urls[name])

    def moved(service: str, name: str, **labels: str) -> float:
        return _get(after[service], name, **labels) - _get(before[service], name, **labels)

    scripted = {"provider": "scripted", "model": "default"}
    assert moved("orchestrator", "loopline_turns_started_total") == 1
    assert moved("orchestrator", "loopline_turns_ended_total", outcome="completed") == 1
    assert moved("orchestrator", "loopline_turn_duration_seconds_count", outcome="completed") == 1
    assert moved("orchestrator", "loopline_turn_first_frame_seconds_count") == 1
    assert moved("orchestrator", "loopline_model_calls_total", **scripted, outcome="ok") == 3
    assert moved("orchestrator", "loopline_model_call_duration_seconds_count", **scripted) == 3
    assert moved("orchestrator", "loopline_model_tokens_total", **scripted, type="input") == 470
    assert moved("orchestrator", "loopline_model_tokens_total", **scripted, type="output") == 17
    assert (
        moved(
            "orchestrator",
            "loopline_tool_calls_total",
            tool="execute_integration_tool",
            outcome="ok",
        )
        == 1
    )
    # the tools service answers a tool it does not know with an error result
    assert moved("orchestrator", "loopline_tool_calls_total", tool="other", outcome="error") == 1
    assert (
        moved(
            "orchestrator",
            "loopline_tool_call_duration_seconds_count",
            tool="execute_integration_tool",
        )
        == 1
    )
    assert (
        moved("billing", "loopline_billing_admissions_total", layer="credit", decision="admitted")
        == 1
    )
    assert (
        moved("tools", "loopline_integration_actions_total", integration="loopline", outcome="ok")
        == 1
    )
    assert moved("gateway", "loopline_gateway_event_delivery_delay_seconds_count") >= 1
    assert _get(after["gateway"], "loopline_gateway_open_listeners") >= 0

    ids = {
        body["run_id"],
        body["chat_id"],
        services.org_id,
        services.api_key,
        services.user_id,
        *(f["data"]["tool_call_id"] for f in frames if f["type"] == "tool_call"),
    }
    _assert_no_ids(after, texts, {*ids, made_up})


def _assert_no_ids(after: dict[str, Samples], texts: dict[str, str], ids: set[str]) -> None:
    """No label value looks like an id, and no id (nor a made-up tool name) is in any scrape."""
    for service, samples in after.items():
        for _name, labels in samples:
            for label, value in labels:
                assert not ID_LIKE.search(value), (service, label, value)
        for secret in ids:
            assert secret not in texts[service], (service, secret)


async def test_the_gateway_metrics_need_no_key_and_stay_out_of_the_openapi_document(services):
    async with httpx.AsyncClient(base_url=services.base_url) as anonymous:
        response = await anonymous.get("/metrics")
        document = (await anonymous.get("/openapi.json")).json()
    assert response.status_code == 200
    assert "# TYPE loopline_gateway_open_listeners gauge" in response.text
    assert "/metrics" not in document["paths"]


async def test_an_open_listen_is_counted_until_it_ends(services):
    async with services.client() as client:
        start = await client.post(
            "/assistant/chat",
            json={"message": '{"script": [{"say": "slow", "sleep_ms": 1500}]}'},
        )
        assert start.status_code == 200, start.text
        stream_url = start.json()["stream_url"]
        _, idle = await _scrape(client, "/metrics")
        listening: Samples = {}
        async with client.stream("GET", stream_url) as stream:
            async for line in stream.aiter_lines():
                if not listening:  # the stream is open: its first frame came
                    _, listening = await _scrape(client, "/metrics")
                if '"type":"done"' in line:
                    break
        open_now = _get(listening, "loopline_gateway_open_listeners")
        assert open_now == _get(idle, "loopline_gateway_open_listeners") + 1

        async def closed() -> bool:
            _, done = await _scrape(client, "/metrics")
            return _get(done, "loopline_gateway_open_listeners") == open_now - 1

        await wait_for(closed)  # the stream ended after `done`: its listener is gone
