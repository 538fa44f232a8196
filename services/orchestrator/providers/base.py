"""The provider-neutral model interface of the loop.

A thread is a list of messages (dicts):
- `{"role": "user", "content": str}`
- `{"role": "assistant", "content": str, "tool_calls": [{"id", "name", "input"}]}`
- `{"role": "tool", "tool_call_id": str, "name": str, "content": <JSON value>}`
- `{"role": "system", "content": str}` (guidance given to the model before its next step)
Tools are `{"name", "description", "input_schema"}`.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeGuard

log = logging.getLogger(__name__)


@dataclass
class ToolCallRequest:
    """A tool call the model asked for.

    `input` is the call's arguments as a JSON object. `unreadable` says why they could not
    be read as one ("" when they could): arguments that are not valid JSON, or JSON that is
    not an object (an array, a string, a number). Such a call keeps `input` = {} and is not
    run: the model gets an error result naming the reason (`loop.checked_call`), as
    LangChain's `invalid_tool_calls` are answered instead of run with made-up arguments.
    """

    id: str
    name: str
    input: dict[str, Any]
    unreadable: str = ""


NOT_FINITE = "the arguments hold a number JSON cannot carry (NaN, Infinity, or beyond ±1.8e308)"


def arguments_of(value: Any) -> tuple[dict[str, Any], str]:
    """A decoded tool-call input as (object, "") or ({}, why it is not one); None is {}.

    An object holding a number that is not finite (Python's json reads `NaN`, `Infinity`
    and `1e400` as such floats; RFC 8259 section 6 has no value for them) is not one either:
    it cannot be stored, encoded as protobuf's Value or sent to a model again (its chat would
    not render, and PostgreSQL's JSON refuses it at the run's end).
    """
    if value is None:
        return {}, ""
    if isinstance(value, dict):
        return (value, "") if _all_finite(value) else ({}, NOT_FINITE)
    return {}, f"the arguments are {_json_kind(value)}, not a JSON object"


def _all_finite(value: Any) -> bool:
    """Whether every float in a decoded JSON value is finite (one iterative walk)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return False
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return True


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "not JSON"


