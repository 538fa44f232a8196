"""Traces of turns across the four services (services/common/tracing.py, docs/tracing.md).

In-process: the SDK's InMemorySpanExporter is installed before the services start
(`services_with_tracing`), so every span of every service lands in one exporter. Rules: a turn
is one trace whose root is the POST's server span, holding the orchestrator's, billing's and the
tools service's spans, each with the request's id; every model call and tool call has its GenAI
span; no span carries message text, tool input or output; a resumed run joins the paused
turn's trace and the resume POST links to it; server spans are named by route templates, never
by ids.

Across processes: the services run as real processes (scripts/dev.py) exporting OTLP/HTTP to a
receiver the test runs, which decodes every ExportTraceServiceRequest.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from bench.otlp_sink import OtlpSink
from loopline.assistant.v1 import assistant_pb2, assistant_pb2_grpc
from services.common import tracing
from tests.conftest import SCRIPTED, Stack, script, start_stack, stop_stack
from tests.e2e.conftest import start_deployment, stop_deployment
from tests.orchestrator.helpers import run_turn, wait_for
from tests.sse_client import read_frames

SECRET_TEXT = "the-quick-brown-fox-7d1e"  # in messages and tool input: on no span
START_TURN = "/loopline.assistant.v1.AssistantService/StartTurn"
ADMIT = "/loopline.billing.v1.BillingService/Admit"
EXECUTE_TOOL = "/loopline.tools.v1.ToolsService/ExecuteTool"
AGENT = "invoke_agent assistant"


@pytest.fixture
async def services_with_tracing(tmp_path) -> AsyncIterator[tuple[Stack, InMemorySpanExporter]]:
    """The four services in-process with tracing on into an InMemorySpanExporter."""
    exporter = InMemorySpanExporter()
    tracing.install_for_tests(exporter)
    try:
        running = await start_stack(tmp_path, gateway={"heartbeat_interval_s": 1.0})
        try:
            yield running, exporter
        finally:
            await stop_stack(running)
    finally:
        tracing.shutdown()


def _spans(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return list(exporter.get_finished_spans())


def _named(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def _trace(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.trace_id


def _id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.span_id


def _parent(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


async def _runs_ended(exporter: InMemorySpanExporter, count: int) -> list[ReadableSpan]:
    """The `invoke_agent` spans once `count` runs have ended (a run's span ends after its
    terminal event is published)."""
    await wait_for(lambda: len(_named(_spans(exporter), AGENT)) >= count, timeout=10)
    return _named(_spans(exporter), AGENT)


def _attribute_text(spans: list[ReadableSpan]) -> str:
    return json.dumps([{k: str(v) for k, v in (s.attributes or {}).items()} for s in spans])


async def test_a_turn_with_a_tool_call_is_one_trace_across_the_four_services(
    services_with_tracing,
):
    services, exporter = services_with_tracing
    steps = [
        {"say": "Looking.", "tool": "get_available_integrations", "input": {"query": SECRET_TEXT}},
        {"say": f"Done {SECRET_TEXT}", "usage": {"input_tokens": 120, "output_tokens": 7}},
    ]
    async with services.client() as client:
        started = await client.post(
            "/assistant/chat", json={"message": script(*steps)}, headers={"X-Request-ID": "rq-1"}
        )
        assert started.status_code == 200, started.text
        body = started.json()
        frames = await read_frames(client, body["stream_url"])
    assert frames[-1]["type"] == "done"
    call_id = next(f for f in frames if f["type"] == "tool_call")["data"]["tool_call_id"]
    (run,) = await _runs_ended(exporter, 1)
    spans = _spans(exporter)
    (post,) = _named(spans, "POST /assistant/chat")
    turn = [s for s in spans if _trace(s) == _trace(post)]
    # the POST's server span is the root; the orchestrator, billing and tools serve inside it
    assert post.kind == SpanKind.SERVER and post.parent is None
    assert post.attributes is not None and post.attributes["http.route"] == "/assistant/chat"
    assert post.attributes[tracing.REQUEST_ID] == "rq-1"
    names = {s.name for s in turn}
    assert {START_TURN, ADMIT, EXECUTE_TOOL, AGENT} <= names, names
    servers = {s.name for s in turn if s.kind == SpanKind.SERVER}
    assert {START_TURN, ADMIT, EXECUTE_TOOL, "POST /assistant/chat"} <= servers
    # the run (a background task that outlives the POST) is a child of the StartTurn RPC
    (start_rpc,) = [s for s in turn if s.name == START_TURN and s.kind == SpanKind.SERVER]
    assert _parent(run) == _id(start_rpc) and _trace(run) == _trace(post)
    assert run.attributes is not None
    assert run.attributes["gen_ai.conversation.id"] == body["chat_id"]
    assert run.attributes["loopline.run_id"] == body["run_id"]
    assert run.attributes["loopline.run.outcome"] == "completed"
    # a span per model call, with the GenAI attributes
    chats = sorted(_named(turn, "chat default"), key=lambda s: s.start_time or 0)
    assert len(chats) == 2 and all(_parent(s) == _id(run) for s in chats)
    for span in chats:
        attributes = span.attributes or {}
        assert attributes["gen_ai.operation.name"] == "chat"
        assert attributes["gen_ai.provider.name"] == "scripted"
        assert attributes["gen_ai.request.model"] == "default"
        tokens = attributes["gen_ai.usage.input_tokens"]
        assert isinstance(tokens, int) and tokens > 0
        assert span.kind == SpanKind.CLIENT
    assert (chats[0].attributes or {})["gen_ai.response.finish_reasons"] == ("tool_calls",)
    assert (chats[1].attributes or {})["gen_ai.response.finish_reasons"] == ("stop",)
    assert (chats[1].attributes or {})["gen_ai.usage.input_tokens"] == 120
    assert (chats[1].attributes or {})["gen_ai.usage.output_tokens"] == 7
    # a span per tool call, parent of the ExecuteTool call, whose server span the tools serve
    (tool,) = _named(turn, "execute_tool get_available_integrations")
    assert tool.attributes is not None and tool.status.is_ok
    assert tool.attributes["gen_ai.operation.name"] == "execute_tool"
    assert tool.attributes["gen_ai.tool.name"] == "get_available_integrations"
    assert tool.attributes["gen_ai.tool.call.id"] == call_id
    assert "error.type" not in tool.attributes and _parent(tool) == _id(run)
    (client_call,) = [s for s in turn if s.name == EXECUTE_TOOL and s.kind == SpanKind.CLIENT]
    (served,) = [s for s in turn if s.name == EXECUTE_TOOL and s.kind == SpanKind.SERVER]
    assert _parent(client_call) == _id(tool) and _parent(served) == _id(client_call)
    # the request's id on every span of the turn, in every service
    missing = [s.name for s in turn if (s.attributes or {}).get(tracing.REQUEST_ID) != "rq-1"]
    assert not missing, missing
    # counts, names and ids only: no message text, tool input or output on any span
    assert SECRET_TEXT not in _attribute_text(spans)
    assert "Bearer" not in _attribute_text(spans)


async def test_failed_and_refused_tool_calls_have_an_error_type(services_with_tracing):
    services, exporter = services_with_tracing
    async with services.client() as client:
        await run_turn(
            client,
            {"tool": "no_such_tool", "input": {}},
            {"tool": "get_available_integrations", "input": [1, 2]},  # not an object: not run
            {"say": "ok"},
        )
    await _runs_ended(exporter, 1)
    spans = _spans(exporter)
    (failed,) = _named(spans, "execute_tool no_such_tool")
    (refused,) = _named(spans, "execute_tool get_available_integrations")
    assert (failed.attributes or {})["error.type"] == "tool_error"
    assert (refused.attributes or {})["error.type"] == "invalid_input"
    assert not failed.status.is_ok and not refused.status.is_ok


async def test_a_model_call_that_fails_has_an_error_type_and_fails_the_run_span(
    services_with_tracing,
):
    services, exporter = services_with_tracing
    async with services.client() as client:
        _, frames = await run_turn(client, {"fail": f"boom {SECRET_TEXT}"})
    assert frames[-1]["type"] == "done" or frames[-2]["type"] == "error"
    (run,) = await _runs_ended(exporter, 1)
    (call,) = _named(_spans(exporter), "chat default")
    assert (call.attributes or {})["error.type"] == "ModelError" and not call.status.is_ok
    assert (run.attributes or {})["loopline.run.outcome"] == "failed"
    assert SECRET_TEXT not in _attribute_text(_spans(exporter))
    assert all(not s.events for s in _spans(exporter) if s.name == "chat default")


async def test_a_resumed_run_joins_the_trace_of_the_turn_that_asked(services_with_tracing):
    services, exporter = services_with_tracing
    async with services.client() as client:
        body, frames = await run_turn(
            client,
            {"say": "One question.", "tool": "ask_user_yes_no", "input": {"message": "Go?"}},
            {"say": "Thanks, all done."},
        )
        assert frames[-1]["type"] == "interrupted"
        request_id = frames[-1]["data"]["request_id"]
        (paused,) = await _runs_ended(exporter, 1)
        resumed = await client.post(
            f"/assistant/chat/{body['chat_id']}/resume",
            json={
                "request_id": request_id,
                "response": {"kind": "yes_no", "answer": True},
                "llm": SCRIPTED,
            },
        )
        assert resumed.status_code == 200, resumed.text
        rest = await read_frames(client, resumed.json()["stream_url"])
    assert rest[-1]["type"] == "done"
    runs = await _runs_ended(exporter, 2)
    (second,) = [s for s in runs if s is not paused and _id(s) != _id(paused)]
    spans = _spans(exporter)
    (question,) = _named(spans, "execute_tool ask_user_yes_no")
    assert (question.attributes or {})["loopline.tool.asks_user"] is True
    assert (paused.attributes or {})["loopline.run.outcome"] == "interrupted"
    # the resumed run is in the first turn's trace, a child of the paused run's span
    assert _trace(second) == _trace(paused) and _parent(second) == _id(paused)
    (resume_post,) = _named(spans, "POST /assistant/chat/{chat_id}/resume")
    assert _trace(resume_post) != _trace(paused)
    # the resume POST links to the turn; the resumed run links back to the Resume RPC
    assert [link.context.trace_id for link in resume_post.links] == [_trace(paused)]
    (resume_rpc,) = [
        s
        for s in spans
        if s.name == "/loopline.assistant.v1.AssistantService/Resume" and s.kind == SpanKind.SERVER
    ]
    assert _trace(resume_rpc) == _trace(resume_post)
    assert [link.context.span_id for link in second.links] == [_id(resume_rpc)]
    assert len(_named([s for s in spans if _trace(s) == _trace(paused)], "chat default")) == 2


async def test_a_run_resumed_by_a_connected_credential_joins_the_turn_that_asked(
    services_with_tracing,
):
    services, exporter = services_with_tracing
    async with services.client() as client:
        body, frames = await run_turn(
            client,
            {"tool": "request_credential", "input": {"integration": "postgresql", "message": "db"}},
            {"say": "Connected, thanks."},
        )
        assert frames[-1]["type"] == "interrupted"
        (paused,) = await _runs_ended(exporter, 1)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{services.orchestrator.port}") as channel:
            notice = assistant_pb2.NotifyCredentialConnectedRequest(
                organization_id=services.org_id, integration="postgresql", credential_id="cred-1"
            )
            answer = await assistant_pb2_grpc.AssistantServiceStub(
                channel
            ).NotifyCredentialConnected(notice)
        (new_run,) = answer.resumed_run_ids
        rest = await read_frames(client, f"/assistant/chat/{body['chat_id']}/listen/{new_run}")
    assert rest[-1]["type"] == "done"
    (second,) = [s for s in await _runs_ended(exporter, 2) if _id(s) != _id(paused)]
    assert (second.attributes or {})["loopline.run_id"] == new_run
    assert _trace(second) == _trace(paused) and _parent(second) == _id(paused)


async def test_server_spans_are_named_by_route_templates_without_ids(services_with_tracing):
    services, exporter = services_with_tracing
    async with services.client() as client:
        body, _ = await run_turn(client, {"say": "hi"})
        chat_url = f"/assistant/chat/{body['chat_id']}"
        assert (await client.get(chat_url)).status_code == 200
        assert (await client.get(f"/credentials/cred_{'x' * 8}")).status_code in (400, 404)
        assert (await client.get("/no/such/path/123")).status_code == 404
        assert (await client.get(f"/assistant/chats?page_size=5&q={SECRET_TEXT}")).status_code in (
            200,
            400,
        )
        assert (await client.get("/healthz")).status_code == 200
    await _runs_ended(exporter, 1)
    await asyncio.sleep(0.2)  # the last request's span ends after its answer
    servers = [s for s in _spans(exporter) if s.kind == SpanKind.SERVER and "/" in s.name[:6]]
    names = {s.name for s in _spans(exporter) if s.kind == SpanKind.SERVER}
    assert {
        "POST /assistant/chat",
        "GET /assistant/chat/{chat_id}/listen/{run_id}",
        "GET /assistant/chat/{chat_id}",
        "GET /credentials/{credential_id}",
        "GET /assistant/chats",
        "GET",  # a path no route serves: its method alone
    } <= names, names
    assert not any(body["chat_id"] in s.name or "healthz" in s.name for s in servers)
    assert SECRET_TEXT not in _attribute_text(_spans(exporter))  # the query string is dropped


class _Receiver:
    """An OTLP/HTTP receiver (bench/otlp_sink.py) keeping (service.name, trace id, span name)
    triples of the spans it is sent."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, bytes, str]] = []
        self.lock = threading.Lock()
        self.sink = OtlpSink(on_export=self.add)
        self.port = self.sink.port

    def add(self, request: ExportTraceServiceRequest) -> None:
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next(
                    (
                        a.value.string_value
                        for a in resource_spans.resource.attributes
                        if a.key == "service.name"
                    ),
                    "",
                )
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append((service, span.trace_id, span.name))

    def services_in(self, trace_id: bytes) -> set[str]:
        with self.lock:
            return {service for service, trace, _ in self.spans if trace == trace_id}

    def names_in(self, trace_id: bytes) -> set[str]:
        with self.lock:
            return {name for _, trace, name in self.spans if trace == trace_id}


