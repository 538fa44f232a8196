"""The questions of the human-in-the-loop tests: one of each kind with a valid answer, and
`ask`, a turn that asks one and, once answered, ends with "Thanks, all done."
"""

from __future__ import annotations

from typing import Any

import httpx

from tests.orchestrator.helpers import run_turn

QUESTIONS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "ask_user_choice": (
        {
            "message": "Which repo?",
            "options": [
                {"value": "api", "label": "acme/api"},
                {"value": "web", "label": "acme/web"},
            ],
        },
        {"kind": "single_choice", "selected_value": "web"},
    ),
    "ask_user_multi_choice": (
        {
            "message": "Which ones?",
            "options": [
                {"value": "a", "label": "A"},
                {"value": "b", "label": "B"},
                {"value": "c", "label": "C"},
            ],
            "min_selections": 1,
            "max_selections": 2,
        },
        {"kind": "multi_choice", "selected_values": ["a", "c"]},
    ),
    "ask_user_yes_no": ({"message": "Proceed?"}, {"kind": "yes_no", "answer": True}),
    "ask_user_free_text": (
        {"message": "Name it", "min_length": 2, "max_length": 10},
        {"kind": "free_text", "text": "loopline"},
    ),
    "request_credential": (
        {"integration": "postgresql", "message": "I need database access"},
        {"kind": "skipped", "reason": "later"},
    ),
}


async def ask(
    client: httpx.AsyncClient, tool: str, tool_input: dict[str, Any]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    return await run_turn(
        client,
        {"say": "One question.", "tool": tool, "input": tool_input},
        {"say": "Thanks, all done."},
    )
