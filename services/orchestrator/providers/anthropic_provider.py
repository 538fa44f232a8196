"""Anthropic Messages through the official `anthropic` SDK, with prompt caching.

A call streams (`stream=True`): `text_delta`s go to `on_text`, `tool_use` blocks are
assembled from their `input_json_delta`s, and usage comes from `message_start` (input and
cache tokens) and `message_delta` (cumulative output tokens).

Prompt caching: `cache_control: {"type": "ephemeral"}` breakpoints on the stable prefix
— the last tool definition and the system prompt (which holds no timestamp, see
prompt.py) — and on the history: the last block of the message before the newest one
(the older history, written by the previous call) and the last block of the newest
message (so the next step of the loop reads this whole thread from the cache). That is
4 breakpoints, Anthropic's maximum per request.

Usage mapping: `input_tokens` (uncached input) -> input_tokens,
`cache_read_input_tokens` -> cache_read_tokens, `cache_creation_input_tokens` ->
cache_write_tokens, `output_tokens` -> output_tokens.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import anthropic

from services.orchestrator.providers.base import (
    ModelReply,
    OnText,
    TokenUsage,
    ToolCallRequest,
    arguments_of,
    estimate_tokens,
    parse_arguments,
    with_estimates,
)
from services.orchestrator.providers.clients import (
    MAX_CONNECTIONS,
    ClientSpec,
    ProviderClients,
)
from services.orchestrator.providers.http_client import new_http_client
from services.orchestrator.providers.prompt import ASSISTANT_SYSTEM_PROMPT
from services.orchestrator.providers.retry import IncompleteStream, RetryPolicy, stream_with_retries

log = logging.getLogger(__name__)

EPHEMERAL = {"type": "ephemeral"}
NOTE_PREFIX = "[Note from the system] "


def _json_text(value: Any) -> str:
    return (
        value
        if isinstance(value, str)
        else json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    )


def _is_error(content: Any) -> bool:
    return isinstance(content, dict) and content.get("success") is False


def to_anthropic_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The provider-neutral thread (see base.py) as Messages-API messages with content blocks.

    Assistant text and tool calls become `text` and `tool_use` blocks; tool results become
    `tool_result` blocks of a user message (JSON-string content, `is_error` for a failed
    tool); guidance and summaries (`system` in the thread) become user text blocks
    prefixed "[Note from the system]", so the top-level system prompt never changes.
    Consecutive messages of one role are merged (the API wants user/assistant turns), and
    tool results always come first in their user message.
    """
    out: list[dict[str, Any]] = []

    def push(role: str, blocks: list[dict[str, Any]]) -> None:
        if not blocks:
            return
        if out and out[-1]["role"] == role:
            merged = out[-1]["content"] + blocks
            if role == "user":  # tool_result blocks must lead a user message
                merged = [b for b in merged if b["type"] == "tool_result"] + [
                    b for b in merged if b["type"] != "tool_result"
                ]
            out[-1]["content"] = merged
        else:
            out.append({"role": role, "content": list(blocks)})

    for message in messages:
        role = message.get("role")
        if role == "assistant":
            blocks: list[dict[str, Any]] = []
            if message.get("content"):
                blocks.append({"type": "text", "text": str(message["content"])})
            for call in message.get("tool_calls") or []:
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": call["id"],
                        "name": call["name"],
                        "input": call.get("input") or {},
                    }
                )
            if not blocks:
                blocks.append({"type": "text", "text": "(no answer)"})
            push("assistant", blocks)
        elif role == "tool":
            block = {
                "type": "tool_result",
                "tool_use_id": message["tool_call_id"],
                "content": _json_text(message.get("content")),
            }
            if _is_error(message.get("content")):
                block["is_error"] = True
            push("user", [block])
        elif role == "user":
            text = _json_text(message.get("content") or "")
            push("user", [{"type": "text", "text": text or "(empty)"}])
        elif role == "system":
            push(
                "user",
                [{"type": "text", "text": NOTE_PREFIX + _json_text(message.get("content") or "")}],
            )
    if out and out[0]["role"] != "user":
        out.insert(
            0, {"role": "user", "content": [{"type": "text", "text": "(conversation continues)"}]}
        )
    return out


