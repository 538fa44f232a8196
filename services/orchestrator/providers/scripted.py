"""The `scripted` model: deterministic, driven from outside through the public API.

When the latest user message is a JSON object with a `script` list, the model call
number k after that message consumes step k. A step is an object with:
- `{"say": text}`: final answer, streamed in `chunks` pieces (default up to 4);
- `{"tool": name, "input": {...}, "say": optional text first}`: one tool call;
- `{"tools": [{"tool", "input"}, ...]}`: several tool calls in one step (the loop runs one);
- `{"fail": message}`: the model call raises;
and optionally `"sleep_ms"` (wait before answering; cancellable), `"chunk_ms"` (wait between
two streamed chunks; cancellable) and `"usage"` (`{"input_tokens", "output_tokens"}` to
report instead of the estimate).
After the last step the model answers "(end of script)". Asked to summarize (the last
message has `purpose: "summarize"`), it returns the earlier summary and each user message
cut to 80 characters, joined by " | ".

Without a script it answers by rules: a message that asks about integrations, tools
or connections calls `get_available_integrations` and then sums up the result;
anything else is answered with a short echo.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from services.orchestrator.providers.base import (
    ModelError,
    ModelReply,
    OnText,
    TokenUsage,
    ToolCallRequest,
    arguments_of,
    estimate_tokens,
    is_token_count,
    loads_deep,
)

_DISCOVERY = re.compile(r"\b(integrations?|tools?|connect(ed|ions?)?|apps?)\b", re.IGNORECASE)


def split_chunks(text: str, pieces: int) -> list[str]:
    """Split `text` into at most `pieces` non-empty chunks on word boundaries; joined, they give
    `text` back exactly."""
    if not text:
        return []
    words = re.findall(r"\S+\s*|\s+", text)
    pieces = max(1, min(pieces, len(words)))
    size, extra = divmod(len(words), pieces)
    chunks, start = [], 0
    for i in range(pieces):
        end = start + size + (1 if i < extra else 0)
        chunks.append("".join(words[start:end]))
        start = end
    return [c for c in chunks if c]


def _script_of(content: Any) -> list[Any] | None:
    if not isinstance(content, str):
        return None
    stripped = content.strip()
    if not stripped.startswith("{"):
        return None
    try:
        data = loads_deep(
            stripped
        )  # a script nested past json.loads' limit: its deep tool input is the call's error result
    except ValueError:
        return None
    script = data.get("script") if isinstance(data, dict) else None
    return script if isinstance(script, list) else None


def _invalid(text: str) -> ModelError:
    """The failure of a script check: `text` is built from the check's constants and a
    setting's name only, so a client is told it (`ModelError.public`). A `fail` step's own text
    is not: it stands for a provider's failure text and goes to the log only."""
    return ModelError(text, public=text)


def _check_step(step: Any) -> None:
    """Raise ModelError (that model call fails, like a bad `usage`) for a script step that is
    not an object, or whose `say`, `tool`, `tools` or `fail` has another type than the README's
    table gives, rather than answer `[null]` with "None" or `{"say": ["a"]}` with "['a']"."""
    if not isinstance(step, dict):
        raise _invalid("scripted model: a script step must be an object")
    if step.get("say") is not None and not isinstance(step["say"], str):
        raise _invalid("scripted model: say must be a string")
    if step.get("tool") is not None and not isinstance(step["tool"], str):
        raise _invalid("scripted model: tool must be a tool's name (a string)")
    tools = step.get("tools")
    if tools is not None and not (
        isinstance(tools, list)
        and all(isinstance(t, dict) and isinstance(t.get("tool"), str) for t in tools)
    ):
        raise _invalid("scripted model: tools must be a list of {tool, input}")
    if "fail" in step and not isinstance(step["fail"], str):
        raise _invalid("scripted model: fail must be a message (a string)")


MAX_SLEEP_MS = 600_000  # a step's `sleep_ms` and `chunk_ms` at most (10 minutes)
MAX_CHUNKS = 100_000  # a step's `chunks` at most


def _bounded(
    step: dict[str, Any],
    key: str,
    low: float,
    high: float,
    default: float,
    kind: str,
    whole: bool = False,
) -> float:
    """A step's numeric setting `key` (`default` when absent or null), checked against
    [low, high]; raises ModelError naming it otherwise (a string, a boolean, NaN, 1e400, a
    fraction where `whole`): that model call fails like a bad `usage`, so `chunks: 1e400`
    cannot crash the run's loop nor `sleep_ms: 1e12` hold the chat for good."""
    value = step.get(key)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not low <= value <= high
        or (whole and value != int(value))
    ):
        raise _invalid(f"scripted model: {key} must be {kind} between {low:,} and {high:,}")
    return value


# how many integrations the summary of a listing names before "and N more"
_NAMED = 6


