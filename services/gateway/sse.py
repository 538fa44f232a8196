"""The one SSE encoder: a run `Event` rendered as the spec's frame, `data: <json>\\n\\n`.

Frames have no `event:` line; clients discriminate on the JSON `type` field. Payload
keys follow the spec's table "Events emitted during a turn"; timestamps are ISO 8601
UTC with offset.
"""

from __future__ import annotations

from typing import Any

import orjson

from loopline.assistant.v1 import events_pb2
from services.common import pb

HEARTBEAT_FRAME = b'data: {"type":"heartbeat"}\n\n'


def _output(message: Any, outputs: dict[bytes, Any] | None) -> Any:
    """The `output` of a ToolResultEvent or ToolCallRecord for the frame: its `output_json` as it
    is (an orjson.Fragment: written into the frame without being parsed or encoded again, keys
    in the tool's order), or, for an event of an older version, `pb.from_value(output)`,
    memoized in `outputs` by the Value's deterministic wire bytes (equal bytes, equal JSON
    value): a run's `done` frame repeats the outputs its `tool_result` frames carried. Such an
    object's key order is that of the first conversion (a Struct has no key order of its own)."""
    if message.output_json:
        return orjson.Fragment(message.output_json)
    value = message.output
    if outputs is None:
        return pb.from_value(value)
    key = value.SerializeToString(deterministic=True)  # map keys sorted: equal content, equal bytes
    if key in outputs:
        return outputs[key]
    result = outputs[key] = pb.from_value(value)
    return result


def _input(message: Any) -> Any:
    """The `input` of a ToolCallEvent or ToolCallRecord for the frame: its `input_json` as it is
    (the model's JSON), or, for an event of an older version, its `input` Struct."""
    if message.input_json:
        return orjson.Fragment(message.input_json)
    return pb.from_struct(message.input)


def _tool_calls(records: Any, outputs: dict[bytes, Any] | None) -> list[dict[str, Any]]:
    return [{"tool": r.tool, "input": _input(r), "output": _output(r, outputs)} for r in records]


def render(event: events_pb2.Event, outputs: dict[bytes, Any] | None = None) -> dict[str, Any]:
    """The frame object {"type": ..., "data": {...}} of `event`.

    `outputs`, when given, is a per-run memo of converted tool outputs (see `_output`); the
    objects it holds are shared between frames and must not be mutated.
    """
    kind = event.WhichOneof("payload")
    if kind == "response_chunk":
        data: dict[str, Any] = {"chunk": event.response_chunk.chunk}
    elif kind == "tool_call":
        call = event.tool_call
        data = {
            "tool": call.tool,
            "input": _input(call),
            "tool_call_id": call.tool_call_id,
            "timestamp": pb.iso(event.time),
        }
    elif kind == "tool_result":
        result = event.tool_result
        data = {
            "tool": result.tool,
            "tool_call_id": result.tool_call_id,
            "output": _output(result, outputs),
            "timestamp": pb.iso(event.time),
        }
    elif kind == "metadata":
        metadata = event.metadata
        data = {
            "run_id": metadata.run_id,
            "thread_id": metadata.thread_id,
            "workflow_id": None,
            "workflow_type": metadata.workflow_type,
            "timestamp": pb.iso(event.time),
        }
    elif kind == "done":
        done = event.done
        usage = done.usage
        data = {
            "response": done.response,
            "has_workflow_changes": False,
            "tool_calls": _tool_calls(done.tool_calls, outputs),
            "workflow_tool": None,
            "usage": {
                "input_tokens": usage.input_tokens,
                "output_tokens": usage.output_tokens,
                "total_tokens": usage.total_tokens,
                "llm_calls": usage.llm_calls,
            },
        }
        if done.error:
            data["error"] = True
    elif kind == "guidance":
        guidance = event.guidance
        data = {"message": guidance.message}
        if guidance.HasField("consecutive_failures"):
            data["consecutive_failures"] = guidance.consecutive_failures
        if guidance.HasField("total_llm_calls"):
            data["total_llm_calls"] = guidance.total_llm_calls
    elif kind == "user_input_request":
        # its `request_json` as it is (keys in their order, numbers exact), else an older
        # event's Struct
        data = pb.field_fragment(event.user_input_request, "request")
        if data is None:
            data = {}
    elif kind == "interrupted":
        data = {"request_id": event.interrupted.request_id, "kind": event.interrupted.kind}
    elif kind == "run_resumed":
        data = {"new_run_id": event.run_resumed.new_run_id}
    elif kind == "error":
        data = {"message": event.error.message}
    elif kind == "cancelled":
        data = {"reason": event.cancelled.reason}
    else:
        data = {}
    return {"type": kind, "data": data}


def encode(event: events_pb2.Event, outputs: dict[bytes, Any] | None = None) -> bytes:
    """The SSE frame bytes of `event`: `data: <json>\\n\\n` (`outputs`: see `render`)."""
    return b"data: " + orjson.dumps(render(event, outputs)) + b"\n\n"