def with_cache_breakpoints(
    system_prompt: str, tools: list[dict[str, Any]], messages: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(system, tools, messages) of a request with the cache breakpoints of the module docstring.

    Inputs are not modified. `tools` are `{"name", "description", "input_schema"}`;
    `messages` come from `to_anthropic_messages`.
    """
    system = [{"type": "text", "text": system_prompt, "cache_control": EPHEMERAL}]
    wire_tools = [
        {
            "name": t["name"],
            "description": t.get("description") or "",
            "input_schema": t.get("input_schema") or {"type": "object", "properties": {}},
        }
        for t in tools
    ]
    if wire_tools:
        wire_tools[-1]["cache_control"] = EPHEMERAL
    wire_messages = [
        {"role": m["role"], "content": [dict(b) for b in m["content"]]} for m in messages
    ]
    for index in (len(wire_messages) - 2, len(wire_messages) - 1):
        if index >= 0:
            wire_messages[index]["content"][-1]["cache_control"] = EPHEMERAL
    return system, wire_tools, wire_messages


@dataclass
class _Attempt:
    """What one streamed attempt produced so far."""

    opened: bool = False
    emitted: bool = False
    received: bool = False  # the stream delivered at least one event
    cancelled: bool = False  # the call was cancelled during this attempt
    finished: bool = False
    text: list[str] = field(default_factory=list)
    blocks: dict[int, dict[str, Any]] = field(default_factory=dict)
    started: TokenUsage | None = None  # from message_start
    model: str = ""  # the model that answered (message_start)
    stop_reason: str = ""  # why it stopped (message_delta)
    output_tokens: int | None = None  # cumulative, from message_delta

    def usage(self, input_estimate: int) -> TokenUsage:
        """Reported usage; output estimated when the stream broke before message_delta; an
        estimate when it broke before message_start but after another event (or was cancelled
        while the request was accepted); zero if it never opened or delivered no event (an
        attempt that streamed nothing is not billed)."""
        if not self.opened or (self.started is None and not (self.received or self.cancelled)):
            return TokenUsage()
        produced = "".join(self.text) + "".join(b.get("json", "") for b in self.blocks.values())
        estimated_output = estimate_tokens(produced) if produced else 0
        if self.started is None:
            return TokenUsage(
                input_tokens=input_estimate, output_tokens=estimated_output, estimated=True
            )
        usage = TokenUsage(
            input_tokens=self.started.input_tokens,
            cache_read_tokens=self.started.cache_read_tokens,
            cache_write_tokens=self.started.cache_write_tokens,
            output_tokens=self.started.output_tokens,
        )
        if self.output_tokens is not None:
            usage.output_tokens = self.output_tokens
        elif not self.finished:
            usage.output_tokens = (
                max(usage.output_tokens, estimated_output)
                if isinstance(usage.output_tokens, int)
                else estimated_output
            )
            usage.estimated = True
        # a count it reported that is no token count: estimated
        return with_estimates(usage, input_estimate, estimated_output)


class AnthropicModel:
    """A Claude model through the Anthropic Messages API.

    Args:
        model_id: e.g. "claude-sonnet-4-5".
        base_url: the API base URL (default deployment: "https://api.anthropic.com").
        api_key: the key sent as `x-api-key` (the platform's or the org's own).
        policy: retry bounds (see retry.py).
        max_tokens: the `max_tokens` of each call.
        timeout_s: per-request timeout in seconds (connect, and between streamed events).
        max_connections: streamed calls in flight to this server at most (ClientSpec).
        system_prompt: the stable system prompt.
        clients: the orchestrator's kept SDK clients (clients.py); None: a client per call.

    Attributes:
        partial_usage: the tokens of the latest call so far, also when it was cancelled.
    """

    provider_id = "anthropic"

    def __init__(
        self,
        model_id: str,
        *,
        base_url: str,
        api_key: str,
        policy: RetryPolicy,
        max_tokens: int = 4096,
        timeout_s: float = 120.0,
        max_connections: int = MAX_CONNECTIONS,
        system_prompt: str = ASSISTANT_SYSTEM_PROMPT,
        clients: ProviderClients | None = None,
    ) -> None:
        self.model_id = model_id
        self._spec = ClientSpec("anthropic", base_url, api_key, timeout_s, max_connections)
        self._clients = clients if clients is not None else ProviderClients(max_clients=0)
        self._policy = policy
        self._max_tokens = max_tokens
        self._system_prompt = system_prompt
        self.partial_usage = TokenUsage()

    async def generate(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        on_text: OnText,
        *,
        call_tools: bool = True,
    ) -> ModelReply:
        """Stream one Messages call; see the module docstring. `call_tools=False`: the tools are
        sent with `tool_choice: {"type": "none"}` (base.ChatModel.generate).

        Raises:
            ModelError: after the retries of retry.py, with the usage accrued (reported or
                estimated).
            asyncio.CancelledError: the HTTP stream is closed before it propagates.
        """
        system, wire_tools, wire_messages = with_cache_breakpoints(
            self._system_prompt, tools, to_anthropic_messages(messages)
        )
        request: dict[str, Any] = {
            "model": self.model_id,
            "max_tokens": self._max_tokens,
            "system": system,
            "messages": wire_messages,
            "stream": True,
        }
        if wire_tools:
            request["tools"] = wire_tools
            if not call_tools:
                request["tool_choice"] = {"type": "none"}
        input_estimate = estimate_tokens(json.dumps([system, wire_tools, wire_messages]))
        total = TokenUsage()
        self.partial_usage = total
        done = await stream_with_retries(
            self.provider_id,
            self._policy,
            _Attempt,
            lambda state: self._stream_once(request, state, on_text),
            total,
            input_estimate,
        )
        calls = [
            ToolCallRequest(
                b["id"],
                b["name"],
                *(
                    parse_arguments(b["json"], self.provider_id)
                    if b["json"]
                    else arguments_of(b["input"])
                ),
            )
            for _, b in sorted(done.blocks.items())
            if b["type"] == "tool_use"
        ]
        return ModelReply(
            text="".join(done.text),
            tool_calls=calls,
            usage=total,
            finish_reasons=[done.stop_reason] if done.stop_reason else [],
            response_model=done.model,
        )

    async def _stream_once(self, request: dict[str, Any], state: _Attempt, on_text: OnText) -> None:
        async with self._clients.lease(self._spec, new_client) as client:
            stream = await client.messages.create(**request)
            state.opened = True
            async with stream:
                async for event in stream:
                    state.received = True
                    kind = event.type
                    if kind == "message_start":
                        state.model = getattr(event.message, "model", None) or ""
                        usage = event.message.usage
                        # counts as reported; one that is no token count is estimated (usage())
                        state.started = TokenUsage(
                            input_tokens=usage.input_tokens,
                            output_tokens=usage.output_tokens or 0,
                            cache_read_tokens=int(usage.cache_read_input_tokens or 0),
                            cache_write_tokens=int(usage.cache_creation_input_tokens or 0),
                        )
                    elif kind == "content_block_start":
                        block = event.content_block
                        if block.type == "tool_use":
                            state.blocks[event.index] = {
                                "type": "tool_use",
                                "id": block.id,
                                "name": block.name,
                                "input": getattr(block, "input", None) or {},
                                "json": "",
                            }
                        else:
                            state.blocks[event.index] = {"type": block.type}
                            text = getattr(block, "text", "") if block.type == "text" else ""
                            if text:
                                state.text.append(text)
                                state.emitted = True
                                await on_text(text)
                    elif kind == "content_block_delta":
                        delta = event.delta
                        if delta.type == "text_delta" and delta.text:
                            state.text.append(delta.text)
                            state.emitted = True
                            await on_text(delta.text)
                        elif delta.type == "input_json_delta":
                            block = state.blocks.setdefault(
                                event.index,
                                {"type": "tool_use", "id": "", "name": "", "input": {}, "json": ""},
                            )
                            block["json"] = block.get("json", "") + (delta.partial_json or "")
                    elif kind == "message_delta":
                        state.stop_reason = getattr(event.delta, "stop_reason", None) or ""
                        usage = event.usage
                        if usage is not None:
                            state.output_tokens = usage.output_tokens
                            if state.started is not None:
                                if usage.input_tokens is not None:
                                    state.started.input_tokens = int(usage.input_tokens)
                                if usage.cache_read_input_tokens is not None:
                                    state.started.cache_read_tokens = int(
                                        usage.cache_read_input_tokens
                                    )
                                if usage.cache_creation_input_tokens is not None:
                                    state.started.cache_write_tokens = int(
                                        usage.cache_creation_input_tokens
                                    )
                    elif kind == "message_stop":
                        state.finished = True
        if not state.finished:
            raise IncompleteStream("the stream ended before message_stop")


def new_client(spec: ClientSpec) -> anthropic.AsyncAnthropic:
    """The SDK client of `spec`: its own retries off (retry.py is the only rule)."""
    return anthropic.AsyncAnthropic(
        api_key=spec.api_key,
        base_url=spec.base_url,
        max_retries=0,
        timeout=spec.timeout_s,
        http_client=new_http_client(anthropic, spec),
    )
