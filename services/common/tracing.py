"""OpenTelemetry tracing of every service: off unless the standard OTEL_* variables ask for it.

`setup(service_name)` (called by `runner.run` at process start) builds the SDK's
TracerProvider with a BatchSpanProcessor and the OTLP/HTTP exporter when an exporter is
configured (`configured`: OTEL_TRACES_EXPORTER, or OTEL_EXPORTER_OTLP_ENDPOINT /
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) and OTEL_SDK_DISABLED is not true; `shutdown` sends what
is queued when the process stops. With tracing off nothing is installed, and the SDK, its
exporter and the instrumentations are not even imported (~30 MiB per process):
`server_interceptors`, `client_interceptors` and `asgi_middleware` give nothing, and
`model_call`, `tool_call`, `agent_run` and `resumed` cost one function call and a shared no-op
object.

Spans (docs/tracing.md): the gRPC and ASGI instrumentations' client and server spans, one
`invoke_agent` span per run, `chat {model}` per model call and `execute_tool {tool}` per tool
call, with the GenAI semantic conventions' attributes: counts, names and ids, never message
text, tool arguments or results, nor secrets. A run resumed after a question joins the trace
of the turn that asked it (`resumed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Coroutine, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, Self

import grpc

from services.common import logging as loopline_logging

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger(__name__)

# GenAI semantic conventions (https://opentelemetry.io/docs/specs/semconv/gen-ai/); the
# semantic-conventions package marks its copies of these as moved to the GenAI repository.
OPERATION = "gen_ai.operation.name"
PROVIDER = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
FINISH_REASONS = "gen_ai.response.finish_reasons"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
CACHE_READ_TOKENS = "gen_ai.usage.cache_read.input_tokens"
CACHE_WRITE_TOKENS = "gen_ai.usage.cache_creation.input_tokens"
TOOL_NAME = "gen_ai.tool.name"
TOOL_CALL_ID = "gen_ai.tool.call.id"
TOOL_TYPE = "gen_ai.tool.type"
AGENT_NAME = "gen_ai.agent.name"
CONVERSATION_ID = "gen_ai.conversation.id"
ERROR_TYPE = "error.type"
REQUEST_ID = "loopline.request_id"
REQUEST_ID_FIELD = "request_id"  # the log context's field of the request id (request_ids.FIELD)
AGENT = "assistant"  # gen_ai.agent.name of the runs (the assistant profile)
TOOL_NAME_CHARS = 64  # a tool name in a span name is cut to this (a model may invent names)
# The Resume answer's trailing metadata key: the W3C traceparent of the turn the run resumes,
# which the gateway's span of the resume POST links to (`TurnLink`).
TURN_TRACEPARENT = "loopline-turn-traceparent"
LINKED_METHODS = frozenset({"/loopline.assistant.v1.AssistantService/Resume"})
FLUSH_TIMEOUT_S = 2.0  # at stop, queued spans are sent for at most this long

_provider: TracerProvider | None = None
_tracer: Tracer | None = None
_RESUMED_FROM = "loopline.resumed_from"  # context key: the span context of the Resume RPC


def exporters(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The span exporters the OTEL_* variables configure ([] = tracing off): the names of
    OTEL_TRACES_EXPORTER ("none" dropped), else ["otlp"] when an OTLP endpoint is set; none at all
    when OTEL_SDK_DISABLED is true."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    named = [n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "").split(",")]
    named = [n for n in named if n]
    if named:
        return [n for n in named if n != "none"]
    for variable in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        if environ.get(variable, "").strip():
            return ["otlp"]
    return []


def configured(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the OTEL_* variables turn tracing on (`exporters` names one)."""
    return bool(exporters(environ))