class ScriptedModel:
    """The deterministic test and demo model (provider_id "scripted")."""

    provider_id = "scripted"

    def __init__(self, model_id: str = "default") -> None:
        self.model_id = model_id

    async def generate(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        on_text: OnText,
        *,
        call_tools: bool = True,
    ) -> ModelReply:
        """Answer the next step; see the module docstring. Raises ModelError on a `fail` step.
        (`call_tools` changes nothing: a summary call is recognised by its last message.)"""
        if messages and messages[-1].get("purpose") == "summarize":
            return self._summary(messages[:-1])
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        user_text = messages[last_user]["content"] if last_user >= 0 else ""
        step_index = sum(1 for m in messages[last_user + 1 :] if m["role"] == "assistant")
        script = _script_of(user_text)
        input_estimate = sum(estimate_tokens(m.get("content")) for m in messages)
        step: dict[str, Any]
        if script is not None:
            step = script[step_index] if step_index < len(script) else {"say": "(end of script)"}
            _check_step(step)
        else:
            step = self._rule_step(user_text, messages[last_user + 1 :], step_index)

        sleep_ms = _bounded(step, "sleep_ms", 0, MAX_SLEEP_MS, 0, "a number of milliseconds")
        chunk_ms = _bounded(step, "chunk_ms", 0, MAX_SLEEP_MS, 0, "a number of milliseconds")
        chunks = int(_bounded(step, "chunks", 1, MAX_CHUNKS, 4, "a whole number", whole=True))
        if sleep_ms > 0:
            await asyncio.sleep(sleep_ms / 1000)

        reported = step.get("usage")
        # "5", 5, [1, 2]: another type fails the call too
        if reported is not None and not isinstance(reported, dict):
            raise _invalid("scripted model: usage must be an object {input_tokens, output_tokens}")
        if reported is not None and not all(
            is_token_count(reported.get(k, 0)) for k in ("input_tokens", "output_tokens")
        ):
            raise _invalid("scripted model: usage counts must be integers between 0 and 1000000000")
        text = step.get("say") or ""
        usage = TokenUsage(
            input_tokens=int(reported.get("input_tokens", 0))
            if reported is not None
            else input_estimate,
            output_tokens=int(reported.get("output_tokens", 0))
            if reported is not None
            else estimate_tokens(text or step),
            estimated=reported is None,
        )
        if "fail" in step:
            raise ModelError(f"scripted model failed: {step['fail']}", usage=usage)

        for index, chunk in enumerate(split_chunks(text, chunks)):
            if index and chunk_ms > 0:
                await asyncio.sleep(chunk_ms / 1000)
            await on_text(chunk)

        calls: list[ToolCallRequest] = []
        if "tool" in step:
            calls.append(self._call(step.get("tool"), step.get("input"), step.get("tool_call_id")))
        for item in step.get("tools") or []:
            calls.append(self._call(item["tool"], item.get("input"), item.get("tool_call_id")))
        return ModelReply(text=text, tool_calls=calls, usage=usage)

    @staticmethod
    def _summary(messages: list[dict[str, Any]]) -> ModelReply:
        """A deterministic summary: the earlier summary, then each user message (its first 80
        characters)."""
        parts = [
            m["content"].split("\n", 1)[-1]
            for m in messages
            if m["role"] == "system" and str(m.get("content", "")).startswith("Summary of")
        ]
        parts += [f"user: {str(m['content'])[:80]}" for m in messages if m["role"] == "user"]
        text = " | ".join(parts) or "(nothing to summarize)"
        return ModelReply(
            text=text,
            usage=TokenUsage(
                input_tokens=sum(estimate_tokens(m.get("content")) for m in messages),
                output_tokens=estimate_tokens(text),
                estimated=True,
            ),
        )

    @staticmethod
    def _call(name: Any, tool_input: Any, call_id: Any) -> ToolCallRequest:
        import uuid

        return ToolCallRequest(
            str(call_id) if call_id else f"call_{uuid.uuid4().hex[:24]}",
            str(name),
            *arguments_of(tool_input),
        )

    def _rule_step(
        self, user_text: Any, since_user: list[dict[str, Any]], step_index: int
    ) -> dict[str, Any]:
        text = user_text if isinstance(user_text, str) else ""
        if _DISCOVERY.search(text):
            if step_index == 0:
                return {
                    "say": "Let me check which integrations are available.",
                    "tool": "get_available_integrations",
                    "input": {},
                }
            results = [m for m in since_user if m["role"] == "tool"]
            return {"say": self._summarize(results[-1]["content"] if results else None)}
        return {"say": f"You said: {text}" if text else "Hello! Ask me about your integrations."}

    @staticmethod
    def _summarize(output: Any) -> str:
        items = None
        if isinstance(output, dict):
            items = output.get("integrations")
        elif isinstance(output, list):
            items = output
        if not isinstance(items, list):
            return "I could not read the list of integrations."
        if not items:
            return "No integrations are available yet."
        names = []
        for item in sorted(
            (i for i in items if isinstance(i, dict)), key=lambda i: not i.get("connected")
        ):
            label = item.get("display_name") or item.get("name") or "?"
            names.append(f"{label}{' (connected)' if item.get('connected') else ''}")
        if len(names) > _NAMED:  # the connected ones first, then the catalogue's order
            named, more = ", ".join(names[:_NAMED]), len(names) - _NAMED
            return f"{len(names)} integrations are available: {named} and {more} more."
        return f"{len(names)} integrations are available: {', '.join(names)}."
