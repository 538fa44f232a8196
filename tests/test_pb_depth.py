"""The nesting-depth rule of JSON crossing service boundaries (services/common/pb.py).

Python protobuf (upb) encodes any depth but decodes at most 100 message levels, 3 per JSON
object level inside a Struct. These tests pin the derivation of MAX_WIRE_DEPTH and
MAX_JSON_DEPTH to the real messages: every place a JSON value travels decodes at its limit,
and the deepest place would not with one level more.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from loopline.assistant.v1 import assistant_pb2, events_pb2
from loopline.tools.v1 import tools_pb2
from services.common import pb


def deep(levels: int, leaf: Any = "x") -> Any:
    """`levels` objects nested in one another around `leaf` (the costliest shape per level)."""
    value = leaf
    for _ in range(levels):
        value = {"a": value}
    return value


def nested_lists(levels: int) -> list:
    value: list = []
    for _ in range(levels - 1):
        value = [value]
    return value


def _round_trip(message: Any) -> Any:
    return type(message).FromString(message.SerializeToString())


def test_json_depth_counts_objects_and_arrays_and_stops_early():
    assert [
        pb.json_depth(v) for v in ("x", 1, None, {}, [], [1], {"a": 1}, {"a": [1, {"b": {}}]})
    ] == [0, 0, 0, 1, 1, 1, 1, 4]
    assert pb.json_depth(deep(50)) == 50
    assert pb.json_depth(deep(50), limit=10) == 11  # the first level past the limit
    assert pb.json_depth(nested_lists(100_000)) == 100_000  # iterative: no recursion limit


@pytest.mark.parametrize("convert", [pb.to_struct, pb.to_value])
def test_to_struct_and_to_value_refuse_json_deeper_than_the_limit(convert):
    assert pb.from_struct(pb.to_struct(deep(pb.MAX_JSON_DEPTH))) == deep(pb.MAX_JSON_DEPTH)
    assert pb.from_value(pb.to_value(deep(pb.MAX_JSON_DEPTH))) == deep(pb.MAX_JSON_DEPTH)
    for too_deep in (
        deep(pb.MAX_JSON_DEPTH + 1),
        {"k": nested_lists(pb.MAX_JSON_DEPTH)},
        deep(5000),
    ):
        with pytest.raises(
            pb.JsonTooDeep, match=f"nested deeper than {pb.MAX_JSON_DEPTH} levels"
        ) as raised:
            convert(too_deep)
        assert isinstance(raised.value, ValueError) and raised.value.limit == pb.MAX_JSON_DEPTH
    with pytest.raises(pb.JsonTooDeep, match="deeper than 3 levels"):
        convert(deep(4), max_depth=3)


def test_clip_replaces_the_deeper_parts_by_their_json_text():
    value = {"keep": [1, {"b": True}], "deep": deep(60, leaf=[1.5, None, "é"])}
    clipped = pb.clipped(value)
    assert pb.json_depth(clipped) == pb.MAX_JSON_DEPTH
    assert pb.from_struct(pb.to_struct(value, clip=True)) == clipped
    assert pb.from_value(pb.to_value(value, clip=True)) == clipped
    assert clipped["keep"] == value["keep"]
    text, kept = clipped["deep"], 0
    while isinstance(text, dict):
        text, kept = text["a"], kept + 1
    assert kept == pb.MAX_JSON_DEPTH - 1  # levels 2 .. MAX_JSON_DEPTH (the value itself is level 1)
    assert json.loads(text) == deep(60 - kept, leaf=[1.5, None, "é"])
    assert pb.clipped(value, 1) == {
        "keep": json.dumps([1, {"b": True}], separators=(",", ":")),
        "deep": json.dumps(value["deep"], separators=(",", ":"), ensure_ascii=False),
    }
    shallow = {"a": [1, 2], "b": "x"}
    assert (
        pb.clipped(shallow) == shallow
        and pb.from_struct(pb.to_struct(shallow, clip=True)) == shallow
    )


def test_a_part_too_deep_even_for_json_dumps_becomes_a_marker():
    value = {"a": nested_lists(5000)}
    assert pb.from_struct(pb.to_struct(value, clip=True, max_depth=1)) == {"a": pb.CLIPPED_TOO_DEEP}
    assert pb.clipped(value, 1) == {"a": pb.CLIPPED_TOO_DEEP}


def test_other_errors_are_unchanged():
    with pytest.raises(json_format.ParseError):
        pb.to_value({"a": object()})
    with pytest.raises(ValueError, match="Unexpected type"):
        pb.to_struct({"a": object()})
    with pytest.raises(TypeError):
        pb.to_struct({1: "x"})
    assert pb.to_struct(None) == pb.to_struct({}) and len(pb.to_struct({}).fields) == 0


def test_every_place_json_travels_decodes_at_its_limit():
    at_limit = deep(pb.MAX_JSON_DEPTH)
    struct, value = pb.to_struct(at_limit), pb.to_value(at_limit)
    # the wrapping GetChat adds around a stored tool call's input (thinking), MAX_WIRE_DEPTH in all
    thinking = pb.to_struct(
        {"tool_calls": [{"id": "c", "name": "t", "input": at_limit}]}, max_depth=pb.MAX_WIRE_DEPTH
    )
    wire = deep(pb.MAX_WIRE_DEPTH)
    record = events_pb2.ToolCallRecord(
        tool="t",
        input=pb.to_struct(wire, max_depth=pb.MAX_WIRE_DEPTH),
        output=pb.to_value(wire, max_depth=pb.MAX_WIRE_DEPTH),
    )
    messages = [
        assistant_pb2.StreamRunResponse(
            events=[events_pb2.Event(done=events_pb2.DoneEvent(tool_calls=[record]))]
        ),
        assistant_pb2.StreamRunResponse(
            event=events_pb2.Event(tool_call=events_pb2.ToolCallEvent(input=struct))
        ),
        assistant_pb2.StreamRunResponse(
            event=events_pb2.Event(tool_result=events_pb2.ToolResultEvent(output=value))
        ),
        assistant_pb2.StreamRunResponse(
            event=events_pb2.Event(
                user_input_request=events_pb2.UserInputRequestEvent(request=struct)
            )
        ),
        assistant_pb2.GetChatResponse(
            chat=assistant_pb2.Chat(pending_user_input_request=struct),
            messages=[assistant_pb2.ChatMessage(content=value, thinking=thinking)],
        ),
        assistant_pb2.ResumeRequest(response=struct),
        tools_pb2.ExecuteToolRequest(input=struct),
        tools_pb2.ExecuteToolResponse(output=value),
        tools_pb2.CreateCredentialRequest(metadata=struct, auth_data=struct),
        tools_pb2.ListCredentialsResponse(credentials=[tools_pb2.Credential(metadata=struct)]),
        tools_pb2.ListMcpToolsResponse(tools=[tools_pb2.McpTool(input_schema=struct)]),
    ]
    for message in messages:
        assert _round_trip(message) == message


def test_one_level_past_max_wire_depth_does_not_decode_at_the_deepest_place():
    # the derivation is tight: StreamRunResponse -> Event -> DoneEvent -> ToolCallRecord -> Value
    past = pb.to_value(deep(pb.MAX_WIRE_DEPTH + 1), max_depth=100)
    record = events_pb2.ToolCallRecord()
    record.output.CopyFrom(past)
    response = assistant_pb2.StreamRunResponse()
    response.events.add().done.tool_calls.append(record)
    with pytest.raises(DecodeError):
        _round_trip(response)


def test_an_objects_keys_come_back_sorted_whatever_order_the_struct_was_built_in():
    # fresh-eyes test: a frame replayed by another process listed a Struct's keys in another order
    built = pb.to_struct({"zeta": 1, "alpha": {"y": [{"b": 1, "a": 2}], "x": None}, "mid": True})
    reparsed = type(built).FromString(built.SerializeToString())
    for struct in (built, reparsed):
        data = pb.from_struct(struct)
        assert list(data) == ["alpha", "mid", "zeta"] and list(data["alpha"]) == ["x", "y"]
        assert list(data["alpha"]["y"][0]) == ["a", "b"]
    assert list(pb.from_value(pb.to_value({"b": 1, "a": 2}))) == ["a", "b"]


@pytest.mark.parametrize(
    "text",
    [
        '{"a": NaN}',
        "[Infinity]",
        "-Infinity",
        '{"a": 1e400}',
        "[-1e400]",
        "[" * 5000 + "]" * 5000,
        "{",
    ],
)
def test_loads_strict_refuses_what_rfc_8259_does_not_call_json(text):
    with pytest.raises(ValueError):
        pb.loads_strict(text)


def test_loads_strict_reads_json_as_json_loads_does():
    assert pb.loads_strict(b'{"a": 1.5, "b": [1e308, -0.0, 9007199254740993], "c": "\\u00e9"}') == {
        "a": 1.5,
        "b": [1e308, -0.0, 9007199254740993],
        "c": "é",
    }