def setup(service_name: str) -> bool:
    """Install the SDK's TracerProvider (resource `service.name`: OTEL_SERVICE_NAME, else
    `service_name`) with a BatchSpanProcessor per configured exporter, as the global provider
    too; returns whether tracing is on. Nothing is installed (or imported) when it is off.
    Exporters: "otlp" (OTLP over HTTP/protobuf, its endpoint, headers and timeout from the
    OTEL_EXPORTER_OTLP_* variables) and "console" (one JSON line per span on stdout); others
    are logged and skipped."""
    if _provider is not None:
        return True
    built = _build_exporters(exporters())
    if not built:
        return False
    from opentelemetry import trace
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = _new_provider(os.environ.get("OTEL_SERVICE_NAME", "").strip() or service_name)
    for exporter in built:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _install(provider)
    log.info(
        "tracing on",
        extra={"fields": {"service_name": provider.resource.attributes.get("service.name")}},
    )
    return True


def _build_exporters(names: list[str]) -> list[SpanExporter]:
    """The exporters named (see `setup`)."""
    built: list[SpanExporter] = []
    for name in names:
        if name == "otlp":
            protocol = os.environ.get(
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            )
            if protocol and protocol.strip() != "http/protobuf":
                log.warning(
                    "OTLP is sent over HTTP/protobuf only; the protocol setting is ignored",
                    extra={"fields": {"protocol": protocol}},
                )
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            built.append(OTLPSpanExporter())
        elif name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            built.append(ConsoleSpanExporter(formatter=lambda span: span.to_json(None) + "\n"))
        else:
            log.warning("unknown span exporter skipped", extra={"fields": {"exporter": name}})
    return built


def _new_provider(service_name: str) -> TracerProvider:
    """A TracerProvider for `service_name` whose spans carry the request id bound where they
    start (`loopline.request_id`, the log context's `request_id`: request_ids.py)."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

    class RequestIds(SpanProcessor):
        def on_start(self, span: Any, parent_context: Any = None) -> None:
            request_id = loopline_logging.bound(REQUEST_ID_FIELD)
            if request_id:
                span.set_attribute(REQUEST_ID, request_id)

    # shut down by `shutdown` (bounded), not by the SDK's exit hook (which waits up to 30 s)
    provider = TracerProvider(
        resource=Resource.create({SERVICE_NAME: service_name}), shutdown_on_exit=False
    )
    provider.add_span_processor(RequestIds())
    return provider


def _install(provider: TracerProvider) -> None:
    global _provider, _tracer
    _provider = provider
    _tracer = provider.get_tracer("loopline")


def install_for_tests(exporter: SpanExporter, service_name: str = "loopline") -> TracerProvider:
    """Tracing on in this process with `exporter` (e.g. the SDK's InMemorySpanExporter) behind a
    SimpleSpanProcessor, for in-process tests: install before the services start (their servers
    and channels take the interceptors when made), `shutdown()` after they stopped. The global
    provider is left alone (OpenTelemetry sets it once per process)."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = _new_provider(service_name)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _install(provider)
    return provider


def shutdown() -> None:
    """Turn tracing off, sending the spans still queued for at most FLUSH_TIMEOUT_S.

    The provider's shutdown runs on a thread of its own, waited for FLUSH_TIMEOUT_S: an
    exporter whose receiver does not answer retries for its whole timeout (10 s by default), and
    the SDK's force_flush takes no timeout; a stopping service does not wait for that."""
    global _provider, _tracer
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        closing = threading.Thread(target=provider.shutdown, name="tracing-shutdown", daemon=True)
        closing.start()
        closing.join(FLUSH_TIMEOUT_S)


def enabled() -> bool:
    """Whether tracing is on in this process."""
    return _provider is not None


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """The gRPC server interceptor of opentelemetry-instrumentation-grpc (health checks and
    reflection untraced); none when tracing is off."""
    if _provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(tracer_provider=_provider, filter_=_untraced_filter())]


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """The gRPC client interceptors of opentelemetry-instrumentation-grpc (they send the trace
    context), after `TurnLink`; none when tracing is off."""
    if _provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    traced = aio_client_interceptors(tracer_provider=_provider, filter_=_untraced_filter())
    return [TurnLink(), *traced]


