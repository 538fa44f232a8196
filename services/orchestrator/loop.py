"""The agent loop of a turn: reason -> act -> observe, repeated until the model answers.

- reason (`_reason`): the model is called on the chat's thread (summarized when over budget),
  its text streamed as `response_chunk`; its reply joins the thread (`_take_reply`).
- act (tool_calls.py): the reply's first tool call is published (`tool_call`) and run by the
  tools service (`_act`), or, for a HITL tool, pauses the run on its question (`_ask`).
- observe (`_observe`): the result joins the thread and is published (`tool_result`), with
  guidance when the model should converge or change course.

Guards: at most `recursion_limit` steps; a cancel ends the loop's task at any await. One
`TurnRunner` per process runs every loop as an asyncio task; the run ends in exactly one
outcome (run_end.py), stored before its terminal event is published.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from typing import Any

import grpc

from loopline.assistant.v1 import events_pb2
from loopline.billing.v1 import billing_pb2, billing_pb2_grpc
from loopline.tools.v1 import tools_pb2_grpc
from services.common import logging as loopline_logging
from services.common import pb, tracing
from services.orchestrator import hitl
from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.eventlog import EventLog
from services.orchestrator.providers.base import ModelError, ModelReply, clamp_usage
from services.orchestrator.run_end import RunEnding
from services.orchestrator.run_state import (
    LoopFailure,
    Outcome,
    RunSpec,
    RunState,
    RunTotals,
    model_catalogue,
    new_event,
)
from services.orchestrator.sanitize import UNPRINTABLE, model_failure
from services.orchestrator.store import RunTakenOver, ThreadRow, TurnStore
from services.orchestrator.thread import choose_cut, estimate, split_summary, with_summary
from services.orchestrator.tool_calls import ToolActing, ToolStep, checked_call
from services.orchestrator.usage.batches import RunCharges, UsageBatcher
from services.orchestrator.usage.redelivery import CALL_TIMEOUT_S, Redelivery

log = logging.getLogger(__name__)

SUMMARY_INSTRUCTION = (
    "Summarize the conversation above for your own later use: the user's goals, the facts and "
    "tool results that still matter, decisions made and open questions. Be concise; do not "
    "address the user."
)


def _limit_reached(limit: int) -> str:
    return f"Recursion limit of {limit} steps reached without a final answer."


def _scrubbed(reply: ModelReply) -> ModelReply:
    """`reply` with every lone UTF-16 surrogate in its text and tool calls as U+FFFD (`pb.scrub`):
    a model's JSON may escape one (`"\\ud800"`), and protobuf, orjson and the databases take no
    such string. A tool call's id also loses its control characters (`_call_id`)."""
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
    where PostgreSQL refuses a NUL; the thread, the events and the next model call all carry
    the kept id, so the model's calls and their results still pair up."""
    kept = UNPRINTABLE.sub("", given)
    return kept or f"call_{uuid.uuid4().hex[:24]}"


