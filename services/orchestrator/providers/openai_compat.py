"""OpenAI-compatible chat completions through the official `openai` SDK.

One class serves OpenAI itself and every server that speaks the chat-completions wire
format (vLLM, Ollama, llama.cpp's server, ...): only the base URL, the key and the model
id differ. A call streams (`stream=True`, `stream_options.include_usage`), forwards each
text delta to `on_text`, assembles tool calls from deltas that may be split across
chunks (keyed by `index`), passes the profile's tools as function schemas with
`parallel_tool_calls=False`, and reads usage from the final usage chunk.

Usage mapping (billing's rule: input counts uncached input only):
`input_tokens = prompt_tokens - prompt_tokens_details.cached_tokens`,
`cache_read_tokens = cached_tokens`, `output_tokens = completion_tokens`.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import openai

from services.orchestrator.providers.base import (
    ModelReply,
    OnText,
    ReportedUsage,
    TokenUsage,
    ToolCallRequest,
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


def _json_text(value: Any) -> str:
    return (
        value
        if isinstance(value, str)
        else json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    )


def to_openai_messages(messages: list[dict[str, Any]], system_prompt: str) -> list[dict[str, Any]]:
    """The provider-neutral thread (see base.py) as chat-completions messages.

    The system prompt comes first; an assistant message's tool calls become
    `tool_calls` with JSON-string `arguments`; a tool result becomes a `tool` message with
    its `tool_call_id` and JSON-string content; guidance and summaries stay `system`.
    """
    out: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}]
    for message in messages:
        role = message.get("role")
        if role == "assistant":
            calls = message.get("tool_calls") or []
            item: dict[str, Any] = {"role": "assistant", "content": message.get("content") or None}
            if calls:
                item["tool_calls"] = [
                    {
                        "id": c["id"],
                        "type": "function",
                        "function": {
                            "name": c["name"],
                            "arguments": _json_text(c.get("input") or {}),
                        },
                    }
                    for c in calls
                ]
            elif item["content"] is None:
                item["content"] = ""
            out.append(item)
        elif role == "tool":
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": message["tool_call_id"],
                    "content": _json_text(message.get("content")),
                }
            )
        elif role in ("user", "system"):
            out.append({"role": role, "content": _json_text(message.get("content") or "")})
    return out


def to_openai_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`{"name", "description", "input_schema"}` tools as chat-completions function tools."""
    return [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t.get("description") or "",
                "parameters": t.get("input_schema") or {"type": "object", "properties": {}},
            },
        }
        for t in tools
    ]


@dataclass
class _Attempt:
    """What one streamed attempt produced so far."""

    opened: bool = False
    emitted: bool = False
    received: bool = False  # the stream delivered at least one chunk
    cancelled: bool = False  # the call was cancelled during this attempt
    text: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    model: str = ""  # the model that answered, as the chunks name it
    reported: ReportedUsage | None = None

    def usage(self, input_estimate: int) -> TokenUsage:
        """Reported usage; else an estimate once the stream delivered a chunk (or the call was
        cancelled while the request was accepted); else nothing (an attempt that streamed
        nothing is not billed)."""
        if self.reported is None and (not self.opened or not (self.received or self.cancelled)):
            return TokenUsage()
        produced = "".join(self.text) + "".join(c["args"] for c in self.calls.values())
        output_estimate = estimate_tokens(produced) if produced else 0
        if self.reported is not None:  # a count it reported that is no token count: estimated
            return with_estimates(self.reported, input_estimate, output_estimate)
        return TokenUsage(
            input_tokens=input_estimate, output_tokens=output_estimate, estimated=True
        )