UNTRACED_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")  # probes and tooling


def _untraced_filter() -> Any:
    """A call filter of the gRPC instrumentation: True (traced) but for health checks and
    reflection. The instrumentation's own filters cost ~45 µs a call (runtime Protocol checks):
    this reads the method name only."""

    def traced(details: Any) -> bool:
        method = details.method
        if isinstance(method, bytes):
            method = method.decode()
        return not method.startswith(UNTRACED_METHODS)

    return traced


class TurnLink(grpc.aio.UnaryUnaryClientInterceptor):
    """Client side of a resume: when the answer of a LINKED_METHODS call names the turn it
    resumes (trailing metadata TURN_TRACEPARENT), the current span (the gateway's span of the
    resume POST) gets a link to that turn's trace. First of the client interceptors: the
    current span is the caller's, and the instrumentation's interceptor inside it has waited for
    the call's end (its status), so the trailing metadata is there."""

    async def intercept_unary_unary(
        self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        call = await continuation(client_call_details, request)
        method = client_call_details.method
        if isinstance(method, bytes):
            method = method.decode()
        if method in LINKED_METHODS:
            with contextlib.suppress(grpc.aio.AioRpcError):  # done already: see the inner one's
                for key, value in await call.trailing_metadata() or ():
                    if key == TURN_TRACEPARENT:
                        _link_current(str(value), "resumed turn")
        return call


def _link_current(traceparent: str, why: str) -> Any:
    """Link the current span to the span `traceparent` names; returns that span's context, or
    None when the text is no valid traceparent."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    parent = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    target = trace.get_current_span(parent).get_span_context()
    if not target.is_valid:
        return None
    trace.get_current_span().add_link(target, {"loopline.link": why})
    return parent


def asgi_middleware(app: Any, span_details: Any, request_hook: Any, excluded: str) -> Any:
    """`app` wrapped in opentelemetry-instrumentation-asgi's OpenTelemetryMiddleware (server span
    named by `span_details(scope)`, `request_hook(span, scope)` at its start, no spans per
    receive/send, the comma-separated URL patterns `excluded` untraced); `app` itself when
    tracing is off."""
    if _provider is None:
        return app
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
    from opentelemetry.metrics import NoOpMeterProvider

    return OpenTelemetryMiddleware(
        app,
        excluded_urls=excluded,
        default_span_details=span_details,
        server_request_hook=request_hook,
        tracer_provider=_provider,
        meter_provider=NoOpMeterProvider(),  # metrics are prometheus-client's (docs/metrics.md)
        exclude_spans=["receive", "send"],
    )


def set_request_id(request_id: str) -> None:
    """Put the request's id on the current span (`loopline.request_id`), when tracing is on."""
    if _provider is not None and request_id:
        from opentelemetry import trace

        trace.get_current_span().set_attribute(REQUEST_ID, request_id)


def traceparent() -> dict[str, str]:
    """{"traceparent": the W3C traceparent of the current span} to store with a paused run
    (`resumed` joins it later); {} when tracing is off or no span is current."""
    if _provider is None:
        return {}
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return {"traceparent": carrier["traceparent"]} if "traceparent" in carrier else {}


@contextlib.contextmanager
def resumed(turn_traceparent: str, rpc_context: Any = None) -> Iterator[None]:
    """Within: runs started (`agent_run`) join the trace of `turn_traceparent` (the paused run's,
    stored by `traceparent`) as children of its span, linked to the current span (the Resume
    RPC's), which links to the turn in turn; with `rpc_context` (a grpc.aio servicer context)
    the RPC's answer names the turn in its trailing metadata (TURN_TRACEPARENT) for the
    caller's span (`TurnLink`). Nothing happens when tracing is off or the text is empty."""
    if _provider is None or not turn_traceparent:
        yield
        return
    from opentelemetry import context, trace

    turn = _link_current(turn_traceparent, "resumed turn")
    if turn is None:
        yield
        return
    if rpc_context is not None:
        rpc_context.set_trailing_metadata(((TURN_TRACEPARENT, turn_traceparent),))
    here = trace.get_current_span().get_span_context()
    token = context.attach(context.set_value(_RESUMED_FROM, here, turn))
    try:
        yield
    finally:
        context.detach(token)


