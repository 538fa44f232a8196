"""Prometheus metrics of every service: each metric defined once here, on the default registry.

Names follow Prometheus' conventions (`loopline_` prefix, `_total` counters, `_seconds`
histograms, base units). No label takes an unbounded value: never an id, an organization or
free text. A model is labelled by its id only when its provider's catalogue (the configured
model list) names it, else "other"; a tool by its name only when it is one the model was given;
an integration by its name only when the catalogue or the operator's configuration names it.

The hot path pays a handful of operations per turn: the labelled children are looked up once
(`ModelCatalogue`, `TurnMeter`) and kept; nothing is done per streamed frame but one histogram
observation per flush round of the gateway's fan-out (`event_delivered`).

The gateway serves the registry at GET /metrics (`exposition`); the orchestrator, billing and
tools each on a metrics port of their own (`MetricsServer.start`). docs/metrics.md lists them.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Awaitable, Collection, Mapping
from typing import Any, TypeVar
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import (
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.exposition import ThreadingWSGIServer, choose_encoder

from services.common import db

T = TypeVar("T")

# No `*_created` series beside every counter and histogram child: a timestamp per series that
# doubles the scrape and that Prometheus' text format does not need.
disable_created_metrics()

OTHER = "other"  # the label value of anything outside the known set

# Latencies from a few ms (a scripted model, a local tool) to minutes (a long model answer).
CALL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TURN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
# The fan-out's target is a p99 under 50 ms.
DELIVERY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

# ----- turns (orchestrator) ----------------------------------------------------------------
TURN_OUTCOMES = ("completed", "interrupted", "cancelled", "failed")
TURNS_STARTED = Counter(
    "loopline_turns_started_total", "Runs started by this orchestrator (new turns and resumes)."
)
TURNS_ENDED = Counter(
    "loopline_turns_ended_total",
    "Runs ended by this orchestrator, by the run's end state.",
    ["outcome"],
)
TURN_DURATION = Histogram(
    "loopline_turn_duration_seconds",
    "Time from a run's start to its end stored and published, by end state.",
    ["outcome"],
    buckets=TURN_BUCKETS,
)
TURN_FIRST_FRAME = Histogram(
    "loopline_turn_first_frame_seconds",
    "Time from a run's start to its first response_chunk or tool_call event.",
    buckets=CALL_BUCKETS,
)

# ----- model calls (orchestrator) ----------------------------------------------------------
MODEL_CALLS = Counter(
    "loopline_model_calls_total",
    "Model calls by provider, model and outcome (ok, error, cancelled).",
    ["provider", "model", "outcome"],
)
MODEL_CALL_DURATION = Histogram(
    "loopline_model_call_duration_seconds",
    "Duration of model calls that finished (ok or error), retries included.",
    ["provider", "model"],
    buckets=CALL_BUCKETS,
)
MODEL_TOKENS = Counter(
    "loopline_model_tokens_total",
    "Tokens of model calls by type: input (cached or not) and output.",
    ["provider", "model", "type"],
)

# ----- tool calls (orchestrator) and integration actions (tools) -----------------------------
TOOL_CALLS = Counter(
    "loopline_tool_calls_total",
    "Tool calls of the agent loop by tool and outcome (ok, error, not_run, cancelled, asked).",
    ["tool", "outcome"],
)
TOOL_CALL_DURATION = Histogram(
    "loopline_tool_call_duration_seconds",
    "Duration of tool calls run by the tools service, as the loop waited for them.",
    ["tool"],
    buckets=CALL_BUCKETS,
)
INTEGRATION_ACTIONS = Counter(
    "loopline_integration_actions_total",
    "Integration actions run by the tools service by integration and outcome "
    "(ok, error, timeout, cancelled).",
    ["integration", "outcome"],
)
INTEGRATION_ACTION_DURATION = Histogram(
    "loopline_integration_action_duration_seconds",
    "Duration of integration actions by integration.",
    ["integration"],
    buckets=CALL_BUCKETS,
)
INTEGRATION_WORKERS = Gauge(
    "loopline_integration_workers",
    "Integration worker processes of the tools service running now (the community catalogue's).",
)
INTEGRATION_WORKER_EXITS = Counter(
    "loopline_integration_worker_exits_total",
    "Integration worker processes ended, by reason (idle, timeout, crashed, out of memory, ...: "
    "a fixed set, services/tools/workers/pool.py).",
    ["reason"],
)

# ----- billing ---------------------------------------------------------------------------------
ADMISSIONS = Counter(
    "loopline_billing_admissions_total",
    "Admissions by layer and decision: denied by rate, quota, credit or wallet; admitted on the "
    "plan allowance (credit) or the wallet; replayed (layer none).",
    ["layer", "decision"],
)
OUTBOX_BACKLOG = Gauge(
    "loopline_billing_outbox_backlog",
    "Billing calls stored by the orchestrators and not yet taken by billing, as the last pass of "
    "this orchestrator's redelivery counted them (shared by the replicas of one database).",
)
REDELIVERIES = Counter(
    "loopline_billing_redeliveries_total",
    "Background sends of stored billing calls by outcome (sent, failed, given_up).",
    ["outcome"],
)

# ----- gateway fan-out -------------------------------------------------------------------------
OPEN_LISTENERS = Gauge(
    "loopline_gateway_open_listeners", "Event streams (listens) open on this gateway."
)
EVENT_DELIVERY_DELAY = Histogram(
    "loopline_gateway_event_delivery_delay_seconds",
    "Time from a live event's creation in the orchestrator to its write to the listeners that "
    "keep up (the oldest event of each fan-out round).",
    buckets=DELIVERY_BUCKETS,
)


def integration_worker_started() -> None:
    """Count an integration worker process started."""
    INTEGRATION_WORKERS.inc()


def integration_worker_ended(reason: str) -> None:
    """Count an integration worker process ended (`reason`: one of the pool's fixed words)."""
    INTEGRATION_WORKERS.dec()
    INTEGRATION_WORKER_EXITS.labels(reason).inc()


# ----- storage ---------------------------------------------------------------------------------
STORAGE_ERRORS = Counter(
    "loopline_storage_errors_total",
    "Database and Redis errors answered as unavailable, conflict or invalid value (or retried), "
    "by service, store and kind.",
    ["service", "store", "kind"],
)

# Known label values start at 0 in every scrape (a series that appears late breaks rate()).
_TURN_ENDS = {
    outcome: (TURNS_ENDED.labels(outcome), TURN_DURATION.labels(outcome))
    for outcome in TURN_OUTCOMES
}
_ADMISSIONS = {
    (layer, decision): ADMISSIONS.labels(layer, decision)
    for layer, decision in (
        ("rate", "denied"),
        ("quota", "denied"),
        ("credit", "denied"),
        ("wallet", "denied"),
        ("credit", "admitted"),
        ("wallet", "admitted"),
        ("none", "replayed"),
    )
}
_REDELIVERIES = {
    outcome: REDELIVERIES.labels(outcome) for outcome in ("sent", "failed", "given_up")
}
_STORAGE_ERRORS: dict[tuple[str, str, str], Any] = {}


# ----- the orchestrator's turns ---------------------------------------------------------------


class _ModelSeries:
    """The labelled children of one (provider, model) label pair."""

    __slots__ = ("cancelled", "duration", "failed", "input", "ok", "output")

    def __init__(self, provider: str, model: str) -> None:
        self.ok = MODEL_CALLS.labels(provider, model, "ok")
        self.failed = MODEL_CALLS.labels(provider, model, "error")
        self.cancelled = MODEL_CALLS.labels(provider, model, "cancelled")
        self.duration = MODEL_CALL_DURATION.labels(provider, model)
        self.input = MODEL_TOKENS.labels(provider, model, "input")
        self.output = MODEL_TOKENS.labels(provider, model, "output")


class _ToolSeries:
    """The labelled children of one tool label."""

    __slots__ = ("asked", "cancelled", "duration", "failed", "not_run", "ok")

    def __init__(self, tool: str) -> None:
        self.ok = TOOL_CALLS.labels(tool, "ok")
        self.failed = TOOL_CALLS.labels(tool, "error")
        self.not_run = TOOL_CALLS.labels(tool, "not_run")
        self.cancelled = TOOL_CALLS.labels(tool, "cancelled")
        self.asked = TOOL_CALLS.labels(tool, "asked")
        self.duration = TOOL_CALL_DURATION.labels(tool)


_TOOLS: dict[str, _ToolSeries] = {}  # by tool name: only names that were in the definitions


def _tool_series(name: str, known: Collection[Mapping[str, Any]]) -> _ToolSeries:
    """The children of tool `name`: its own when `known` (the tool definitions the model was given)
    has it, else those of "other"."""
    series = _TOOLS.get(name)
    if series is None:
        label = name if any(tool.get("name") == name for tool in known) else OTHER
        series = _TOOLS.get(label)
        if series is None:
            series = _TOOLS[label] = _ToolSeries(label)
    return series


class ModelCatalogue:
    """The models a deployment names: `{provider id: model ids, or None when any is allowed}`.

    `series(provider, model)` gives the children of the pair's labels: the provider's id when the
    catalogue has it and the model's id when the provider's list has it, else "other" for each.
    The children are kept per label pair, so the cache is as bounded as the labels.
    """

    def __init__(self, providers: Mapping[str, Collection[str] | None]) -> None:
        self.providers = {
            provider: (frozenset(models) if models is not None else None)
            for provider, models in providers.items()
        }
        self._series: dict[tuple[str, str], _ModelSeries] = {}

    def labels(self, provider: str, model: str) -> tuple[str, str]:
        """The (provider, model) label values of a model call."""
        if provider not in self.providers:
            return OTHER, OTHER
        models = self.providers[provider]
        return provider, (model if models is not None and model in models else OTHER)

    def series(self, provider: str, model: str) -> _ModelSeries:
        labels = self.labels(provider, model)
        series = self._series.get(labels)
        if series is None:
            series = self._series[labels] = _ModelSeries(*labels)
        return series

    def turn(self, model: Any) -> TurnMeter:
        """Count a run started with chat model `model` (its `provider_id` and `model_id`) and
        return its meter."""
        TURNS_STARTED.inc()
        series = self.series(
            str(getattr(model, "provider_id", "") or ""), str(getattr(model, "model_id", "") or "")
        )
        return TurnMeter(series)


class TurnMeter:
    """The metrics of one run: its model calls and tokens, its tool calls, the time to its first
    frame and its end. Made by `ModelCatalogue.turn`; a meter made directly counts no start (and
    its calls under provider and model "other")."""

    __slots__ = ("_first_frame", "_model", "_started")

    def __init__(self, model: _ModelSeries | None = None) -> None:
        self._model = model if model is not None else _OTHER_MODEL
        self._started = time.perf_counter()
        self._first_frame = False

    def first_frame(self) -> None:
        """The run published a response_chunk or tool_call: the first one is observed."""
        if not self._first_frame:
            self._first_frame = True
            TURN_FIRST_FRAME.observe(time.perf_counter() - self._started)

    def ended(self, outcome: str) -> None:
        """The run ended in `outcome` (completed, interrupted, cancelled or failed)."""
        counter, duration = _TURN_ENDS.get(outcome) or _TURN_ENDS["failed"]
        counter.inc()
        duration.observe(time.perf_counter() - self._started)

    async def model_call(self, call: Awaitable[T]) -> T:
        """Await the model call `call`, counting it by outcome and observing its duration."""
        series = self._model
        started = time.perf_counter()
        try:
            reply = await call
        except asyncio.CancelledError:
            series.cancelled.inc()
            raise
        except BaseException:
            series.failed.inc()
            series.duration.observe(time.perf_counter() - started)
            raise
        series.ok.inc()
        series.duration.observe(time.perf_counter() - started)
        return reply

    def tokens(self, usage: Any) -> None:
        """Count a model call's token usage (a TokenUsage already clamped: ints >= 0); input
        counts every token the provider read, cached or not, as `done.usage` does."""
        read = usage.input_tokens + usage.cache_read_tokens + usage.cache_write_tokens
        if read:
            self._model.input.inc(read)
        if usage.output_tokens:
            self._model.output.inc(usage.output_tokens)

    async def tool_call(
        self,
        name: str,
        known: Collection[Mapping[str, Any]],
        call: Awaitable[tuple[Any, bool, Any]],
        *,
        run: bool = True,
    ) -> tuple[Any, bool, Any]:
        """Await the act step `call` of tool `name` (its result: (output, succeeded, JSON)),
        counting it by outcome: ok, error, not_run (`run` False: its input was refused) or
        cancelled; the duration of a call that ran is observed. `known`: the tool definitions
        the model was given (a name outside them is "other")."""
        series = _tool_series(name, known)
        started = time.perf_counter()
        try:
            result = await call
        except asyncio.CancelledError:
            series.cancelled.inc()
            raise
        if not run:
            series.not_run.inc()
            return result
        (series.ok if result[1] else series.failed).inc()
        series.duration.observe(time.perf_counter() - started)
        return result

    @staticmethod
    def question(name: str, known: Collection[Mapping[str, Any]], asked: bool) -> None:
        """A HITL tool call: the run paused on its question (`asked`), or it was malformed."""
        series = _tool_series(name, known)
        (series.asked if asked else series.failed).inc()


_OTHER_MODEL = _ModelSeries(OTHER, OTHER)


# ----- billing -----------------------------------------------------------------------------


def admission(layer: str, decision: str) -> None:
    """Count an admission: `decision` admitted (layer credit or wallet: what funds it), denied
    (layer rate, quota, credit or wallet) or replayed (layer none)."""
    child = _ADMISSIONS.get((layer, decision))
    if child is not None:
        child.inc()


def redelivery(outcome: str) -> None:
    """Count a background send of a stored billing call: sent, failed or given_up."""
    _REDELIVERIES[outcome].inc()


def integration_action(integration: str, outcome: str, seconds: float) -> None:
    """Count an integration action of the tools service (`integration` already bounded by the
    caller: a catalogue or operator-configured name, else a fixed word)."""
    INTEGRATION_ACTIONS.labels(integration, outcome).inc()
    INTEGRATION_ACTION_DURATION.labels(integration).observe(seconds)


# ----- storage ---------------------------------------------------------------------------------


def count_storage_error(service: str, store: str, kind: str) -> None:
    """Count one storage error of `service` (gateway, orchestrator, billing, tools): `store`
    database or redis, `kind` unavailable, conflict or invalid_value."""
    key = (service, store, kind)
    child = _STORAGE_ERRORS.get(key)
    if child is None:
        child = _STORAGE_ERRORS[key] = STORAGE_ERRORS.labels(service, store, kind)
    child.inc()


def storage_error(service: str, error: BaseException) -> None:
    """Count `error` when it is a storage error that is not a bug (`db.unavailable_store`,
    `db.is_conflict`, `db.is_invalid_value`, as `errors.storage_failure` reads it); any other
    error is not counted."""
    store = db.unavailable_store(error)
    if store is not None:
        count_storage_error(service, store.lower(), "unavailable")
    elif db.is_conflict(error):
        count_storage_error(service, "database", "conflict")
    elif db.is_invalid_value(error):
        count_storage_error(service, "database", "invalid_value")


# ----- gateway ---------------------------------------------------------------------------------


def event_created(event: Any) -> float:
    """The wall-clock time (seconds) a run event was created (its `time`), 0.0 when unset."""
    stamp = event.time
    return stamp.seconds + stamp.nanos / 1e9 if stamp.seconds > 0 else 0.0


def event_delivered(created: float) -> None:
    """Observe the delay from `created` (`event_created`) to now: the event was written to the
    listeners. The clocks of two hosts may differ: a negative delay counts as 0."""
    EVENT_DELIVERY_DELAY.observe(max(0.0, time.time() - created))


def exposition(accept: str | None) -> tuple[bytes, str]:
    """The default registry in the format the `Accept` header asks for (Prometheus text, or
    OpenMetrics): (body, content type)."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(REGISTRY), content_type


# ----- the metrics port of the gRPC services -------------------------------------------------


class _QuietHandler(WSGIRequestHandler):
    """No line on stderr per scrape (the services log JSON only)."""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the overridden name
        pass


class _ThreadingWSGIServerV6(ThreadingWSGIServer):
    address_family = socket.AF_INET6


class MetricsServer:
    """prometheus_client's WSGI app on a port of its own, served by a thread.

    `await MetricsServer.start(host, port, setting)` binds `host:port` (0 = any free port;
    `.port` is the one bound) and serves GET /metrics (any path answers the registry, as
    prometheus_client's own server does); `await stop()` stops it and frees the port.
    """

    POLL_S = 0.1  # how often the serving thread looks for a stop (a stop waits this long at most)

    def __init__(self, httpd: Any) -> None:
        self._httpd = httpd
        self.port: int = httpd.server_port
        self._thread = threading.Thread(
            target=httpd.serve_forever,
            kwargs={"poll_interval": self.POLL_S},
            name="metrics-http",
            daemon=True,
        )
        self._thread.start()

    @classmethod
    async def start(cls, host: str, port: int, setting: str) -> MetricsServer:
        """Serve the registry on `host:port`. Raises PortUnavailable (one line naming the
        address and `setting`, the variable that chooses the port) when it cannot be bound."""
        # imported on use: grpc_server's imports lead back to this module
        from services.common.grpc_server import PortUnavailable  # noqa: PLC0415

        server_class = _ThreadingWSGIServerV6 if ":" in host else ThreadingWSGIServer

        def bind() -> Any:
            return make_server(
                host.strip("[]"), port, make_wsgi_app(REGISTRY), server_class, _QuietHandler
            )

        try:  # off the event loop: binding looks the host's name up
            httpd = await asyncio.to_thread(bind)
        except OSError as error:
            raise PortUnavailable(
                f"cannot bind the metrics port {host}:{port} ({setting}): "
                f"{error.strerror or type(error).__name__}"
            ) from None
        return cls(httpd)

    async def stop(self) -> None:
        """Stop serving (a scrape under way finishes in its own thread) and close the port; a
        second stop does nothing."""
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            await asyncio.to_thread(httpd.shutdown)
            httpd.server_close()
