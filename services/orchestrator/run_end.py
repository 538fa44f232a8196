"""How a run ends: its billing records handed over, its end stored, its terminal events
published.

Ordering rule: the database is updated (status, `running_id` cleared) *before* the terminal
event is published, so a client that sees `done` can start its next turn at once. A run ends
in exactly one outcome: completed, interrupted (HITL pause), cancelled or failed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from sqlalchemy import update

from loopline.assistant.v1 import events_pb2
from services.common import db, pb, tracing
from services.orchestrator.archive import RunArchiving
from services.orchestrator.models import Chat, Run, RunEvent, utcnow
from services.orchestrator.providers.base import TokenUsage, clamp_usage
from services.orchestrator.run_billing import RunBilling
from services.orchestrator.run_state import Outcome, RunSpec, RunState, RunTotals, new_event
from services.orchestrator.store import RunEnd
from services.orchestrator.thread import cut_off_result

log = logging.getLogger(__name__)

# first wait before a run's end is stored again while its database is unavailable (doubling)
FINISH_RETRY_FIRST_S = 0.1
FINISH_RETRY_MAX_S = 2.0  # longest wait between two tries


def _ending_events(
    run_id: str,
    outcome: Outcome,
    tool_calls: list[events_pb2.ToolCallRecord],
    usage: events_pb2.Usage,
) -> list[events_pb2.Event]:
    """The terminal events of a run ending in `outcome`: `done` (completed), `error` + `done`
    (failed), `cancelled`, or `user_input_request` + `interrupted` (paused on a question)."""
    if outcome.kind == "completed":
        ending = [
            new_event(
                run_id,
                done=events_pb2.DoneEvent(
                    response=outcome.response, tool_calls=tool_calls, usage=usage
                ),
            )
        ]
    elif outcome.kind == "failed":
        ending = [
            new_event(run_id, error=events_pb2.ErrorEvent(message=outcome.message)),
            new_event(
                run_id,
                done=events_pb2.DoneEvent(
                    response="", tool_calls=tool_calls, usage=usage, error=True
                ),
            ),
        ]
    elif outcome.kind == "cancelled":
        ending = [new_event(run_id, cancelled=events_pb2.CancelledEvent(reason=outcome.reason))]
    else:
        interrupt = outcome.interrupt or {}
        # clip: the question holds parts of the model's input (a placeholder) and tool output
        ending = [
            new_event(
                run_id,
                user_input_request=events_pb2.UserInputRequestEvent(
                    request_json=pb.json_bytes(interrupt, clip=True)
                ),
            ),
            new_event(
                run_id,
                interrupted=events_pb2.InterruptedEvent(
                    request_id=interrupt["request_id"], kind=interrupt["kind"]
                ),
            ),
        ]
    return ending


class RunEnding(RunBilling, RunArchiving):
    """The end of a run in `TurnRunner`, mixed into it (no delegating layer on the loop's path).
    Uses the runner's `store`, `sessions`, `events` and `usage`, and the archive (RunArchiving)."""

    sessions: Any

    async def _finish(self, state: RunState, totals: RunTotals, outcome: Outcome) -> None:
        """End the run in `outcome`: its billing records handed over, what was cut off kept, its
        end stored (`_store_end`: run, thread rows, question, records, a memory log's events),
        then its terminal events published and the stream closed, then archived (durable log)."""
        spec = state.spec
        # the run's usage records still waiting are stored with its end (`UsageBatcher.take`): the
        # terminal event does not wait for billing; the rest (sent, tool charges) are awaited
        handed = self.usage.take(spec.run_id)
        if totals.pending_writes:
            if handed is None:
                self.usage.flush()
            await asyncio.gather(*totals.pending_writes, return_exceptions=True)
        if outcome.kind == "cancelled" and totals.model_in_flight:
            await self._bill_cut_off_call(spec, totals)
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
            totals.add_row(
                spec,
                "marker",
                None,
                {
                    "type": "interrupted",
                    "request_id": interrupt.get("request_id"),
                    "kind": interrupt.get("kind"),
                    # the run's trace, which its resume joins (tracing on only: docs/tracing.md)
                    **tracing.traceparent(),
                },
            )
        run_id = spec.run_id
        ending = _ending_events(run_id, outcome, totals.tool_calls, usage)
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
            # not stored: sent as before the end (never lost with the failed transaction)
            if handed:
                self.usage.give_back(handed[0])
            raise
        if handed:
            self.usage.stored(handed[1]["id"], handed[0])
        totals.unsaved = []
        self._end_stream(run_id, ending)
        # final from here on: nothing below may change it (one terminal outcome)
        state.outcome = outcome.kind
        state.ended.set()
        if not archived:
            await self.archive_after_end(run_id)
        log.info(
            "run ended", extra={"fields": {"outcome": outcome.kind, "llm_calls": totals.llm_calls}}
        )

    async def _bill_cut_off_call(self, spec: RunSpec, totals: RunTotals) -> None:
        """Bill the tokens of a model call cut off by a cancel like any other (spec: token usage
        is recorded "regardless of whether the turn succeeds, errors, or is cancelled")."""
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

    def _keep_cut_off(self, spec: RunSpec, totals: RunTotals, outcome: Outcome) -> None:
        """What a cancel or failure cut off still joins the run's thread, in order: a pending tool
        call gets its error result (`cut_off_result`; streamed as its `tool_result` and listed in
        done), and the text a cut-off model call streamed (`totals.streamed`, as listeners saw it)
        becomes the run's assistant message, marked `extra.cut_off` = "cancelled" or "failed"
        (a message's `thinking` in GetChat); none when that call streamed only whitespace."""
        # a tool call cut off by a cancel or failure still gets a result
        if totals.pending_call is not None:
            pending = totals.pending_call
            totals.add_tool_result(
                spec, pending["id"], pending["name"], cut_off_result(outcome.kind)
            )
            # its tool_call was streamed: its end is too (and done lists it)
            if outcome.kind in ("failed", "cancelled"):
                output = pb.json_bytes(cut_off_result(outcome.kind))
                totals.tool_calls.append(
                    events_pb2.ToolCallRecord(
                        tool=pending["name"],
                        input_json=pb.json_bytes(pending["input"], clip=True),
                        output_json=output,
                    )
                )
                self.events.append(
                    new_event(
                        spec.run_id,
                        tool_result=events_pb2.ToolResultEvent(
                            tool=pending["name"], tool_call_id=pending["id"], output_json=output
                        ),
                    )
                )
        partial = "".join(totals.streamed)
        if outcome.kind in ("failed", "cancelled") and totals.model_in_flight and partial.strip():
            totals.add_row(spec, "assistant", partial, {"cut_off": outcome.kind})

    async def _store_end(self, end: RunEnd) -> None:
        """`store.finish(end)`, tried again while the database is unavailable (`db.is_unavailable`:
        refused or dropped connections), waiting FINISH_RETRY_FIRST_S doubling up to
        FINISH_RETRY_MAX_S, until it answers, so a short drop of the database's connections does
        not fail the runs that end during it. While it waits the run stays
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
                        "storing the run's end failed: the database is unavailable; "
                        "trying again until it answers",
                        extra={"fields": {"error": type(error).__name__}},
                    )
                await asyncio.sleep(delay)
                delay = min(delay * 2, FINISH_RETRY_MAX_S)
            else:
                if reported:
                    log.info("the run's end was stored once the database answered")
                return

    async def _finish_minimal(self, spec: RunSpec, outcome: Outcome) -> None:
        """The last resort when `_finish` itself failed: mark the run failed, free the chat, and
        end its stream with `error` then `done` (error: true, zero usage): nothing stays stuck."""
        run_id = spec.run_id
        ending = [
            new_event(run_id, error=events_pb2.ErrorEvent(message=outcome.message)),
            new_event(
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
            # ended meanwhile (stored by `_finish` after all, or by another replica): its end stands
            if mine.rowcount != 1:
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

    def _end_stream(self, run_id: str, ending: list[events_pb2.Event]) -> None:
        """Publish the run's terminal events and close its stream (after its end is stored)."""
        for event in ending:
            self.events.append(event)
        self.events.close(run_id)
