"""What a run carries through the loop: its spec, its live state in this process, the totals
it gathers (thread, usage, tool calls) and the outcome it ends in."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import timestamp_pb2

from loopline.assistant.v1 import events_pb2
from services.common.metrics import ModelCatalogue, TurnMeter
from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.providers.base import ChatModel, TokenUsage, add_usage
from services.orchestrator.providers.registry import SCRIPTED_MODELS, providers
from services.orchestrator.store import ThreadRow


@dataclass
class RunSpec:
    """What a run needs to start: ids, the organization, and the model to call."""

    run_id: str
    chat_id: str
    organization_id: str
    llm: dict[str, Any]
    model: ChatModel
    # the chat's stored thread when the caller already knows it (a new chat: its user message);
    # None: the loop loads it from the database when the run starts
    history: list[ThreadRow] | None = None


@dataclass
class RunState:
    """Live state of a run in this process (for cancel)."""

    spec: RunSpec
    task: asyncio.Task | None = None
    inner: asyncio.Task | None = None
    cancel_reason: str | None = None
    finishing: bool = False
    outcome: str | None = None
    # set once the run's end is stored and published
    ended: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Outcome:
    """How a run ended: kind is completed, interrupted, cancelled or failed."""

    kind: str
    response: str = ""
    message: str = ""
    reason: str = ""
    interrupt: dict[str, Any] | None = None


class LoopFailure(Exception):
    """A failure that ends the run; `str(self)` is already safe to show."""


@dataclass
class RunTotals:
    """What a run gathers as it goes: its thread, usage, tool calls and what is still pending."""

    usage: TokenUsage = field(default_factory=TokenUsage)
    llm_calls: int = 0  # every model call, summaries included (done.usage.llm_calls)
    reason_calls: int = 0  # the loop's reason steps (the every-20th-call guidance counts these)
    tool_calls: list[events_pb2.ToolCallRecord] = field(default_factory=list)
    pending_call: dict[str, Any] | None = None  # a tool call stored without its result yet
    pending_guidance: str | None = None  # guidance to give the model after the pending tool result
    model_in_flight: bool = False  # a model call was running when the loop stopped
    # the response_chunk texts the latest model call published
    streamed: list[str] = field(default_factory=list)
    # usage records and tool charges still on their way to billing
    pending_writes: list[asyncio.Future[Any]] = field(default_factory=list)
    # the chat's thread as the model sees it, stored or not
    rows: list[ThreadRow] = field(default_factory=list)
    # this run's messages, written when the run ends
    unsaved: list[ThreadRow] = field(default_factory=list)
    interrupt: dict[str, Any] | None = None  # the HITL audit row, written when the run ends
    unsummarizable: bool = False  # a summary call of this run returned no text: not asked again
    failures_in_a_row: int = 0  # tool calls failed in a row (the failure guidance counts them)
    # the run's metrics (`model_catalogue(settings).turn(model)`)
    meter: TurnMeter = field(default_factory=TurnMeter)

    def count(self, usage: TokenUsage) -> None:
        """Add one model call's tokens to the run's totals (`done.usage`, see `input_tokens`) and
        to its metrics."""
        add_usage(self.usage, usage)
        self.meter.tokens(usage)

    def input_tokens(self) -> int:
        """Every input token the run's model calls read, cached or not: `done.usage.input_tokens`.

        A provider's own "input tokens" may leave the cached part out (Anthropic's `input_tokens`
        excludes cache reads and writes; Loopline records OpenAI's cached prompt tokens apart
        for pricing), so `done.usage` counts every token the provider read. Billing still
        prices each part at its own rate.
        """
        usage = self.usage
        return usage.input_tokens + usage.cache_read_tokens + usage.cache_write_tokens

    def add_row(self, spec: RunSpec, role: str, content: Any, extra: dict[str, Any] | None) -> None:
        """Append a message to the run's thread (stored when the run ends, see store.py)."""
        row = ThreadRow(
            role=role, content=content, extra=extra, chat_id=spec.chat_id, run_id=spec.run_id
        )
        self.rows.append(row)
        self.unsaved.append(row)

    def add_tool_result(self, spec: RunSpec, call_id: str, name: str, output: Any) -> None:
        """Append a tool call's result to the run's thread."""
        self.add_row(spec, "tool", output, {"tool_call_id": call_id, "name": name})


def new_event(run_id: str, **payload: Any) -> events_pb2.Event:
    """A run event of `payload` (one member of the Event oneof) stamped with the current time."""
    ns = time.time_ns()
    return events_pb2.Event(
        run_id=run_id,
        time=timestamp_pb2.Timestamp(seconds=ns // 1_000_000_000, nanos=ns % 1_000_000_000),
        **payload,
    )


def model_catalogue(settings: OrchestratorSettings) -> ModelCatalogue:
    """The models this deployment names, for the metrics' labels: each configured provider's
    model list (None: the provider allows any, so its models are labelled "other"), and the
    scripted model's when it is enabled."""
    catalogue: dict[str, frozenset[str] | None] = {
        provider_id: config.models for provider_id, config in providers(settings).items()
    }
    if settings.scripted_model_enabled:
        catalogue["scripted"] = SCRIPTED_MODELS
    return ModelCatalogue(catalogue)
