"""The agent loop: reason (model call) -> act (one tool) -> observe (tool result), repeated.

Spec: "The reason, act, observe loop", "Termination and limits", "Events emitted during a
turn". One `TurnRunner` per process runs every loop as an asyncio task; a run ends in
exactly one outcome: completed, interrupted (HITL pause), cancelled or failed.

Ordering rule: the database is updated (status, `running_id` cleared) *before* the
terminal event is published, so a client that sees `done` can start its next turn at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc
import orjson
from google.protobuf import struct_pb2, timestamp_pb2
from sqlalchemy import exc as sa_exc
from sqlalchemy import select, update

from loopline.assistant.v1 import events_pb2
from loopline.billing.v1 import billing_pb2, billing_pb2_grpc
from loopline.tools.v1 import tools_pb2, tools_pb2_grpc
from services.common import db, pb
from services.common import logging as loopline_logging
from services.orchestrator import hitl
from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.events import EventLog, is_terminal
from services.orchestrator.models import Chat, Run, RunEvent, utcnow
from services.orchestrator.providers.base import (
    ChatModel,
    ModelError,
    ModelReply,
    TokenUsage,
    ToolCallRequest,
    add_usage,
    clamp_usage,
)
from services.orchestrator.sanitize import UNPRINTABLE, model_failure
from services.orchestrator.store import RunEnd, RunTakenOver, ThreadRow, TurnStore
from services.orchestrator.thread import (
    choose_cut,
    cut_off_result,
    estimate,
    split_summary,
    with_summary,
)
from services.orchestrator.usage import CALL_TIMEOUT_S, Redelivery, RunCharges, UsageBatcher

log = logging.getLogger(__name__)

SUMMARY_INSTRUCTION = (
    "Summarize the conversation above for your own later use: the user's goals, the facts and tool "
    "results that still matter, decisions made and open questions. Be concise; do not address the user."
)


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
    ended: asyncio.Event = field(
        default_factory=asyncio.Event
    )  # set once the run's end is stored and published


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


UNREADABLE_RESULT = (
    "the tool's result could not be read (its response could not be decoded); the call may have run"
)
TOOL_LIST_TIMEOUT_S = 2.0  # deadline of ListTools at a run's start (`tool_definitions`)
TOOL_LIST_RETRY_S = 5.0  # wait before ListTools is asked again after it failed
#: The error result of a tool call the tools service failed (`_execute`), by gRPC status.
TOOLS_FAILED = {
    grpc.StatusCode.DEADLINE_EXCEEDED: "the tool did not answer in time; the call may have run",
    grpc.StatusCode.UNAVAILABLE: "the tools service is unavailable; try again later",
}
ARCHIVE_RETRY_FIRST_S = (
    0.5  # first wait before a failed archive of an ended run is tried again (doubling)
)
ARCHIVE_RETRY_MAX_S = 60.0  # longest wait between two tries
ARCHIVE_AT_STOP_S = 2.0  # a shutdown's last try of each archive still pending
ARCHIVE_FLUSH_S = (
    0.5  # longest wait for the log to store the owner's events before its archive (then left due)
)
FINISH_RETRY_FIRST_S = 0.1  # first wait before a run's end is stored again while its database is unavailable (doubling)
FINISH_RETRY_MAX_S = 2.0  # longest wait between two tries
CUT_OFF_CALL = "the tools service went away during the call; the call may have run"


def tools_failure(failure: grpc.aio.AioRpcError) -> str:
    """The error result of a tool call the tools service failed (`TOOLS_FAILED` by status code).

    UNAVAILABLE covers two cases gRPC tells apart only in its details: the service could not
    be reached (no connection: the call was never sent, so trying later is safe) and a
    connection lost during the call (the service crashed or stopped: the action may have
    happened, so the model must not be told to simply repeat it; fresh-eyes test). Anything
    but a failed connection counts as the second."""
    code = failure.code()
    if (
        code == grpc.StatusCode.UNAVAILABLE
        and "failed to connect" not in (failure.details() or "").lower()
    ):
        return CUT_OFF_CALL
    return TOOLS_FAILED.get(code, f"the tools service failed ({code.name.lower()})")


def checked_call(call: ToolCallRequest) -> tuple[ToolCallRequest, struct_pb2.Struct, str | None]:
    """`call` with its input as a Struct, checked against the depth rule of services/common/pb.py.

    Returns (call, input Struct, None); for input nested deeper than `pb.MAX_JSON_DEPTH` levels
    (which the tools service, the event stream and GetChat could not decode), (the call with a
    clipped copy of its input, that copy as a Struct, the error the model gets as the call's
    result): the call is not run, and the thread, the `tool_call` event and done.tool_calls keep
    the clipped copy (deeper parts as their JSON text), so everything stored or published stays
    decodable. One walk of the input when it fits (to_struct measures while it builds).
    A call whose arguments could not be read as a JSON object (`call.unreadable`: invalid
    JSON, an array, a string) has the input {} and that reason as its error: not run either.
    """
    if call.unreadable:
        error = f"Invalid input for {call.name}: {call.unreadable}; the call was not run. Send the input as a JSON object."
        return call, struct_pb2.Struct(), error
    try:
        return call, pb.to_struct(call.input), None
    except pb.JsonTooDeep as deep:
        kept = pb.clipped(call.input)
        error = (
            f"Invalid input for {call.name}: {deep}; the call was not run. Send a flatter input."
        )
        return dataclasses.replace(call, input=kept), pb.to_struct(kept), error


def _scrubbed(reply: ModelReply) -> ModelReply:
    """`reply` with every lone UTF-16 surrogate in its text and tool calls as U+FFFD (`pb.scrub`):
    a model's JSON may escape one (`"\\ud800"`), and protobuf, orjson and the databases take no
    such string (it failed the whole turn; fresh-eyes test). A tool call's id also loses its
    control characters (`_call_id`)."""
    reply.text = pb.scrub(reply.text)
    reply.tool_calls = [
        dataclasses.replace(
            call,
            id=_call_id(pb.scrub(call.id)),
            name=pb.scrub(call.name),
            input=pb.scrub(call.input),
        )
        for call in reply.tool_calls
    ]
    return reply


def _call_id(given: str) -> str:
    """A tool call's id as the loop keeps it: the model's without control characters, or a new
    `call_…` id when nothing is left. The id is stored in text columns (a question's audit row),
    where PostgreSQL refuses a NUL (a HITL call whose id held one failed the run's end; fresh-eyes
    test); the thread, the events and the next model call all carry the kept id, so the model's
    calls and their results still pair up."""
    kept = UNPRINTABLE.sub("", given)
    return kept or f"call_{uuid.uuid4().hex[:24]}"


def _failure(error: str) -> tuple[dict[str, Any], bool, bytes]:
    """A failed tool call's result: ({"error": error, "success": False}, False, the same as JSON text)."""
    output = {"error": error, "success": False}
    return output, False, pb.json_bytes(output)


@dataclass
class _Totals:
    usage: TokenUsage = field(default_factory=TokenUsage)
    llm_calls: int = 0  # every model call, summaries included (done.usage.llm_calls)
    reason_calls: int = 0  # the loop's reason steps (the every-20th-call guidance counts these)
    tool_calls: list[events_pb2.ToolCallRecord] = field(default_factory=list)
    pending_call: dict[str, Any] | None = None  # a tool call stored without its result yet
    pending_guidance: str | None = None  # guidance to give the model after the pending tool result
    model_in_flight: bool = False  # a model call was running when the loop stopped
    streamed: list[str] = field(
        default_factory=list
    )  # the response_chunk texts the latest model call published
    pending_writes: list[asyncio.Future] = field(
        default_factory=list
    )  # usage records and tool charges still on their way to billing
    rows: list[ThreadRow] = field(
        default_factory=list
    )  # the chat's thread as the model sees it, stored or not
    unsaved: list[ThreadRow] = field(
        default_factory=list
    )  # this run's messages, written when the run ends
    interrupt: dict[str, Any] | None = (
        None  # the HITL audit row, written when the run ends (paused)
    )
    unsummarizable: bool = False  # a summary call of this run returned no text: not asked again

    def count(self, usage: TokenUsage) -> None:
        """Add one model call's tokens to the run's totals (`done.usage`, see `input_tokens`)."""
        add_usage(self.usage, usage)

    def input_tokens(self) -> int:
        """Every input token the run's model calls read, cached or not: `done.usage.input_tokens`.

        A provider's own "input tokens" may leave the cached part out (Anthropic's `input_tokens`
        excludes cache reads and writes; Loopline records OpenAI's cached prompt tokens apart
        for pricing), so a client adding up `done.usage` counted far fewer tokens than the
        provider read (fresh-eyes test). Billing still prices each part at its own rate.
        """
        usage = self.usage
        return usage.input_tokens + usage.cache_read_tokens + usage.cache_write_tokens


class TurnRunner:
    """Runs agent loops as background tasks and publishes their events.

    Args:
        settings: orchestrator settings (limits, timeouts).
        sessions: async session factory of the orchestrator database (the rare paths).
        store: the hot-path transactions (store.py): thread loads, run ends, archives.
        events: the run event log (`MemoryEventLog`, or Redis Streams; see backend.py).
        billing: BillingService stub (RecordUsage).
        tools: ToolsService stub (ListTools, ExecuteTool).
    """

    def __init__(
        self,
        settings: OrchestratorSettings,
        sessions: Any,
        store: TurnStore,
        events: EventLog,
        billing: billing_pb2_grpc.BillingServiceStub,
        tools: tools_pb2_grpc.ToolsServiceStub,
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.store = store
        self.redelivery = Redelivery(
            sessions
        )  # billing calls that failed their quick retries (usage.py)
        self.redelivery.register(
            "RecordToolUsage",
            lambda data: billing.RecordToolUsage(
                billing_pb2.RecordToolUsageRequest.FromString(data), timeout=CALL_TIMEOUT_S
            ),
        )
        self.redelivery.register(  # a reservation the turn start could not release (service.py `_release`)
            "Release",
            lambda data: billing.Release(
                billing_pb2.ReleaseRequest.FromString(data), timeout=CALL_TIMEOUT_S
            ),
        )
        self.usage = UsageBatcher(billing, self.redelivery, forget=store.forget_redeliveries)
        self.charges = RunCharges(
            billing, self.redelivery, forget=store.forget_redeliveries
        )  # each turn's run charge
        self.events = events
        self.billing = billing
        self.tools = tools
        self.active: dict[str, RunState] = {}
        self._archiving: dict[
            str, asyncio.Task
        ] = {}  # ended runs whose archive failed: tried again (`archive_after_end`)
        self._tool_defs: list[dict[str, Any]] | None = None
        self._tool_defs_at = 0.0
        self._tool_defs_retry_at = 0.0

    # ------------------------------------------------------------------ lifecycle

    def start(self, spec: RunSpec) -> RunState:
        """Register and start the run's loop task; returns its state (available to Cancel at once)."""
        state = RunState(spec=spec)
        self.active[spec.run_id] = state
        self.events.open(spec.run_id)
        state.task = asyncio.create_task(self._run(state), name=f"run:{spec.run_id}")
        return state

    async def cancel(self, run_id: str, reason: str) -> str | None:
        """Cancel a run of this process and wait for its end to be stored and published (not
        for the archive of its events that may follow); returns its outcome kind.

        Returns None when the run is not active here. A run already finishing keeps
        the outcome it reached (exactly one terminal outcome).
        """
        state = self.active.get(run_id)
        if state is None:
            return None
        if not state.finishing and state.cancel_reason is None:
            state.cancel_reason = reason
            if state.inner is not None:
                state.inner.cancel()
        if state.task is not None:
            ended = asyncio.ensure_future(state.ended.wait())
            try:
                await asyncio.shield(
                    asyncio.wait({state.task, ended}, return_when=asyncio.FIRST_COMPLETED)
                )
            finally:
                ended.cancel()
        return state.outcome

    async def stop(self) -> None:
        """Cancel every active run (shutdown) and wait for them to record their outcome."""
        for run_id in list(self.active):
            await self.cancel(run_id, "shutdown")
        tasks = {state.task for state in self.active.values() if state.task is not None}
        if tasks:  # the archives of the runs just ended (a cancel answers before them)
            await asyncio.wait(tasks)
        await self._stop_archiving()
        await self.charges.close()
        await self.usage.close()  # closes the redelivery too

    # ------------------------------------------------------------------ the run

    async def _run(self, state: RunState) -> None:
        spec = state.spec
        loopline_logging.bind_task(
            run_id=spec.run_id, chat_id=spec.chat_id, org_id=spec.organization_id
        )
        totals = _Totals()
        state.inner = asyncio.create_task(self._loop(state, totals), name=f"loop:{spec.run_id}")
        if state.cancel_reason is not None:
            state.inner.cancel()
        try:
            outcome = await state.inner
        except asyncio.CancelledError:
            if state.inner.cancelled():
                outcome = Outcome("cancelled", reason=state.cancel_reason or "cancelled")
            else:  # the outer task itself was cancelled (shutdown)
                state.inner.cancel()
                outcome = Outcome("cancelled", reason="shutdown")
        except LoopFailure as failure:
            outcome = Outcome("failed", message=str(failure))
        except ModelError as failure:
            failure.usage = clamp_usage(failure.usage)
            totals.count(failure.usage)
            await self._record_usage(spec, totals.llm_calls, failure.usage)
            totals.llm_calls += 1
            # built from the provider's name and the failure's kind, never its text
            provider = str(
                getattr(spec.model, "provider_id", "") or spec.llm.get("provider_id") or "model"
            )
            outcome = Outcome("failed", message=model_failure(provider, failure))
        except grpc.aio.AioRpcError as failure:
            log.warning("downstream call failed", extra={"fields": {"code": failure.code().name}})
            outcome = Outcome(
                "failed",
                message=f"A backing service failed ({failure.code().name.lower()}); the turn was stopped.",
            )
        except Exception:
            log.exception("loop crashed")
            outcome = Outcome("failed", message="Internal error while running the turn.")
        state.finishing = True
        try:
            await asyncio.shield(self._finish(state, totals, outcome))
        except asyncio.CancelledError:
            pass
        except (
            RunTakenOver
        ):  # nothing of this end was stored or published: the run's end is the other replica's
            log.warning(
                "the run was ended by another replica while this one was stalled or cut off (its lease lapsed); "
                "this process's end of it is dropped"
            )
            self.events.close(
                spec.run_id
            )  # fenced off in the log (backend._BATCH); frees the writer once drained
            forget = getattr(self.events, "forget", None)
            if forget is not None:
                forget(spec.run_id)
            outcome = Outcome("failed", message="taken over")
            state.ended.set()
        except Exception:
            log.exception("finishing the run failed")
            outcome = Outcome("failed", message="Internal error while finishing the turn.")
            try:
                await asyncio.shield(self._finish_minimal(spec, outcome))
            except Exception:
                log.exception("recording the failed run failed")
        finally:
            state.outcome = outcome.kind
            self.active.pop(spec.run_id, None)

    def _publish(self, run_id: str, **payload: Any) -> events_pb2.Event:
        return self.events.append(_event(run_id, **payload))

    def _stream_to_archive(
        self, run_id: str, ending: list[events_pb2.Event]
    ) -> list[tuple[int, bytes]]:
        """The archive rows of the run's stream with `ending` (its terminal events, not published
        yet, numbered here as the log will number them), for an event log that dies with this
        process (memory): stored with the run's end in one transaction before the end is
        published, so a crash right after a listener got `done` cannot leave an ended run with
        no stream (fresh-eyes test). Empty for a durable log (archived after the end)."""
        if self.events.durable:
            return []
        published = self.events.snapshot(run_id)
        for index, event in enumerate(ending, start=len(published)):
            event.seq = index
        return [(event.seq, event.SerializeToString()) for event in (*published, *ending)]

    def _end_stream(self, run_id: str, ending: list[events_pb2.Event]) -> None:
        """Publish the run's terminal events and close its stream (after its end is stored)."""
        for event in ending:
            self.events.append(event)
        self.events.close(run_id)

    async def tool_definitions(self) -> list[dict[str, Any]]:
        """The assistant profile's tools: the tools service's five plus the five HITL tools (cached 60 s).

        A tools service that does not answer ListTools within TOOL_LIST_TIMEOUT_S (stalled, down)
        does not fail the run: the definitions of the last answer are used, or the HITL tools
        alone when there was none yet, and it is asked again TOOL_LIST_RETRY_S later (so turns
        started meanwhile do not each wait for it). A tool call then gets the tools service's
        error result like any other (`_execute`). Fresh-eyes test: every turn failed, charged.
        """
        now = time.monotonic()
        if (
            self._tool_defs is None or now - self._tool_defs_at > 60
        ) and now >= self._tool_defs_retry_at:
            try:
                response = await self.tools.ListTools(
                    tools_pb2.ListToolsRequest(profile="assistant"), timeout=TOOL_LIST_TIMEOUT_S
                )
            except grpc.aio.AioRpcError as failure:
                self._tool_defs_retry_at = time.monotonic() + TOOL_LIST_RETRY_S
                log.warning(
                    "listing the tools failed; the run goes on with the tools known",
                    extra={
                        "fields": {
                            "code": failure.code().name,
                            "known": "last answer"
                            if self._tool_defs is not None
                            else "HITL tools only",
                        }
                    },
                )
                return (
                    self._tool_defs if self._tool_defs is not None else list(hitl.TOOL_DEFINITIONS)
                )
            remote = [
                {
                    "name": t.name,
                    "description": t.description,
                    "input_schema": pb.from_struct(t.input_schema),
                }
                for t in response.tools
                if t.name not in hitl.TOOL_KINDS
            ]
            self._tool_defs = remote + hitl.TOOL_DEFINITIONS
            self._tool_defs_at = time.monotonic()
        return self._tool_defs if self._tool_defs is not None else list(hitl.TOOL_DEFINITIONS)

    async def _loop(self, state: RunState, totals: _Totals) -> Outcome:
        spec = state.spec
        settings = self.settings
        self._publish(
            spec.run_id,
            metadata=events_pb2.MetadataEvent(
                run_id=spec.run_id,
                thread_id=spec.chat_id,
                workflow_type="composer",
                surface="assistant",
            ),
        )
        tools = await self.tool_definitions()
        totals.rows = (
            list(spec.history)
            if spec.history is not None
            else await self.store.load_thread(spec.chat_id)
        )
        steps = 0
        consecutive_failures = 0
        while True:
            steps += 1
            if steps > settings.recursion_limit:
                raise LoopFailure(
                    f"Recursion limit of {settings.recursion_limit} steps reached without a final answer."
                )
            messages = await self._thread(spec, totals, tools)
            reply = await self._reason(spec, totals, messages, tools)

            call = (
                reply.tool_calls[0] if reply.tool_calls else None
            )  # serial tool calls: one per step
            input_struct, input_json, invalid_input = None, b"", None
            if call is not None:
                call, input_struct, invalid_input = checked_call(call)
                input_json = pb.json_bytes(
                    call.input, clip=True
                )  # what the frames, done and the tool get: the model's JSON
            stored_calls = [{"id": call.id, "name": call.name, "input": call.input}] if call else []
            self._add_row(
                spec,
                totals,
                "assistant",
                reply.text,
                {"tool_calls": stored_calls} if stored_calls else None,
            )
            if call:
                totals.pending_call = stored_calls[0]
            if (
                settings.llm_call_guidance_every
                and totals.reason_calls % settings.llm_call_guidance_every == 0
                and call
            ):
                text = (
                    f"You have made {totals.reason_calls} model calls in this run. Converge: finish the task "
                    "with what you have, or give your best final answer now."
                )
                self._publish(
                    spec.run_id,
                    guidance=events_pb2.GuidanceEvent(
                        message=text, total_llm_calls=totals.reason_calls
                    ),
                )
                # given to the model after the pending tool result (the thread stays valid)
                totals.pending_guidance = text

            if call is None:
                return Outcome("completed", response=reply.text)

            steps += 1
            if steps > settings.recursion_limit:
                self._store_tool_result(
                    spec,
                    totals,
                    call.id,
                    call.name,
                    {"error": "not executed: recursion limit reached", "success": False},
                )
                totals.pending_call = None
                raise LoopFailure(
                    f"Recursion limit of {settings.recursion_limit} steps reached without a final answer."
                )

            self._publish(
                spec.run_id,
                tool_call=events_pb2.ToolCallEvent(
                    tool=call.name, input_json=input_json, tool_call_id=call.id
                ),
            )
            if (
                invalid_input is not None
            ):  # not run: its error result is observed like any failed call
                output, ok, output_json = _failure(invalid_input)
            elif call.name in hitl.TOOL_KINDS:
                interrupt, invalid = await self._ask(spec, totals, call)
                if interrupt is not None:
                    totals.pending_call = None
                    return Outcome("interrupted", interrupt=interrupt)
                # the question was malformed: its error result is in the thread and counts as a failed tool call
                totals.pending_call = None
                totals.tool_calls.append(
                    events_pb2.ToolCallRecord(
                        tool=call.name, input_json=input_json, output_json=pb.json_bytes(invalid)
                    )
                )
                continue
            else:
                output, ok, output_json = await self._execute(
                    spec, totals, call, input_struct, input_json
                )
            self._store_tool_result(spec, totals, call.id, call.name, output)
            totals.pending_call = None
            totals.tool_calls.append(
                events_pb2.ToolCallRecord(
                    tool=call.name, input_json=input_json, output_json=output_json
                )
            )
            self._publish(
                spec.run_id,
                tool_result=events_pb2.ToolResultEvent(
                    tool=call.name, tool_call_id=call.id, output_json=output_json
                ),
            )
            consecutive_failures = 0 if ok else consecutive_failures + 1
            guidance: list[str] = []
            if totals.pending_guidance:
                guidance.append(totals.pending_guidance)
                totals.pending_guidance = None
            if not ok and consecutive_failures == settings.failure_guidance_threshold:
                text = (
                    f"{consecutive_failures} tool calls in a row have failed. Stop repeating the same call: "
                    "check the inputs, try another approach, ask the user, or explain what went wrong."
                )
                self._publish(
                    spec.run_id,
                    guidance=events_pb2.GuidanceEvent(
                        message=text, consecutive_failures=consecutive_failures
                    ),
                )
                guidance.append(text)
            for text in guidance:
                self._add_row(spec, totals, "system", text, {"guidance": True})

    async def _reason(
        self,
        spec: RunSpec,
        totals: _Totals,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
    ) -> ModelReply:
        """One reason step: the model call on `messages`, each text delta published as a
        `response_chunk` and kept in `totals.streamed` as published (the answer `_finish` keeps when
        a cancel or failure cuts the call off); the call's usage is counted and queued for billing."""

        async def on_text(chunk: str) -> None:
            if chunk:
                shown = pb.scrub(chunk)
                self._publish(
                    spec.run_id, response_chunk=events_pb2.ResponseChunkEvent(chunk=shown)
                )
                totals.streamed.append(shown)

        totals.streamed = []
        totals.model_in_flight = True
        reply: ModelReply = _scrubbed(await spec.model.generate(messages, tools, on_text))
        totals.model_in_flight = False
        reply.usage = clamp_usage(reply.usage)
        call_index = totals.llm_calls
        totals.llm_calls += 1
        totals.reason_calls += 1
        totals.count(reply.usage)
        self._record_usage_later(spec, totals, call_index, reply.usage)
        return reply

    async def _thread(
        self, spec: RunSpec, totals: _Totals, tools: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """The thread for the next model call, summarizing its older part first when it is over budget
        (a model call given the run's `tools`, which it may not call).

        The thread is loaded once per run (`totals.rows`) and grows in memory; summarizing
        stores the run's messages so far and the summary, then reloads it.
        """
        summary, rows = split_summary(totals.rows)
        messages = with_summary(summary, rows)
        budget = self.settings.summarization_budget_tokens
        if not budget or totals.unsummarizable or estimate(messages) <= budget:
            return messages
        if totals.unsaved:  # the cut needs stored sequence numbers
            await self.store.store_rows(totals.unsaved)
            totals.unsaved.clear()
            totals.rows = await self.store.load_thread(spec.chat_id)
            summary, rows = split_summary(totals.rows)
        cut = choose_cut(rows, self.settings.summarization_keep_tokens)
        if cut is None:
            return messages
        older = with_summary(summary, rows[:cut])
        prompt = {"role": "user", "purpose": "summarize", "content": SUMMARY_INSTRUCTION}

        async def ignore(_: str) -> None:
            return None

        # The run's tools go with it (the thread holds their calls; the cached prefix stays the
        # same), but the model may not call one; a call it makes anyway is left out.
        reply = _scrubbed(
            await spec.model.generate([*older, prompt], tools, ignore, call_tools=False)
        )
        reply.tool_calls = []
        reply.usage = clamp_usage(reply.usage)
        call_index = totals.llm_calls
        totals.llm_calls += 1
        totals.count(reply.usage)
        self._record_usage_later(spec, totals, call_index, reply.usage)
        if (
            not reply.text.strip()
        ):  # no summary (e.g. a model that answered with a tool call anyway): the older
            totals.unsummarizable = (
                True  # part is kept, and the run does not ask again at every step
            )
            log.warning("the summary call returned no text; the thread is kept whole for this run")
            return messages
        await self.store.store_rows(
            [
                ThreadRow(
                    role="summary",
                    content=reply.text,
                    extra={"covers_until_seq": rows[cut - 1].seq},
                    chat_id=spec.chat_id,
                    run_id=spec.run_id,
                )
            ]
        )
        log.info("thread summarized", extra={"fields": {"covered_messages": cut}})
        totals.rows = await self.store.load_thread(spec.chat_id)
        return with_summary(*split_summary(totals.rows))

    @staticmethod
    def _add_row(
        spec: RunSpec, totals: _Totals, role: str, content: Any, extra: dict[str, Any] | None
    ) -> None:
        """Append a message to the run's thread (stored when the run ends, see store.py)."""
        row = ThreadRow(
            role=role, content=content, extra=extra, chat_id=spec.chat_id, run_id=spec.run_id
        )
        totals.rows.append(row)
        totals.unsaved.append(row)

    def _store_tool_result(
        self, spec: RunSpec, totals: _Totals, call_id: str, name: str, output: Any
    ) -> None:
        self._add_row(spec, totals, "tool", output, {"tool_call_id": call_id, "name": name})

    async def _execute(
        self, spec: RunSpec, totals: _Totals, call: Any, input_struct: Any, input_json: bytes
    ) -> tuple[Any, bool, bytes]:
        """Run one non-HITL tool through the tools service.

        Returns (output as JSON, succeeded, output as JSON text): the tools service's JSON text
        (`output_json`; an older server's `output` Value converted once) is passed on to the
        events as it came, parsed once for the thread and the model. A response that cannot be
        decoded (grpc.aio then logs "Exception deserializing message!" and gives None), or an
        output that is not JSON, is the call's error result like any failed call, never a crashed run; its cost is unknown,
        so nothing is charged for it. A call the tools service fails (grpc.aio.AioRpcError: it did
        not answer within `tool_timeout_s`, is down, or failed inside) is the call's error result
        too (`tools_failure`), so the model can answer without it; the run goes on.
        """
        request = tools_pb2.ExecuteToolRequest(  # input_json: the model's numbers exact (a Struct holds doubles)
            organization_id=spec.organization_id,
            tool=call.name,
            input=input_struct,
            input_json=input_json,
            run_id=spec.run_id,
            tool_call_id=call.id,
            chat_id=spec.chat_id,
        )
        try:
            response = await self.tools.ExecuteTool(request, timeout=self.settings.tool_timeout_s)
        except grpc.aio.AioRpcError as failure:
            code = failure.code()
            log.warning(
                "the tools service failed a tool call",
                extra={"fields": {"tool": call.name, "tool_call_id": call.id, "code": code.name}},
            )
            return _failure(tools_failure(failure))
        if not isinstance(response, tools_pb2.ExecuteToolResponse):
            log.warning(
                "tool response could not be decoded",
                extra={"fields": {"tool": call.name, "tool_call_id": call.id}},
            )
            return _failure(UNREADABLE_RESULT)
        if (
            response.millicredits > 0
        ):  # charged beside the run, which waits for it at its end (`_finish`)
            totals.pending_writes.append(
                asyncio.ensure_future(self._record_tool_usage(spec, call, response.millicredits))
            )
        if response.success:
            raw = pb.output_json(
                response
            )  # the tools service's JSON text, passed on to the events as it came
            try:
                return orjson.loads(raw), True, raw
            except orjson.JSONDecodeError:
                log.warning(
                    "tool output is not JSON",
                    extra={"fields": {"tool": call.name, "tool_call_id": call.id}},
                )
                return _failure(UNREADABLE_RESULT)
        return _failure(response.error or "the tool failed")

    async def _ask(
        self, spec: RunSpec, totals: _Totals, call: Any
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """Prepare a HITL question for `call` (its audit row is written with the run's end);
        returns (question, None), or (None, error output) when the question is malformed (the
        error result joins the thread and is published)."""
        request_id = str(uuid.uuid4())
        try:
            integration = None
            if call.name == "request_credential":
                problems = hitl.input_problems(
                    call.name, call.input
                )  # before looking the integration up
                if problems:
                    raise ValueError(problems)
                integration = await self._integration_info(spec, call.input["integration"])
            request = hitl.build_request(call.name, call.input, request_id, integration)
        except ValueError as invalid:
            output = {"error": f"invalid question: {invalid}", "success": False}
            self._store_tool_result(spec, totals, call.id, call.name, output)
            self._publish(
                spec.run_id,
                tool_result=events_pb2.ToolResultEvent(
                    tool=call.name, tool_call_id=call.id, output_json=pb.json_bytes(output)
                ),
            )
            return None, output
        now = utcnow()
        totals.interrupt = {
            "id": request_id,
            "chat_id": spec.chat_id,
            "run_id": spec.run_id,
            "tool_call_id": call.id,
            "tool": call.name,
            "kind": request["kind"],
            "request": request,
            "outcome": "pending",
            "created_at": now,
            "expires_at": now + datetime.timedelta(seconds=self.settings.pending_ttl_s),
        }
        return request, None

    async def _integration_info(self, spec: RunSpec, name: str) -> dict[str, Any] | None:
        """What a credential question for integration `name` offers: {display_name, auth_options}
        from the tools service's `get_integration_details`, or None when the tools service cannot
        be asked (the question then offers an API key). Raises ValueError when the answer is that
        no credential can be connected for it: the integration is unknown (the tools service's
        error, with its list of integrations) or takes no credential (`loopline`, an operator's
        MCP server), so the question could only be skipped (fresh-eyes re-test)."""
        if not name.strip():
            return None
        try:
            response = await self.tools.ExecuteTool(
                tools_pb2.ExecuteToolRequest(
                    organization_id=spec.organization_id,
                    tool="get_integration_details",
                    input=pb.to_struct({"integration": name}),
                    run_id=spec.run_id,
                    chat_id=spec.chat_id,
                ),
                timeout=10,
            )
        except grpc.aio.AioRpcError:
            return None
        if not isinstance(
            response, tools_pb2.ExecuteToolResponse
        ):  # undecodable (grpc.aio gives None)
            return None
        if not response.success:
            raise ValueError(response.error or f"the integration {name!r} cannot be looked up")
        try:
            details = pb.output_of(response)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(details, dict):
            return None
        options = []
        for option in details.get("auth_options") or []:
            if not isinstance(option, dict):
                continue
            raw = option.get("type") or option.get("auth_type") or ""
            if raw in ("none", ""):
                continue  # nothing to connect
            # the SDK's CredentialAuthOption literals: oauth2, api_key, bearer_token, modulex_key, custom
            auth_type = {"bearer": "bearer_token"}.get(raw, raw)
            if auth_type not in ("oauth2", "api_key", "bearer_token", "modulex_key", "custom"):
                auth_type = "custom"
            entry: dict[str, Any] = {
                "auth_type": auth_type,
                "display_name": option.get("label") or option.get("display_name") or auth_type,
            }
            if isinstance(option.get("fields"), dict):
                entry["fields"] = [
                    {"name": k, **(v if isinstance(v, dict) else {})}
                    for k, v in (option["fields"].get("properties") or {}).items()
                ]
            if auth_type == "oauth2":
                entry["oauth_initiate_endpoint"] = "/credentials/oauth2/initiate"
            options.append(entry)
        if not options:
            raise ValueError(
                f"the integration {name!r} takes no credential: use it with execute_integration_tool as it is"
            )
        return {"display_name": details.get("display_name") or name, "auth_options": options}

    def _record_usage_later(
        self, spec: RunSpec, totals: _Totals, call_index: int, usage: TokenUsage
    ) -> None:
        """Queue a model call's usage for billing (usage.py batches it) without holding up the loop;
        `_finish` stores what still waits in the transaction of the run's end (`UsageBatcher.take`)
        and waits for what is on its way, so every record is with billing or stored before the
        run's terminal event."""
        totals.pending_writes.append(self.usage.add(self._usage_request(spec, call_index, usage)))

    async def _record_tool_usage(self, spec: RunSpec, call: Any, millicredits: int) -> None:
        """Charge a tool call's catalogue cost with billing (idempotent by run and tool call; bounded retries)."""
        detail = ""
        if call.name == "execute_integration_tool":
            detail = f"{call.input.get('integration', '')}.{call.input.get('action', '')}"
        request = billing_pb2.RecordToolUsageRequest(
            organization_id=spec.organization_id,
            run_id=spec.run_id,
            tool_call_id=call.id,
            tool=call.name,
            detail=detail[:200],
            millicredits=millicredits,
            chat_id=spec.chat_id,
        )
        await self._send_to_billing(
            "RecordToolUsage", request, "recording tool usage failed", tool_call_id=call.id
        )

    async def _record_usage(self, spec: RunSpec, call_index: int, usage: TokenUsage) -> None:
        """Record one model call's tokens with billing now and wait for it (idempotent by run and
        call index; bounded retries, a last failure logged)."""
        done = self.usage.add(self._usage_request(spec, call_index, usage))
        self.usage.flush()
        await asyncio.shield(done)

    @staticmethod
    def _usage_request(
        spec: RunSpec, call_index: int, usage: TokenUsage
    ) -> billing_pb2.RecordUsageRequest:
        return billing_pb2.RecordUsageRequest(
            organization_id=spec.organization_id,
            run_id=spec.run_id,
            call_index=call_index,
            provider_id=spec.llm.get("provider_id", ""),
            model_id=spec.llm.get("model_id", ""),
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            cache_read_tokens=usage.cache_read_tokens,
            cache_write_tokens=usage.cache_write_tokens,
            byok=bool(spec.llm.get("credential_id")),
            estimated=usage.estimated,
            chat_id=spec.chat_id,
        )

    async def _send_to_billing(
        self, method: str, request: Any, failure_message: str, **log_fields: Any
    ) -> None:
        """Call the idempotent billing RPC `method` (`Redelivery.send_or_store`: quick retries, then
        WARNING with `log_fields` and stored, sent again in the background across restarts; ERROR
        `failure_message` only if it is finally given up), never raised. Run as a task of its
        own (see `_execute`), so a cancel of the run does not cut it off."""
        rpc = getattr(self.billing, method)
        await self.redelivery.send_or_store(
            method,
            request,
            lambda timeout: rpc(request, timeout=timeout),
            failure_message,
            [log_fields],
        )

    # ------------------------------------------------------------------ ending

    async def _finish(self, state: RunState, totals: _Totals, outcome: Outcome) -> None:
        spec = state.spec
        # the run's usage records still waiting are stored with its end (usage.py `take`): the
        # terminal event does not wait for billing; the rest (sent, tool charges) are awaited
        handed = self.usage.take(spec.run_id)
        if totals.pending_writes:
            if handed is None:
                self.usage.flush()
            await asyncio.gather(*totals.pending_writes, return_exceptions=True)
        if outcome.kind == "cancelled" and totals.model_in_flight:
            # tokens of a model call cut off by the cancel are billed like any other (spec: token
            # usage is recorded "regardless of whether the turn succeeds, errors, or is cancelled")
            partial = getattr(spec.model, "partial_usage", None)
            partial = clamp_usage(partial) if isinstance(partial, TokenUsage) else None
            if partial is not None and (
                partial.input_tokens
                or partial.output_tokens
                or partial.cache_read_tokens
                or partial.cache_write_tokens
            ):
                totals.count(partial)
                await self._record_usage(spec, totals.llm_calls, partial)
                totals.llm_calls += 1
        input_tokens = totals.input_tokens()
        usage = events_pb2.Usage(
            input_tokens=input_tokens,
            output_tokens=totals.usage.output_tokens,
            total_tokens=input_tokens + totals.usage.output_tokens,
            llm_calls=totals.llm_calls,
        )
        self._keep_cut_off(spec, totals, outcome)
        if outcome.kind == "interrupted":
            interrupt = outcome.interrupt or {}
            self._add_row(
                spec,
                totals,
                "marker",
                None,
                {
                    "type": "interrupted",
                    "request_id": interrupt.get("request_id"),
                    "kind": interrupt.get("kind"),
                },
            )
        run_id = spec.run_id
        if outcome.kind == "completed":
            ending = [
                _event(
                    run_id,
                    done=events_pb2.DoneEvent(
                        response=outcome.response, tool_calls=totals.tool_calls, usage=usage
                    ),
                )
            ]
        elif outcome.kind == "failed":
            ending = [
                _event(run_id, error=events_pb2.ErrorEvent(message=outcome.message)),
                _event(
                    run_id,
                    done=events_pb2.DoneEvent(
                        response="", tool_calls=totals.tool_calls, usage=usage, error=True
                    ),
                ),
            ]
        elif outcome.kind == "cancelled":
            ending = [_event(run_id, cancelled=events_pb2.CancelledEvent(reason=outcome.reason))]
        else:
            interrupt = outcome.interrupt or {}
            # clip: the question holds parts of the model's input (e.g. a placeholder) and tool output
            ending = [
                _event(
                    run_id,
                    user_input_request=events_pb2.UserInputRequestEvent(
                        request_json=pb.json_bytes(interrupt, clip=True)
                    ),
                ),
                _event(
                    run_id,
                    interrupted=events_pb2.InterruptedEvent(
                        request_id=interrupt["request_id"], kind=interrupt["kind"]
                    ),
                ),
            ]
        archived = self._stream_to_archive(run_id, ending)
        try:
            await self._store_end(
                RunEnd(
                    run_id=spec.run_id,
                    chat_id=spec.chat_id,
                    status=outcome.kind,
                    error=outcome.message or None,
                    usage={
                        "input_tokens": usage.input_tokens,
                        "output_tokens": usage.output_tokens,
                        "total_tokens": usage.total_tokens,
                        "llm_calls": usage.llm_calls,
                    },
                    rows=totals.unsaved,
                    interrupt=totals.interrupt if outcome.kind == "interrupted" else None,
                    events=archived,
                    billing_calls=[handed[1]] if handed else [],
                )
            )
        except BaseException:
            if (
                handed
            ):  # not stored: sent as before the end (never lost with the failed transaction)
                self.usage.give_back(handed[0])
            raise
        if handed:
            self.usage.stored(handed[1]["id"], handed[0])
        totals.unsaved = []
        self._end_stream(run_id, ending)
        state.outcome = (
            outcome.kind
        )  # final from here on: nothing below may change it (one terminal outcome)
        state.ended.set()
        if not archived:
            await self.archive_after_end(run_id)
        log.info(
            "run ended", extra={"fields": {"outcome": outcome.kind, "llm_calls": totals.llm_calls}}
        )

    def _keep_cut_off(self, spec: RunSpec, totals: _Totals, outcome: Outcome) -> None:
        """What a cancel or failure cut off still joins the run's thread, in order: a pending tool
        call gets its error result (`cut_off_result`; streamed as its `tool_result` and listed in
        done), and the text a cut-off model call streamed (`totals.streamed`, as listeners saw it)
        becomes the run's assistant message, marked `extra.cut_off` = "cancelled" or "failed"
        (a message's `thinking` in GetChat); none when that call streamed only whitespace."""
        if (
            totals.pending_call is not None
        ):  # a tool call cut off by a cancel or failure still gets a result
            pending = totals.pending_call
            self._store_tool_result(
                spec, totals, pending["id"], pending["name"], cut_off_result(outcome.kind)
            )
            if outcome.kind in (
                "failed",
                "cancelled",
            ):  # its tool_call was streamed: its end is too (and done lists it)
                output = pb.json_bytes(cut_off_result(outcome.kind))
                totals.tool_calls.append(
                    events_pb2.ToolCallRecord(
                        tool=pending["name"],
                        input_json=pb.json_bytes(pending["input"], clip=True),
                        output_json=output,
                    )
                )
                self._publish(
                    spec.run_id,
                    tool_result=events_pb2.ToolResultEvent(
                        tool=pending["name"], tool_call_id=pending["id"], output_json=output
                    ),
                )
        partial = "".join(totals.streamed)
        if outcome.kind in ("failed", "cancelled") and totals.model_in_flight and partial.strip():
            self._add_row(spec, totals, "assistant", partial, {"cut_off": outcome.kind})

    async def _store_end(self, end: RunEnd) -> None:
        """`store.finish(end)`, tried again while the database is unavailable (`db.is_unavailable`:
        refused or dropped connections), waiting FINISH_RETRY_FIRST_S doubling up to
        FINISH_RETRY_MAX_S, until it answers. Fresh-eyes chaos test: a 2 s drop of the database's
        connections failed every run that ended during it (the streamed answer lost from the
        thread, `error` + `done` ~25 s later from the crash reaper). While it waits the run stays
        active here (its lease is renewed once the database answers; should another replica have
        ended it meanwhile, the end is RunTakenOver). Any other error is raised at once."""
        delay = FINISH_RETRY_FIRST_S
        reported = False
        while True:
            try:
                await self.store.finish(end)
            except Exception as error:
                if not db.is_unavailable(error):
                    raise
                if not reported:
                    reported = True
                    log.warning(
                        "storing the run's end failed: the database is unavailable; trying again until it answers",
                        extra={"fields": {"error": type(error).__name__}},
                    )
                await asyncio.sleep(delay)
                delay = min(delay * 2, FINISH_RETRY_MAX_S)
            else:
                if reported:
                    log.info("the run's end was stored once the database answered")
                return

    async def _finish_minimal(self, spec: RunSpec, outcome: Outcome) -> None:
        """The last resort when `_finish` itself failed: mark the run failed, free the chat, and end
        its stream with `error` then `done` (error: true, zero usage) so that nothing stays stuck."""
        run_id = spec.run_id
        ending = [
            _event(run_id, error=events_pb2.ErrorEvent(message=outcome.message)),
            _event(
                run_id, done=events_pb2.DoneEvent(response="", usage=events_pb2.Usage(), error=True)
            ),
        ]
        self.events.reopen(run_id)
        archived = self._stream_to_archive(run_id, ending)
        async with self.sessions() as session, session.begin():
            mine = await session.execute(
                update(Run)
                .where(Run.id == run_id, Run.status == "running")
                .values(
                    status="failed",
                    error=outcome.message,
                    updated_at=utcnow(),
                    archive_due=None if archived else utcnow(),
                )
            )
            if (
                mine.rowcount != 1
            ):  # ended meanwhile (stored by `_finish` after all, or by another replica): its end stands
                log.warning("the run was ended before its last-resort end; that end stands")
                return
            await session.execute(
                update(Chat)
                .where(Chat.id == spec.chat_id, Chat.running_id == run_id)
                .values(running_id=None, updated_at=utcnow())
            )
            if archived:
                await session.execute(
                    db.insert_ignoring(
                        self.store.txn.dialect, RunEvent.__table__, ("run_id", "seq")
                    ),
                    [
                        {"run_id": run_id, "seq": seq, "payload": payload}
                        for seq, payload in archived
                    ],
                )
        self._end_stream(run_id, ending)
        if not archived:
            await self.archive_after_end(run_id)

    async def archive_after_end(self, run_id: str) -> None:
        """Archive an ended run's events (a durable log: after its end is stored and published).

        The end is final by then, so a failed archive (the database unreachable for a moment)
        must not touch the run's outcome: it is logged and tried again in the background
        (`_archive_until_written`) while the log still holds the events. Found reading the
        finish: a failure here made the run `failed` over its real outcome and published
        `error` + `done` after its `done`. While a retry of the run's archive is pending, it
        writes this archive's events too (it reads the log when it tries).
        """
        if run_id in self._archiving:
            return
        try:
            await self.archive(run_id)
        except Exception as error:  # noqa: BLE001 - any failure: the events are still in the log
            log.warning(
                "archiving the run's events failed; trying again",
                extra={"fields": {"error": type(error).__name__}},
            )
            task = asyncio.create_task(
                self._archive_until_written(run_id), name=f"archive:{run_id}"
            )
            self._archiving[run_id] = task
            task.add_done_callback(lambda _task: self._archiving.pop(run_id, None))

    async def _archive_until_written(self, run_id: str) -> None:
        """Try the archive of an ended run again, waiting ARCHIVE_RETRY_FIRST_S doubling up to
        ARCHIVE_RETRY_MAX_S between tries, until it is written or the log's copy has expired
        (LOOPLINE_RUN_EVENTS_TTL_S after the end). A run deleted meanwhile (its rows are gone:
        the insert breaks the foreign key) needs no archive."""
        loopline_logging.bind_task(run_id=run_id)
        delay = ARCHIVE_RETRY_FIRST_S
        give_up_at = time.monotonic() + float(self.settings.run_events_ttl_s)
        while True:
            await asyncio.sleep(delay)
            try:
                await self.archive(run_id)
            except sa_exc.IntegrityError:
                log.info("the run was deleted before its events were archived")
                return
            except Exception as error:  # noqa: BLE001 - logged, tried again
                if time.monotonic() + delay >= give_up_at:
                    log.error(
                        "archiving the run's events failed until its log expired; the events are lost",
                        extra={"fields": {"error": type(error).__name__}},
                    )
                    return
                delay = min(delay * 2, ARCHIVE_RETRY_MAX_S)
            else:
                log.info("the run's events were archived after a failed try")
                return

    def archiving_runs(self) -> int:
        """Ended runs whose archive failed and is being tried again (for tests and metrics)."""
        return len(self._archiving)

    def unsettled_runs(self) -> list[str]:
        """The runs this process still has to end or archive: active, archive being tried again,
        or events the log has not stored yet (their leases are renewed: `RunSupervisor.renew`)."""
        return [*self.active, *self._archiving, *self.events.unstored_runs()]

    async def _stop_archiving(self) -> None:
        """At shutdown: each archive still being tried again gets one last try (ARCHIVE_AT_STOP_S),
        then is left; its events stay in the durable log until they expire."""
        for run_id, task in list(self._archiving.items()):
            task.cancel()
            try:
                await asyncio.wait_for(self.archive(run_id), ARCHIVE_AT_STOP_S)
            except Exception as error:  # noqa: BLE001 - logged; nothing else can be done at shutdown
                log.error(
                    "a run's events could not be archived before shutdown; they stay in the event log until it expires",
                    extra={"fields": {"run_id": run_id, "error": type(error).__name__}},
                )

    async def archive(self, run_id: str) -> None:
        """Write the run's events to `run_events` (one transaction; existing rows kept).

        The events are this process's own copy of a run it published (`EventLog.owned_events`:
        what it published, also while Redis is away, which the archive must not wait for or
        depend on: a fresh-eyes test lost a run's end that way), else the event log's once
        everything published is stored (the Redis stream, or memory), so the database holds the
        durable copy of every ended run. Two replicas archiving the same run at once both
        succeed (INSERT ... ON CONFLICT DO NOTHING).

        The run's `archive_due` is cleared with it when the log holds the run's end (what the
        owner published is stored there, waited for up to ARCHIVE_FLUSH_S; or, read from the
        log, it has a terminal event); otherwise the run stays due: this process renews its
        lease while its events wait for Redis, and `RunSupervisor.settle_ended` settles it
        once they are stored, or once the process is gone.
        """
        events = self.events.owned_events(run_id)
        owned = events is not None
        if events is None:
            await self.events.flush(run_id)
            events = await self.events.events_of(run_id)
            settled = any(is_terminal(event) for event in events)
        else:
            await self.events.flush(run_id, ARCHIVE_FLUSH_S)
            owned_now = self.events.owned_events(run_id)
            owned, events = owned_now is not None, owned_now or events
            settled = run_id not in self.events.unstored_runs()
        await self.store.archive(
            run_id, [(event.seq, event.SerializeToString()) for event in events], settled=settled
        )
        forget = getattr(self.events, "forget", None)
        if forget is not None:
            forget(run_id, archived=owned)

    async def load_archive(self, run_id: str) -> list[events_pb2.Event]:
        """The archived events of a run, in order (empty when none)."""
        return await load_archive(self.sessions, run_id)


def _event(run_id: str, **payload: Any) -> events_pb2.Event:
    """A run event of `payload` (one member of the Event oneof) stamped with the current time."""
    ns = time.time_ns()
    return events_pb2.Event(
        run_id=run_id,
        time=timestamp_pb2.Timestamp(seconds=ns // 1_000_000_000, nanos=ns % 1_000_000_000),
        **payload,
    )


async def load_archive(sessions: Any, run_id: str) -> list[events_pb2.Event]:
    """The events of a run archived in the `run_events` table, in order (empty when none)."""
    async with sessions() as session:
        rows = (
            await session.execute(
                select(RunEvent.payload).where(RunEvent.run_id == run_id).order_by(RunEvent.seq)
            )
        ).scalars()
        return [events_pb2.Event.FromString(payload) for payload in rows]