class _Spec(Protocol):
    """What `agent_run` reads of a run's spec (run_state.RunSpec)."""

    @property
    def run_id(self) -> str: ...
    @property
    def chat_id(self) -> str: ...
    @property
    def organization_id(self) -> str: ...
    @property
    def model(self) -> Any: ...


class _Run(Protocol):
    """What `agent_run` reads of a run (run_state.RunState)."""

    @property
    def spec(self) -> _Spec: ...
    @property
    def outcome(self) -> str | None: ...


def agent_run(state: _Run, run: Coroutine[Any, Any, None]) -> Coroutine[Any, Any, None]:
    """The run's coroutine `run` inside an `invoke_agent assistant` span (child of the current
    span: the StartTurn RPC's, or the paused turn's within `resumed`), ended with the run's
    outcome; `run` itself when tracing is off."""
    if _tracer is None:
        return run
    return _agent_run(_tracer, state, run)


async def _agent_run(tracer: Tracer, state: _Run, run: Coroutine[Any, Any, None]) -> None:
    from opentelemetry import context, trace

    spec = state.spec
    resumed_from = context.get_value(_RESUMED_FROM)
    attributes = {
        OPERATION: "invoke_agent",
        AGENT_NAME: AGENT,
        CONVERSATION_ID: spec.chat_id,
        PROVIDER: str(getattr(spec.model, "provider_id", "")),
        REQUEST_MODEL: str(getattr(spec.model, "model_id", "")),
        "loopline.run_id": spec.run_id,
        "loopline.organization_id": spec.organization_id,
    }
    with tracer.start_as_current_span(
        f"invoke_agent {AGENT}",
        attributes=attributes,
        links=[trace.Link(resumed_from)] if isinstance(resumed_from, trace.SpanContext) else None,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            await run
        finally:
            outcome = state.outcome or "unknown"
            span.set_attribute("loopline.run.outcome", outcome)
            if outcome == "failed":
                span.set_attribute(ERROR_TYPE, "run_failed")
                span.set_status(trace.StatusCode.ERROR)


class _NoSpan:
    """What `model_call` and `tool_call` give when tracing is off: does nothing."""

    __slots__ = ()

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *_: object) -> None:
        return None

    def reply(self, reply: Any) -> None:
        """No-op (`_ModelCall.reply`)."""

    def done(self, ok: bool) -> None:
        """No-op (`_ToolCall.done`)."""


_NO_SPAN = _NoSpan()


class _SpanScope:
    """A span made current on enter and ended on exit; an exception sets `error.type` (its class
    name; a cancellation only `loopline.cancelled`) and the error status, never its text."""

    span: Span

    def __init__(self, tracer: Tracer, name: str, kind: Any, attributes: dict[str, Any]) -> None:
        self._start = (tracer, name, kind, attributes)
        self._token: object = None

    def __enter__(self) -> Self:
        from opentelemetry import context, trace

        tracer, name, kind, attributes = self._start
        self.span = tracer.start_span(
            name, kind=kind, attributes=attributes, record_exception=False
        )
        self._token = context.attach(trace.set_span_in_context(self.span))
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, _: Any
    ) -> None:
        from opentelemetry import context, trace

        context.detach(self._token)  # type: ignore[arg-type]
        if kind is not None:
            if issubclass(kind, asyncio.CancelledError):
                self.span.set_attribute("loopline.cancelled", True)
            else:
                self.span.set_attribute(ERROR_TYPE, kind.__qualname__)
                self.span.set_status(trace.StatusCode.ERROR)
                self.failed(error)
        self.span.end()

    def failed(self, error: BaseException | None) -> None:
        """Hook for what a failure adds (`_ModelCall`: the tokens it used)."""