class OpenAICompatModel:
    """A chat model behind an OpenAI-compatible `/chat/completions` endpoint.

    Args:
        provider_id: the provider's id in `llm` ("openai", or a configured compatible one).
        model_id: the model id sent to the server.
        base_url: the API base URL (e.g. "https://api.openai.com/v1", "http://127.0.0.1:11434/v1").
        api_key: the key sent as `Authorization: Bearer` (the platform's or the org's own).
        policy: retry bounds (see retry.py).
        timeout_s: per-request timeout in seconds (connect, and between streamed chunks).
        max_connections: streamed calls in flight to this server at most (ClientSpec).
        system_prompt: the stable system prompt.
        clients: the orchestrator's kept SDK clients (clients.py); None: a client per call.

    Attributes:
        partial_usage: the tokens of the latest call so far, also when it was cancelled.
    """

    def __init__(
        self,
        provider_id: str,
        model_id: str,
        *,
        base_url: str,
        api_key: str,
        policy: RetryPolicy,
        timeout_s: float = 120.0,
        max_connections: int = MAX_CONNECTIONS,
        system_prompt: str = ASSISTANT_SYSTEM_PROMPT,
        clients: ProviderClients | None = None,
    ) -> None:
        self.provider_id = provider_id
        self.model_id = model_id
        self._spec = ClientSpec("openai", base_url, api_key, timeout_s, max_connections)
        self._clients = clients if clients is not None else ProviderClients(max_clients=0)
        self._policy = policy
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
        """Stream one chat completion; see the module docstring. `call_tools=False`: OpenAI itself
        gets the tools with `tool_choice: "none"` (base.ChatModel.generate: the same cached
        prefix); another OpenAI-compatible server gets no tools, as before (chat completions
        take tool calls in the history without them, and not every server takes "none").

        Raises:
            ModelError: after the retries of retry.py, with the usage accrued (reported or
                estimated).
            asyncio.CancelledError: the HTTP stream is closed before it propagates.
        """
        wire_messages = to_openai_messages(messages, self._system_prompt)
        request: dict[str, Any] = {
            "model": self.model_id,
            "messages": wire_messages,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if not call_tools and self.provider_id != "openai":
            tools = []
        if tools:
            request["tools"] = to_openai_tools(tools)
            if call_tools:
                request["parallel_tool_calls"] = False
            else:
                request["tool_choice"] = "none"
        input_estimate = estimate_tokens(json.dumps(wire_messages)) + (
            estimate_tokens(json.dumps(request["tools"])) if tools else 0
        )
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
                c["id"] or f"call_{uuid.uuid4().hex[:24]}",
                c["name"],
                *parse_arguments(c["args"], self.provider_id),
            )
            for _, c in sorted(done.calls.items())
            if c["name"]
        ]
        nameless = sum(1 for c in done.calls.values() if not c["name"])
        if nameless:  # nothing to run or to answer: dropped, but never silently
            log.warning(
                "tool calls without a name were dropped",
                extra={"fields": {"provider": self.provider_id, "count": nameless}},
            )
        return ModelReply(
            text="".join(done.text),
            tool_calls=calls,
            usage=total,
            finish_reasons=[done.finish_reason] if done.finish_reason else [],
            response_model=done.model,
        )

    async def _stream_once(self, request: dict[str, Any], state: _Attempt, on_text: OnText) -> None:
        async with self._clients.lease(self._spec, new_client) as client:
            # The SDK's documented request for any path, not `chat.completions.create`: that
            # walks the whole request against its typed parameters (~1 ms a call with a long
            # history), and builds a typed chunk per chunk (~100 µs); the request here is
            # already JSON, and each chunk is read as the JSON object it is.
            stream = await client.post(
                "/chat/completions",
                body=request,
                cast_to=object,
                options={"security": {"bearer_auth": True}},
                stream=True,
                stream_cls=openai.AsyncStream[object],
            )
            state.opened = True
            async with stream:
                async for chunk in stream:
                    state.received = True
                    model = _get(chunk, "model")
                    state.model = model if isinstance(model, str) and model else state.model
                    usage = _get(chunk, "usage")
                    if usage is not None:
                        state.reported = _usage_of(usage)
                    for choice in _list(_get(chunk, "choices")):
                        delta = _get(choice, "delta")
                        content = _get(delta, "content")
                        if isinstance(content, str) and content:
                            state.text.append(content)
                            state.emitted = True
                            await on_text(content)
                        for position, piece in enumerate(_list(_get(delta, "tool_calls"))):
                            _add_call_piece(state.calls, position, piece)
                        finish = _get(choice, "finish_reason")
                        if isinstance(finish, str) and finish:
                            state.finish_reason = finish
        if state.finish_reason is None:
            raise IncompleteStream("the stream ended without a finish reason")


def _get(value: Any, key: str) -> Any:
    """`value[key]` when `value` is a JSON object, else None: a chunk is read as the server sent
    it, and a part of the wrong type counts as absent."""
    return value.get(key) if isinstance(value, dict) else None


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _add_call_piece(calls: dict[int, dict[str, Any]], position: int, piece: Any) -> None:
    """Add one streamed tool-call delta to `calls` (keyed by its `index`, else its position)."""
    index = _get(piece, "index")
    index = index if isinstance(index, int) else position
    call = calls.setdefault(index, {"id": "", "name": "", "args": ""})
    call_id = _get(piece, "id")
    if isinstance(call_id, str) and call_id:
        call["id"] = call_id
    function = _get(piece, "function")
    name = _get(function, "name")
    # OpenAI sends the name once; some compatible servers split it across deltas, others repeat
    # it whole in every delta: append, but not a repeat
    if isinstance(name, str) and name and name != call["name"]:
        call["name"] += name
    arguments = _get(function, "arguments")
    if arguments is not None and arguments != "":
        # a string per the API; an object or a number instead is read as that JSON (a
        # non-object: the call's error result, never a crashed run)
        call["args"] += arguments if isinstance(arguments, str) else json.dumps(arguments)


def new_client(spec: ClientSpec) -> openai.AsyncOpenAI:
    """The SDK client of `spec`: its own retries off (retry.py is the only rule)."""
    return openai.AsyncOpenAI(
        api_key=spec.api_key,
        base_url=spec.base_url,
        max_retries=0,
        timeout=spec.timeout_s,
        http_client=new_http_client(openai, spec),
    )


def _usage_of(usage: Any) -> ReportedUsage:
    """The reported counts as given (a null, negative or non-integer one is left for
    `with_estimates` to replace); input tokens are the prompt's without its cached ones."""
    prompt = _get(usage, "prompt_tokens")
    cached = _get(_get(usage, "prompt_tokens_details"), "cached_tokens") or 0
    cached = (
        cached if isinstance(cached, int) and not isinstance(cached, bool) and 0 <= cached else 0
    )
    fresh = (
        prompt - cached
        if isinstance(prompt, int) and not isinstance(prompt, bool) and prompt >= cached
        else prompt
    )
    return ReportedUsage(
        input_tokens=fresh,
        output_tokens=_get(usage, "completion_tokens"),
        cache_read_tokens=cached,
    )
