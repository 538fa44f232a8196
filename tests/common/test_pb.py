"""services/common/pb.py: JSON depth counting, conversion errors, sorted keys, strict parsing.

Python protobuf (upb) encodes any depth but decodes at most 100 message levels, 3 per JSON
object level inside a Struct; one level past MAX_WIRE_DEPTH at the deepest place does not
decode. The depth rule at every layer: tests/common/test_json_depth.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from loopline.assistant.v1 import assistant_pb2, events_pb2
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


def test_a_part_too_deep_even_for_json_dumps_becomes_a_marker():
    value = {"a": nested_lists(5000)}
    assert pb.from_struct(pb.to_struct(value, clip=True, max_depth=1)) == {"a": pb.CLIPPED_TOO_DEEP}
    assert pb.clipped(value, 1) == {"a": pb.CLIPPED_TOO_DEEP}


def test_other_errors_are_unchanged():
    with pytest.raises(json_format.ParseError):
        pb.to_value({"a": object()})
    with pytest.raises(ValueError, match="Unexpected type"):
        pb.to_struct({"a": object()})
    non_string_key: dict[Any, Any] = {1: "x"}
    with pytest.raises(TypeError):
        pb.to_struct(non_string_key)
    assert pb.to_struct(None) == pb.to_struct({}) and len(pb.to_struct({}).fields) == 0


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
    # a frame replayed by another process lists a Struct's keys in the same (sorted) order
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
