"""The terminal events recovery publishes for a run whose replica is gone.

`close_calls` gives each streamed tool call that got no result its `tool_result`; `stored_ending`
rebuilds the end the loop would have published (run_end.py `_finish`) from the run's stored rows,
for an ended run whose stream lost it.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from loopline.assistant.v1 import events_pb2
from services.common import pb
from services.orchestrator.models import Interrupt, Message, Run
from services.orchestrator.thread import cut_off_result

LOST_MESSAGE = (
    "The turn was interrupted: the server running it stopped unexpectedly. Please try again."
)


def close_calls(
    run_id: str,
    published: list[events_pb2.Event],
    status: str,
    stored: dict[str | None, Any],
) -> tuple[list[events_pb2.Event], list[events_pb2.ToolCallRecord]]:
    """A `tool_result` for each streamed `tool_call` of `published` that got none (its result
    in `stored`, by call id, else the error the loop gives a call cut off by `status`), and
    the run's tool calls as done.tool_calls lists them (README "Stream end": every tool_call
    gets its tool_result)."""
    calls: dict[str, events_pb2.ToolCallEvent] = {}
    results: dict[str, events_pb2.ToolResultEvent] = {}
    for event in published:
        kind = event.WhichOneof("payload")
        if kind == "tool_call":
            calls.setdefault(event.tool_call.tool_call_id, event.tool_call)
        elif kind == "tool_result":
            results.setdefault(event.tool_result.tool_call_id, event.tool_result)
    error = pb.json_bytes(cut_off_result(status))
    cut_off, records = [], []
    for call_id, call in calls.items():
        result = results.get(call_id)
        output = pb.json_bytes(stored[call_id]) if call_id in stored else error
        if (
            result is None and status != "interrupted"
        ):  # an interrupted run's question has no result yet
            cut_off.append(
                events_pb2.Event(
                    run_id=run_id,
                    time=pb.timestamp(),
                    tool_result=events_pb2.ToolResultEvent(
                        tool=call.tool, tool_call_id=call_id, output_json=output
                    ),
                )
            )
        records.append(
            events_pb2.ToolCallRecord(
                tool=call.tool,
                input=call.input,
                input_json=call.input_json,
                output_json=pb.output_json(result) if result else output,
            )
        )
    return cut_off, records


async def stored_ending(
    sessions: Any, run_id: str, published: list[events_pb2.Event]
) -> list[events_pb2.Event]:
    """The terminal events the loop publishes for the run's stored end, rebuilt from its rows
    for a stream that lost them: a `tool_result` for each streamed call without one (its stored
    result), then `done` with the run's last answer, tool calls and usage (completed), `error` +
    `done {error: true}` (failed), `cancelled`, or the question's `user_input_request` +
    `interrupted` (interrupted; its call has no result)."""
    async with sessions() as session:
        run, stored, response, question = await _stored_end(session, run_id)
    status = run.status if run.status != "interrupted" or question is not None else "failed"
    cut_off, records = close_calls(
        run_id, published, status, {} if status == "interrupted" else stored
    )
    if status == "interrupted" and question is not None:  # interrupted: it has its question
        return _question_events(run_id, question)
    usage = events_pb2.Usage(
        **{
            key: int((run.usage or {}).get(key) or 0)
            for key in ("input_tokens", "output_tokens", "total_tokens", "llm_calls")
        }
    )
    if status == "completed":
        return [
            *cut_off,
            events_pb2.Event(
                run_id=run_id,
                time=pb.timestamp(),
                done=events_pb2.DoneEvent(
                    response=response if isinstance(response, str) else "",
                    tool_calls=records,
                    usage=usage,
                ),
            ),
        ]
    if status == "cancelled":
        return [
            *cut_off,
            events_pb2.Event(
                run_id=run_id,
                time=pb.timestamp(),
                cancelled=events_pb2.CancelledEvent(reason="cancelled"),
            ),
        ]
    return [
        *cut_off,
        events_pb2.Event(
            run_id=run_id,
            time=pb.timestamp(),
            error=events_pb2.ErrorEvent(message=run.error or LOST_MESSAGE),
        ),
        events_pb2.Event(
            run_id=run_id,
            time=pb.timestamp(),
            done=events_pb2.DoneEvent(response="", tool_calls=records, usage=usage, error=True),
        ),
    ]


async def _stored_end(
    session: Any, run_id: str
) -> tuple[Run, dict[str | None, Any], Any, Interrupt | None]:
    """The run, its stored tool results by call id, its last answer (completed) and its
    question (interrupted)."""
    run = await session.get(Run, run_id)
    tool_rows = (
        await session.execute(
            select(Message.content, Message.extra).where(
                Message.run_id == run_id, Message.role == "tool"
            )
        )
    ).all()
    stored: dict[str | None, Any] = {
        extra.get("tool_call_id"): content
        for content, extra in tool_rows
        if isinstance(extra, dict)
    }
    response = question = None
    if run.status == "completed":
        response = (
            await session.execute(
                select(Message.content)
                .where(Message.run_id == run_id, Message.role == "assistant")
                .order_by(Message.seq.desc())
                .limit(1)
            )
        ).scalar()
    elif run.status == "interrupted":
        question = (
            (
                await session.execute(
                    select(Interrupt)
                    .where(Interrupt.run_id == run_id)
                    .order_by(Interrupt.created_at.desc())
                    .limit(1)
                )
            )
            .scalars()
            .first()
        )
    return run, stored, response, question


def _question_events(run_id: str, question: Interrupt) -> list[events_pb2.Event]:
    """An interrupted run's end: its question's `user_input_request`, then `interrupted`."""
    return [
        events_pb2.Event(
            run_id=run_id,
            time=pb.timestamp(),
            user_input_request=events_pb2.UserInputRequestEvent(
                request_json=pb.json_bytes(question.request, clip=True)
            ),
        ),
        events_pb2.Event(
            run_id=run_id,
            time=pb.timestamp(),
            interrupted=events_pb2.InterruptedEvent(request_id=question.id, kind=question.kind),
        ),
    ]