class _ModelCall(_SpanScope):
    """The `chat {model}` span of one model call."""

    def reply(self, reply: Any) -> None:
        """Record the call's reply: usage, finish reasons and the model that answered."""
        self._usage(reply.usage)
        reasons = getattr(reply, "finish_reasons", None) or (
            ["tool_calls"] if reply.tool_calls else ["stop"]
        )
        self.span.set_attribute(FINISH_REASONS, [str(r) for r in reasons])
        answered = getattr(reply, "response_model", "")
        if answered:
            self.span.set_attribute(RESPONSE_MODEL, str(answered))

    def failed(self, error: BaseException | None) -> None:
        usage = getattr(error, "usage", None)
        if usage is not None:
            self._usage(usage)

    def _usage(self, usage: Any) -> None:
        """Token counts: input counts every input token read (cache reads and writes included),
        as `done.usage` does; the cached parts apart too."""
        read, written = _count(usage.cache_read_tokens), _count(usage.cache_write_tokens)
        attributes: dict[str, Any] = {
            INPUT_TOKENS: _count(usage.input_tokens) + read + written,
            OUTPUT_TOKENS: _count(usage.output_tokens),
        }
        if read:
            attributes[CACHE_READ_TOKENS] = read
        if written:
            attributes[CACHE_WRITE_TOKENS] = written
        if getattr(usage, "estimated", False):
            attributes["loopline.usage.estimated"] = True
        self.span.set_attributes(attributes)


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def model_call(model: Any, purpose: str = "") -> _ModelCall | _NoSpan:
    """A context manager around one call of `model` (a ChatModel: provider_id, model_id): the
    `chat {model}` span (kind CLIENT); `.reply(reply)` records the ModelReply. `purpose`
    ("summary") is set as `loopline.model_call.purpose`. A no-op when tracing is off."""
    if _tracer is None:
        return _NO_SPAN
    from opentelemetry.trace import SpanKind

    model_id = str(getattr(model, "model_id", ""))
    attributes = {
        OPERATION: "chat",
        PROVIDER: str(getattr(model, "provider_id", "")),
        REQUEST_MODEL: model_id,
    }
    if purpose:
        attributes["loopline.model_call.purpose"] = purpose
    return _ModelCall(_tracer, f"chat {model_id}", SpanKind.CLIENT, attributes)


class _ToolCall(_SpanScope):
    """The `execute_tool {tool}` span of one tool call."""

    failure = "tool_error"

    def done(self, ok: bool) -> None:
        """Record the call's outcome: a failed call gets `error.type` (`failure`)."""
        if not ok:
            from opentelemetry import trace

            self.span.set_attribute(ERROR_TYPE, self.failure)
            self.span.set_status(trace.StatusCode.ERROR)


def tool_call(step: Any) -> _ToolCall | _NoSpan:
    """A context manager around one tool call of the loop (`step`: a tool_calls.ToolStep): the
    `execute_tool {tool}` span; `.done(ok)` records its outcome. A failed call's `error.type` is
    "invalid_input" for a call not run (its input refused) or a malformed question, else
    "tool_error". A no-op when tracing is off."""
    if _tracer is None:
        return _NO_SPAN
    from opentelemetry.trace import SpanKind

    call = step.call
    name = str(call.name)
    attributes: dict[str, Any] = {
        OPERATION: "execute_tool",
        TOOL_NAME: name,
        TOOL_CALL_ID: str(call.id),
        TOOL_TYPE: "function",
    }
    if step.asks_user:
        attributes["loopline.tool.asks_user"] = True
    scope = _ToolCall(
        _tracer, f"execute_tool {name[:TOOL_NAME_CHARS]}", SpanKind.INTERNAL, attributes
    )
    if step.invalid is not None or step.asks_user:
        scope.failure = "invalid_input"
    return scope