@pytest.fixture
def otlp_receiver() -> Iterator[_Receiver]:
    receiver = _Receiver()
    receiver.sink.start()
    try:
        yield receiver
    finally:
        receiver.sink.stop()


def test_processes_export_one_trace_per_turn_to_an_otlp_http_receiver(tmp_path, otlp_receiver):
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_receiver.port}",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    deployment = start_deployment(tmp_path, env=env)
    try:
        with httpx.Client(
            base_url=deployment.base_url, headers=deployment.headers(), timeout=30
        ) as client:
            message = script(
                {"tool": "get_available_integrations", "input": {}}, {"say": "All listed."}
            )
            # a trace id of the test's own (the POST's span continues it): the turn's trace
            trace_id = uuid.uuid4().bytes
            parent = f"00-{trace_id.hex()}-{uuid.uuid4().hex[:16]}-01"
            started = client.post(
                "/assistant/chat", json={"message": message}, headers={"traceparent": parent}
            )
            assert started.status_code == 200, started.text
            with client.stream("GET", started.json()["stream_url"]) as stream:
                for line in stream.iter_lines():
                    if line.startswith("data: ") and json.loads(line[6:])["type"] == "done":
                        break
        wanted = {"loopline-gateway", "loopline-orchestrator", "loopline-billing", "loopline-tools"}
        deadline = time.monotonic() + 20
        found: set[str] = set()
        names = {AGENT, "POST /assistant/chat", "execute_tool get_available_integrations"}
        while time.monotonic() < deadline:
            found = otlp_receiver.services_in(trace_id)
            if wanted <= found and names <= otlp_receiver.names_in(trace_id):
                break
            time.sleep(0.1)
        assert wanted <= found, (found, deployment.log.read_text(errors="replace")[-3000:])
        assert names <= otlp_receiver.names_in(trace_id)
    finally:
        stop_deployment(deployment)
