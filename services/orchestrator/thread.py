"""Load a chat's thread for the model, keeping it valid and inside the model's context.

Every tool call in the thread has exactly one result before the next model call: a
call without a stored result (a crash between the two writes) gets a synthetic error
result here, so a chat can always take its next turn (issue: serial tool calls).

Summarization (spec: SummarizationMiddleware): when the thread's estimated size passes
a budget, its older part is summarized by the model and stored as a `summary` row that
records the last message it covers (`extra.covers_until_seq`). Loading then gives the
model the latest summary followed by the messages after it. Cuts fall only right before
a user message (between turns), so a tool call and its result are never separated.
"""

from __future__ import annotations

from typing import Any

import orjson
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from services.orchestrator.models import Message

CUT_OFF_ERRORS = {
    "cancelled": "cancelled",
    "expired": "expired: the question was not answered in time",
}


def cut_off_result(kind: str) -> dict[str, Any]:
    """The error result of a tool call a run's end cut off: `kind` "cancelled" (a cancel),
    "expired" (a question nobody answered within LOOPLINE_PENDING_TTL_S) or any other (the run
    failed). Stored in the thread (and, but for an expired question, streamed as the call's
    `tool_result`) by the loop (run_end.py `_finish`), the crash reaper (recovery.py) and the
    service (a cancelled or expired question) alike, so the thread never holds a call without
    a result."""
    return {"error": CUT_OFF_ERRORS.get(kind, "not completed: the run failed"), "success": False}


def to_model_messages(rows: list[Message]) -> list[dict[str, Any]]:
    """Model messages (see providers/base.py) from stored rows, oldest first; markers are
    skipped."""
    messages: list[dict[str, Any]] = []
    open_calls: dict[str, str] = {}
    for row in rows:
        if row.role == "marker":
            continue
        if row.role == "tool":
            call_id = (row.extra or {}).get("tool_call_id")
            if call_id not in open_calls:
                continue  # a result whose call is gone: drop it
            open_calls.pop(call_id)
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "name": (row.extra or {}).get("name", ""),
                    "content": row.content,
                }
            )
            continue
        if open_calls:
            _close(messages, open_calls)
        if row.role == "assistant":
            calls = list((row.extra or {}).get("tool_calls") or [])
            messages.append(
                {"role": "assistant", "content": row.content or "", "tool_calls": calls}
            )
            open_calls.update({c["id"]: c["name"] for c in calls})
        else:
            messages.append({"role": row.role, "content": row.content})
    if open_calls and rows and rows[-1].role != "assistant":
        _close(messages, open_calls)
    return messages


def _close(messages: list[dict[str, Any]], open_calls: dict[str, str]) -> None:
    for call_id, name in list(open_calls.items()):
        messages.append(
            {
                "role": "tool",
                "tool_call_id": call_id,
                "name": name,
                "content": {"error": "not completed", "success": False},
            }
        )
    open_calls.clear()


async def load_rows(session: AsyncSession, chat_id: str) -> tuple[Message | None, list[Message]]:
    """(latest summary row or None, the rows after what it covers), oldest first."""
    rows = list(
        (
            await session.execute(
                select(Message).where(Message.chat_id == chat_id).order_by(Message.seq)
            )
        ).scalars()
    )
    return split_summary(rows)


def split_summary(rows: list[Any]) -> tuple[Any | None, list[Any]]:
    """(latest summary row or None, the rows after what it covers), oldest first.

    `rows` are a chat's messages oldest first, stored (`models.Message`) or in memory
    (`store.ThreadRow`, whose `seq` is None until stored: kept as after any summary).
    """
    latest = None
    for row in rows:
        if row.role == "summary":
            latest = row
    if latest is None:
        return None, rows
    covered = int((latest.extra or {}).get("covers_until_seq", 0))
    return latest, [r for r in rows if r.role != "summary" and (r.seq is None or r.seq > covered)]


def with_summary(summary: Message | None, rows: list[Message]) -> list[dict[str, Any]]:
    """Model messages: the summary (as a system message) then the rows."""
    messages = to_model_messages(rows)
    if summary is not None:
        messages.insert(
            0,
            {
                "role": "system",
                "content": f"Summary of the earlier conversation:\n{summary.content}",
            },
        )
    return messages


async def load_thread(session: AsyncSession, chat_id: str) -> list[dict[str, Any]]:
    """The chat's thread as model messages (latest summary first when there is one)."""
    summary, rows = await load_rows(session, chat_id)
    return with_summary(summary, rows)


def estimate(messages: list[dict[str, Any]]) -> int:
    """Estimated tokens of model messages: their compact JSON's UTF-8 bytes / 4 (about 4
    characters a token). Runs before every model call over the whole thread, so it is
    orjson (the stdlib's `json.dumps` was ~3% of the orchestrator's CPU per turn)."""
    return sum(_json_size(m) for m in messages) // 4


def _json_size(message: dict[str, Any]) -> int:
    try:
        return len(orjson.dumps(message, default=str, option=orjson.OPT_NON_STR_KEYS))
    except (
        TypeError
    ):  # what orjson refuses (a lone surrogate, a nesting past 254 levels): the stdlib's size
        import json

        return len(json.dumps(message, default=str, separators=(",", ":")))


def choose_cut(rows: list[Message], keep_tokens: int) -> int | None:
    """Index of the row where the kept tail starts, or None when nothing can be summarized.

    The tail starts at a user message (a turn boundary) and is the shortest tail whose
    estimate reaches `keep_tokens`, but always holds the current (last) turn; the part
    before it must hold at least one message.
    """
    starts = [i for i, row in enumerate(rows) if row.role == "user"]
    if not starts:
        return None
    candidates = [i for i in starts if i > 0]
    if not candidates:
        return None
    chosen = candidates[-1]
    for index in reversed(candidates):
        chosen = index
        if estimate(to_model_messages(rows[index:])) >= keep_tokens:
            break
    return chosen
