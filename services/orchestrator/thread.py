"""Load a chat's thread for the model, keeping it valid.

Every tool call in the thread has exactly one result before the next model call: a
call without a stored result (a crash between the two writes) gets a synthetic error
result here, so a chat can always take its next turn (issue: serial tool calls).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from services.orchestrator.models import Message


def to_model_messages(rows: list[Message]) -> list[dict[str, Any]]:
    """Model messages (see providers/base.py) from stored rows, oldest first; markers are skipped."""
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
            messages.append({"role": "tool", "tool_call_id": call_id, "name": (row.extra or {}).get("name", ""), "content": row.content})
            continue
        if open_calls:
            _close(messages, open_calls)
        if row.role == "assistant":
            calls = list((row.extra or {}).get("tool_calls") or [])
            messages.append({"role": "assistant", "content": row.content or "", "tool_calls": calls})
            open_calls.update({c["id"]: c["name"] for c in calls})
        elif row.role == "summary":
            messages.append({"role": "system", "content": f"Summary of the earlier conversation:\n{row.content}"})
        else:
            messages.append({"role": row.role, "content": row.content})
    if open_calls and rows and rows[-1].role != "assistant":
        _close(messages, open_calls)
    return messages


def _close(messages: list[dict[str, Any]], open_calls: dict[str, str]) -> None:
    for call_id, name in list(open_calls.items()):
        messages.append({"role": "tool", "tool_call_id": call_id, "name": name, "content": {"error": "not completed", "success": False}})
    open_calls.clear()


async def load_thread(session: AsyncSession, chat_id: str) -> list[dict[str, Any]]:
    """The chat's thread as model messages."""
    rows = (await session.execute(select(Message).where(Message.chat_id == chat_id).order_by(Message.seq))).scalars().all()
    return to_model_messages(list(rows))