@dataclass
class TokenUsage:
    """Token counts of one model call."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    estimated: bool = False


@dataclass
class ReportedUsage:
    """Token counts as a provider's response gave them: untrusted, any JSON value until
    `with_estimates` turns them into a TokenUsage."""

    input_tokens: object = 0
    output_tokens: object = 0
    cache_read_tokens: object = 0
    cache_write_tokens: object = 0


MAX_TOKENS_PER_CALL = 10**9


def clamp_usage(usage: TokenUsage | ReportedUsage | None) -> TokenUsage:
    """`usage` with every count an int in [0, 10**9] (anything else becomes 0, `estimated` kept).

    Provider responses are untrusted input: a negative, huge or non-integer count must not
    reach billing or the int64 fields of events.
    """
    if usage is None:
        return TokenUsage()

    def fit(value: object) -> int:
        return value if is_token_count(value) else 0

    return TokenUsage(
        input_tokens=fit(usage.input_tokens),
        output_tokens=fit(usage.output_tokens),
        cache_read_tokens=fit(usage.cache_read_tokens),
        cache_write_tokens=fit(usage.cache_write_tokens),
        estimated=isinstance(usage, TokenUsage) and bool(usage.estimated),
    )


def is_token_count(value: object) -> TypeGuard[int]:
    """Whether `value` is a token count Loopline records: an int (not a bool) in
    [0, MAX_TOKENS_PER_CALL]."""
    return (
        isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKENS_PER_CALL
    )


def with_estimates(
    usage: TokenUsage | ReportedUsage, input_estimate: int, output_estimate: int
) -> TokenUsage:
    """A provider's reported `usage` with an input or output count that is no token count
    (null, negative, not an integer, past MAX_TOKENS_PER_CALL) replaced by its estimate, and
    then marked `estimated`, so the call's tokens are billed rather than recorded as 0.
    Cache counts that are no token count are 0, as in `clamp_usage`."""
    result = clamp_usage(usage)
    if not is_token_count(usage.input_tokens):
        result.input_tokens, result.estimated = input_estimate, True
    if not is_token_count(usage.output_tokens):
        result.output_tokens, result.estimated = output_estimate, True
    return result


def add_usage(total: TokenUsage, part: TokenUsage) -> None:
    """Add `part` into `total` in place (estimated if either is)."""
    total.input_tokens += part.input_tokens
    total.output_tokens += part.output_tokens
    total.cache_read_tokens += part.cache_read_tokens
    total.cache_write_tokens += part.cache_write_tokens
    total.estimated = total.estimated or part.estimated


@dataclass
class ModelReply:
    """What one model call produced: its full text, its tool calls (maybe several) and usage;
    for the call's span (services/common/tracing.py), why the model stopped as the provider
    said it (`finish_reasons`, e.g. "stop", "tool_calls", "end_turn") and the model that
    answered (`response_model`), when the provider told them."""

    text: str
    tool_calls: list[ToolCallRequest] = field(default_factory=list)
    usage: TokenUsage = field(default_factory=TokenUsage)
    finish_reasons: list[str] = field(default_factory=list)
    response_model: str = ""


class ModelError(Exception):
    """A model call failed.

    What a client is told (the run's `error` event, its stored `error`, and so GET
    /assistant/chat/{id}) is `public`: text the raiser built from known fields only (the
    provider's name, a kind of failure from a closed set, an HTTP status, a count of attempts;
    `retry.call_with_retries`, the scripted model's checks of its script). A ModelError raised
    without it is told as "<provider>: the model call failed" (`sanitize.model_failure`).
    `str(self)` may hold anything (a provider's or a script's text): it goes to the log only,
    redacted.

    Attributes:
        usage: tokens the provider reported (or that were estimated) before the failure.
        public: the client-visible text, or None.
    """

    def __init__(
        self, message: str, usage: TokenUsage | None = None, *, public: str | None = None
    ) -> None:
        super().__init__(message)
        self.usage = usage or TokenUsage()
        self.public = public


OnText = Callable[[str], Awaitable[None]]


class ChatModel(Protocol):
    """A chat model: one call streams text deltas to `on_text` and returns the reply."""

    provider_id: str
    model_id: str

    async def generate(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        on_text: OnText,
        *,
        call_tools: bool = True,
    ) -> ModelReply:
        """Run one model call. Raises ModelError on failure; cancellation propagates.

        `call_tools=False` (the summary call): the model is given `tools` — the thread it reads
        holds calls of them, which Anthropic refuses without their definitions ("Requests which
        include tool_use or tool_result blocks must define tools"), and the same tools keep the
        prompt's cached prefix — but must not call one (`tool_choice` "none").
        """
        ...


def estimate_tokens(value: Any) -> int:
    """A rough token estimate of a value: about 4 characters per token, at least 1."""
    text = value if isinstance(value, str) else repr(value)
    return max(1, len(text) // 4)


DEEP_JSON_KEPT_LEVELS = (
    100  # `loads_deep` keeps this many levels as objects and arrays, deeper ones as their JSON text
)
_STRUCTURAL = re.compile(r'[\[\]{}"]')
_STRING_REST = re.compile(
    r'(?:[^"\\]|\\.)*+"', re.DOTALL
)  # the rest of a JSON string after its opening quote


def loads_deep(text: str, kept_levels: int = DEEP_JSON_KEPT_LEVELS) -> Any:
    """`json.loads(text)`, also for JSON nested deeper than json.loads itself parses.

    json.loads raises RecursionError at about 1,000 levels (fewer the deeper the caller's own
    stack is). Then the text is read again with every object or array deeper than
    `kept_levels` replaced by its JSON text (a string, as `pb.clipped` does), so the result
    is still deeper than `pb.MAX_JSON_DEPTH` (29) and the loop gives a model's tool call with
    such an input its usual error result ("Invalid input … nested deeper than 29 levels"),
    while the value stays shallow enough for repr, json.dumps and `pb.clipped`. One linear
    pass over the text (strings are skipped by a regular expression); a part kept as text is
    only checked for balanced brackets. Raises ValueError (json.JSONDecodeError) for text that
    is not JSON, never RecursionError.
    """
    try:
        return json.loads(text)
    except RecursionError:
        pass
    parts: list[str] = []
    depth, copied, start, pos = 0, 0, 0, 0
    while (found := _STRUCTURAL.search(text, pos)) is not None:
        at, char = found.start(), found.group()
        pos = at + 1
        if char == '"':
            rest = _STRING_REST.match(text, pos)
            if rest is None:
                raise ValueError("JSON text has an unterminated string")
            pos = rest.end()
        elif char in "[{":
            depth += 1
            if depth == kept_levels + 1:
                start = at
        else:
            if depth == kept_levels + 1:
                parts += [text[copied:start], json.dumps(text[start:pos], ensure_ascii=False)]
                copied = pos
            depth -= 1
    parts.append(text[copied:])
    try:
        return json.loads("".join(parts))
    except RecursionError:  # brackets that never close: not JSON
        raise ValueError("JSON text is nested too deep and does not close") from None


def parse_arguments(raw: str, provider_id: str = "") -> tuple[dict[str, Any], str]:
    """A tool call's JSON `arguments` text as (object, ""), or ({}, why it is not one) for
    invalid or non-object JSON (`base.arguments_of`); empty text is ({}, "").

    Arguments nested deeper than json.loads parses (about 1,000 levels) are read by `loads_deep`
    (deep parts as their JSON text), so the loop gives the call its "nested deeper than 29
    levels" error result instead of crashing the run with RecursionError. Text that is no JSON
    is logged (its length and `provider_id`, never the text).
    """
    if not raw.strip():
        return {}, ""
    try:
        value = loads_deep(raw)
    except ValueError:
        log.warning(
            "tool call arguments are not valid JSON",
            extra={"fields": {"provider": provider_id, "length": len(raw)}},
        )
        return {}, "the arguments are not valid JSON"
    return arguments_of(value)
