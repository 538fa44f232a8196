"""The fault suite's turns: scripts for long and short runs that keep events flowing through a
fault, and `start_turn`, which starts one and returns the `Run` the checker judges.
"""

from __future__ import annotations

import asyncio
import pathlib
import time
from dataclasses import dataclass
from typing import Any

import httpx

from tests.conftest import script

SCRIPTED_PATH = (
    pathlib.Path(__file__).resolve().parents[2]
    / "services"
    / "orchestrator"
    / "providers"
    / "scripted.py"
)


def supports_chunk_ms() -> bool:
    """Whether the scripted model knows `chunk_ms` (a wait between streamed chunks)."""
    try:
        return '"chunk_ms"' in SCRIPTED_PATH.read_text()
    except OSError:
        return False


ECHO = "execute_integration_tool"


def echo_input(message: str) -> dict[str, Any]:
    return {"integration": "loopline", "action": "echo", "parameters": {"message": message}}


def wait_input(seconds: float) -> dict[str, Any]:
    return {"integration": "loopline", "action": "wait", "parameters": {"seconds": seconds}}


@dataclass
class Turn:
    """What a turn was started with: its script (the user message) and the answer it ends with."""

    message: str
    answer: str


def long_turn(seconds: float, label: str, tick_s: float = 1.0) -> Turn:
    """A run that streams for about `seconds` and then completes with a known answer.

    With `chunk_ms` in the scripted model: one `say` of one word a tick. Without it: a model
    step with `sleep_ms` and a `loopline.echo` tool call each tick (frames response_chunk,
    tool_call, tool_result), then the answer. Either way the loop is never idle for longer
    than a tick, so events keep flowing through a fault.
    """
    ticks = max(2, int(seconds / tick_s))
    answer_words = [f"{label}-{i}" for i in range(ticks)]
    if supports_chunk_ms():
        answer = " ".join(answer_words) + "."
        return Turn(
            script({"say": answer, "chunks": ticks, "chunk_ms": int(tick_s * 1000)}), answer
        )
    ticks = min(
        ticks, 45
    )  # LOOPLINE_RECURSION_LIMIT 100: a model call and a tool call are a step each
    tick_ms = int(seconds * 1000 / (ticks + 1))
    steps: list[dict[str, Any]] = [
        {
            "tool": ECHO,
            "input": echo_input(f"{label} tick {i}"),
            "say": f"Tick {i}. ",
            "sleep_ms": tick_ms,
        }
        for i in range(ticks)
    ]
    answer = f"The answer of {label}: " + " ".join(answer_words[:8]) + "."
    steps.append({"say": answer, "chunks": 4, "sleep_ms": tick_ms})
    return Turn(script(*steps), answer)


def short_turn(label: str, sleep_ms: int = 500, chunks: int = 4) -> Turn:
    answer = f"Short answer {label}: one two three four five six."
    return Turn(script({"say": answer, "chunks": chunks, "sleep_ms": sleep_ms}), answer)


@dataclass
class Run:
    """A started turn and what the checker should find at its end.

    `expect` is "completed" (its owner finished it: the answer is `turn.answer`) or "failed"
    (it was lost with its owner: error + done {error: true}, failed by the crash reaper)."""

    chat_id: str
    run_id: str
    turn: Turn
    expect: str = "completed"
    via: str = ""
    started_at: float = 0.0

    @property
    def url(self) -> str:
        return f"/assistant/chat/{self.chat_id}/listen/{self.run_id}"

    @property
    def turn_key(self) -> str:
        return f"{self.chat_id}:{self.run_id}"


async def start_turn(
    client: httpx.AsyncClient,
    turn: Turn,
    *,
    chat_id: str | None = None,
    via: str = "",
    attempts: int = 1,
) -> Run:
    """POST /assistant/chat; returns the Run (a 503 is retried `attempts` times in all)."""
    body: dict[str, Any] = {"message": turn.message}
    if chat_id:
        body["chat_id"] = chat_id
    for attempt in range(attempts):
        response = await client.post("/assistant/chat", json=body)
        if response.status_code == 503 and attempt + 1 < attempts:
            await asyncio.sleep(min(1.0, float(response.headers.get("retry-after", "1") or 1)))
            continue
        assert response.status_code == 200, (
            f"starting a turn through {via or client.base_url}: "
            f"{response.status_code} {response.text}"
        )
        data = response.json()
        return Run(data["chat_id"], data["run_id"], turn, via=via, started_at=time.monotonic())
    raise AssertionError("unreachable")