class TurnRunner(ToolActing, RunEnding):
    """Runs agent loops as background tasks and publishes their events.

    The steps live in mixins, each in its module: the act step (tool_calls.py), the billing
    records (run_billing.py), the run's end (run_end.py) and its archive (archive.py).

    Args:
        settings: orchestrator settings (limits, timeouts).
        sessions: async session factory of the orchestrator database (the rare paths).
        store: the hot-path transactions (store.py): thread loads, run ends, archives.
        events: the run event log (memory, or Redis Streams; see eventlog/).
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
        # billing calls that failed their quick retries (usage/redelivery.py)
        self.redelivery = Redelivery(sessions)
        self.redelivery.register(
            "RecordToolUsage",
            lambda data: billing.RecordToolUsage(
                billing_pb2.RecordToolUsageRequest.FromString(data), timeout=CALL_TIMEOUT_S
            ),
        )
        # a reservation a turn start could not release (servicer/turn_start.py `_release`)
        self.redelivery.register(
            "Release",
            lambda data: billing.Release(
                billing_pb2.ReleaseRequest.FromString(data), timeout=CALL_TIMEOUT_S
            ),
        )
        self.usage = UsageBatcher(billing, self.redelivery, forget=store.forget_redeliveries)
        # each turn's run charge
        self.charges = RunCharges(billing, self.redelivery, forget=store.forget_redeliveries)
        self.events = events
        self.billing = billing
        self.tools = tools
        self.active: dict[str, RunState] = {}
        # ended runs whose archive failed: tried again (`archive_after_end`)
        self._archiving: dict[str, asyncio.Task[None]] = {}
        self._tool_defs: list[dict[str, Any]] | None = None
        self._tool_defs_at = 0.0
        self._tool_defs_retry_at = 0.0
        self.models = model_catalogue(settings)  # the metrics' model labels

    def start(self, spec: RunSpec) -> RunState:
        """Register and start the run's loop task; returns its state (Cancel can use it at once)."""
        state = RunState(spec=spec)
        self.active[spec.run_id] = state
        self.events.open(spec.run_id)
        # in the `invoke_agent` span of the turn, when tracing is on
        state.task = asyncio.create_task(
            tracing.agent_run(state, self._run(state)), name=f"run:{spec.run_id}"
        )
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

    async def _run(self, state: RunState) -> None:
        """The run's task: the loop as a task of its own (a cancel cancels it alone), its
        failure turned into the run's outcome, then `_finish` shielded from cancellation."""
        spec = state.spec
        loopline_logging.bind_task(
            run_id=spec.run_id, chat_id=spec.chat_id, org_id=spec.organization_id
        )
        totals = RunTotals(meter=self.models.turn(spec.model))
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
            code = failure.code().name.lower()
            outcome = Outcome(
                "failed", message=f"A backing service failed ({code}); the turn was stopped."
            )
        except Exception:
            log.exception("loop crashed")
            outcome = Outcome("failed", message="Internal error while running the turn.")
        state.finishing = True
        try:
            await asyncio.shield(self._finish(state, totals, outcome))
        except asyncio.CancelledError:
            pass
        except RunTakenOver:
            # nothing of this end was stored or published: the run's end is the other replica's
            log.warning(
                "the run was ended by another replica while this one was stalled or cut off "
                "(its lease lapsed); this process's end of it is dropped"
            )
            # fenced off in the log; frees its writer once drained
            self.events.close(spec.run_id)
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
            totals.meter.ended(outcome.kind)

    def _publish(self, run_id: str, **payload: Any) -> events_pb2.Event:
        return self.events.append(new_event(run_id, **payload))

    async def _loop(self, state: RunState, totals: RunTotals) -> Outcome:
        """Reason -> act -> observe until the model answers without a tool call.

        Each model call and each tool call is a step; past `recursion_limit` steps the run
        fails (a call chosen past it is not run, its result says why). A HITL tool pauses the
        run on its question; a cancel or failure ends it from `_run`.
        """
        spec = state.spec
        limit = self.settings.recursion_limit
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
        while True:
            steps += 1
            if steps > limit:
                raise LoopFailure(_limit_reached(limit))
            reply = await self._reason(spec, totals, tools)
            act = self._take_reply(spec, totals, reply)
            if act is None:  # an answer without a tool call ends the turn
                return Outcome("completed", response=reply.text)
            steps += 1
            if steps > limit:
                not_run = {"error": "not executed: recursion limit reached", "success": False}
                totals.add_tool_result(spec, act.call.id, act.call.name, not_run)
                totals.pending_call = None
                raise LoopFailure(_limit_reached(limit))
            totals.meter.first_frame()
            self._publish_call(spec, act)
            if act.asks_user:
                with tracing.tool_call(act) as traced:
                    question = await self._ask(spec, totals, act)
                    traced.done(question is not None)
                totals.meter.question(act.call.name, tools, question is not None)
                if question is not None:
                    return Outcome("interrupted", interrupt=question)
                continue  # a malformed question: its error result is observed already
            with tracing.tool_call(act) as traced:
                result = await totals.meter.tool_call(
                    act.call.name, tools, self._act(spec, totals, act), run=act.invalid is None
                )
                traced.done(result[1])
            self._observe(spec, totals, act, result)

    async def _reason(
        self, spec: RunSpec, totals: RunTotals, tools: list[dict[str, Any]]
    ) -> ModelReply:
        """The reason step: the model call on the thread (`_thread`: summarized first when over
        budget), each text delta published as a `response_chunk` and kept in `totals.streamed`
        as published (the answer `_finish` keeps when a cancel or failure cuts the call off);
        the call's usage is counted and queued for billing."""
        messages = await self._thread(spec, totals, tools)

        async def on_text(chunk: str) -> None:
            if chunk:
                if not totals.streamed:  # the call's first chunk
                    totals.meter.first_frame()
                shown = pb.scrub(chunk)
                self._publish(
                    spec.run_id, response_chunk=events_pb2.ResponseChunkEvent(chunk=shown)
                )
                totals.streamed.append(shown)

        totals.streamed = []
        totals.model_in_flight = True
        with tracing.model_call(spec.model) as traced:
            reply: ModelReply = _scrubbed(
                await totals.meter.model_call(spec.model.generate(messages, tools, on_text))
            )
            traced.reply(reply)
        totals.model_in_flight = False
        reply.usage = clamp_usage(reply.usage)
        call_index = totals.llm_calls
        totals.llm_calls += 1
        totals.reason_calls += 1
        totals.count(reply.usage)
        self._record_usage_later(spec, totals, call_index, reply.usage)
        return reply

    def _take_reply(self, spec: RunSpec, totals: RunTotals, reply: ModelReply) -> ToolStep | None:
        """The reply joins the thread with its first tool call (serial tool calls: one per step),
        returned checked (`checked_call`) for the act step; None when it has none. Every
        `llm_call_guidance_every` model calls that go on with a tool, guidance to converge is
        published and given to the model after the call's result."""
        call = reply.tool_calls[0] if reply.tool_calls else None
        if call is None:
            totals.add_row(spec, "assistant", reply.text, None)
            return None
        call, input_struct, invalid_input = checked_call(call)
        # what the frames, done and the tool get: the model's JSON
        input_json = pb.json_bytes(call.input, clip=True)
        stored_call = {"id": call.id, "name": call.name, "input": call.input}
        totals.add_row(spec, "assistant", reply.text, {"tool_calls": [stored_call]})
        totals.pending_call = stored_call
        every = self.settings.llm_call_guidance_every
        if every and totals.reason_calls % every == 0:
            text = (
                f"You have made {totals.reason_calls} model calls in this run. Converge: finish "
                "the task with what you have, or give your best final answer now."
            )
            self._publish(
                spec.run_id,
                guidance=events_pb2.GuidanceEvent(
                    message=text, total_llm_calls=totals.reason_calls
                ),
            )
            # given to the model after the pending tool result (the thread stays valid)
            totals.pending_guidance = text
        return ToolStep(
            call=call,
            input=input_struct,
            input_json=input_json,
            invalid=invalid_input,
            asks_user=invalid_input is None and call.name in hitl.TOOL_KINDS,
        )

    def _observe(
        self, spec: RunSpec, totals: RunTotals, act: ToolStep, result: tuple[Any, bool, bytes]
    ) -> None:
        """The observe step: the call's result joins the thread, done's tool calls and the
        stream (`tool_result`); guidance follows it: the pending guidance to converge, and,
        after `failure_guidance_threshold` failed calls in a row, guidance to change course."""
        output, ok, output_json = result
        call = act.call
        totals.add_tool_result(spec, call.id, call.name, output)
        totals.pending_call = None
        totals.tool_calls.append(
            events_pb2.ToolCallRecord(
                tool=call.name, input_json=act.input_json, output_json=output_json
            )
        )
        self._publish(
            spec.run_id,
            tool_result=events_pb2.ToolResultEvent(
                tool=call.name, tool_call_id=call.id, output_json=output_json
            ),
        )
        failures = totals.failures_in_a_row = 0 if ok else totals.failures_in_a_row + 1
        guidance: list[str] = []
        if totals.pending_guidance:
            guidance.append(totals.pending_guidance)
            totals.pending_guidance = None
        if not ok and failures == self.settings.failure_guidance_threshold:
            text = (
                f"{failures} tool calls in a row have failed. Stop repeating the same call: "
                "check the inputs, try another approach, ask the user, or explain what went wrong."
            )
            self._publish(
                spec.run_id,
                guidance=events_pb2.GuidanceEvent(message=text, consecutive_failures=failures),
            )
            guidance.append(text)
        for text in guidance:
            totals.add_row(spec, "system", text, {"guidance": True})

    async def _thread(
        self, spec: RunSpec, totals: RunTotals, tools: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """The thread for the next model call, summarizing its older part first when it is over
        budget (a model call given the run's `tools`, which it may not call).

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
        with tracing.model_call(spec.model, "summary") as traced:
            reply = _scrubbed(
                await totals.meter.model_call(
                    spec.model.generate([*older, prompt], tools, ignore, call_tools=False)
                )
            )
            traced.reply(reply)
        reply.tool_calls = []
        reply.usage = clamp_usage(reply.usage)
        call_index = totals.llm_calls
        totals.llm_calls += 1
        totals.count(reply.usage)
        self._record_usage_later(spec, totals, call_index, reply.usage)
        # no summary (a model that answered with a tool call anyway): the older part is kept,
        # and the run does not ask again at every step
        if not reply.text.strip():
            totals.unsummarizable = True
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

    def unsettled_runs(self) -> list[str]:
        """The runs this process still has to end or archive: active, archive being tried again,
        or events the log has not stored yet (their leases are renewed: `RunSupervisor.renew`)."""
        return [*self.active, *self._archiving, *self.events.unstored_runs()]
