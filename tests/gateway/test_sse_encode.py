"""The SSE encoder's timestamps: `pb.iso`'s cached rendering of a Timestamp is exactly the
datetime's ISO 8601 text (UTC with offset, microseconds truncated and omitted when zero), and
only the frames whose payload carries a timestamp render one (spec: "Events emitted during a
turn")."""

from __future__ import annotations

import datetime

import orjson
import pytest
from google.protobuf import timestamp_pb2
from hypothesis import given
from hypothesis import strategies as st

from loopline.assistant.v1 import events_pb2
from services.common import pb
from services.gateway import sse


def _reference(ts: timestamp_pb2.Timestamp) -> str | None:
    """The text through a datetime (what pb.iso rendered before its per-second cache)."""
    if ts.seconds == 0 and ts.nanos == 0:
        return None
    return ts.ToDatetime(tzinfo=datetime.UTC).astimezone(datetime.UTC).isoformat()


@given(seconds=st.integers(-62135596800, 253402300799), nanos=st.integers(0, 999_999_999))
def test_iso_is_the_datetime_text_over_protobufs_range(seconds: int, nanos: int) -> None:
    ts = timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos)
    assert pb.iso(ts) == _reference(ts)


@pytest.mark.parametrize(
    ("seconds", "nanos"),
    [
        (0, 0),
        (0, 1),
        (0, 999),
        (0, 1000),
        (1, 0),
        (-1, 500_000_000),
        (1_780_000_000, 123_456_789),
        (-62135596800, 0),
        (253402300799, 999_999_999),
    ],
)
def test_iso_edges(seconds: int, nanos: int) -> None:
    ts = timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos)
    assert pb.iso(ts) == _reference(ts)


@pytest.mark.parametrize(
    ("seconds", "nanos"), [(253402300800, 0), (-62135596801, 0), (5, -1), (5, 1_000_000_000)]
)
def test_iso_out_of_range_raises_like_the_datetime_conversion(seconds: int, nanos: int) -> None:
    ts = timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos)
    with pytest.raises(ValueError):
        pb.iso(ts)
    with pytest.raises(ValueError):
        _reference(ts)


def test_frames_with_a_timestamp_render_the_events_time() -> None:
    ts = timestamp_pb2.Timestamp(seconds=1_780_000_000, nanos=5_000)
    event = events_pb2.Event(
        seq=1, run_id="run", time=ts, tool_call=events_pb2.ToolCallEvent(tool="t", tool_call_id="c")
    )
    assert (
        sse.render(event)["data"]["timestamp"] == pb.iso(ts) == "2026-05-28T20:26:40.000005+00:00"
    )
    chunk = events_pb2.Event(
        seq=2, run_id="run", time=ts, response_chunk=events_pb2.ResponseChunkEvent(chunk="x")
    )
    assert sse.encode(chunk) == b'data: {"type":"response_chunk","data":{"chunk":"x"}}\n\n'


def test_done_frame_reuses_the_runs_converted_tool_outputs_and_renders_the_same_bytes() -> None:
    output = {
        "integrations": [{"name": f"i{i}", "actions": ["a", "b"], "count": i} for i in range(5)],
        "count": 5,
    }
    result = events_pb2.Event(
        seq=3,
        run_id="run",
        time=timestamp_pb2.Timestamp(seconds=1_780_000_000),
        tool_result=events_pb2.ToolResultEvent(
            tool="t", tool_call_id="c", output=pb.to_value(output)
        ),
    )
    done = events_pb2.Event(seq=4, run_id="run", done=events_pb2.DoneEvent(response="ok"))
    done.done.tool_calls.add(tool="t", input=pb.to_struct({"q": 1}), output=pb.to_value(output))
    done.done.tool_calls.add(tool="t", input=pb.to_struct({}), output=pb.to_value({"other": True}))
    outputs: dict[bytes, object] = {}
    assert sse.encode(result, outputs) == sse.encode(result)
    # The same JSON value (a Struct's key order is its map's iteration order either way).
    assert orjson.loads(sse.encode(done, outputs)[6:]) == orjson.loads(sse.encode(done)[6:])
    frame = sse.render(done, outputs)
    assert frame["data"]["tool_calls"][0]["output"] == output and frame["data"]["tool_calls"][1][
        "output"
    ] == {"other": True}
    assert (
        frame["data"]["tool_calls"][0]["output"] is sse.render(result, outputs)["data"]["output"]
    )  # converted once
    assert len(outputs) == 2


def test_a_tool_output_as_json_text_goes_into_the_frames_byte_for_byte() -> None:
    """`output_json` (the tools service's JSON text) is written into the tool_result and done
    frames as it is: not parsed, not encoded again, keys in the tool's own order."""
    raw = b'{"zeta":1,"alpha":[1.5,null,"\xc3\xa9"],"count":2}'
    result = events_pb2.Event(
        seq=3,
        run_id="run",
        time=timestamp_pb2.Timestamp(seconds=1_780_000_000),
        tool_result=events_pb2.ToolResultEvent(tool="t", tool_call_id="c", output_json=raw),
    )
    done = events_pb2.Event(seq=4, run_id="run", done=events_pb2.DoneEvent(response="ok"))
    done.done.tool_calls.add(tool="t", input=pb.to_struct({"q": 1}), output_json=raw)
    outputs: dict[bytes, object] = {}
    frame = sse.encode(result, outputs)
    assert b'"output":' + raw + b',"timestamp"' in frame
    assert b'"output":' + raw + b"}]" in sse.encode(done, outputs)
    assert orjson.loads(frame[6:])["data"]["output"] == {
        "zeta": 1,
        "alpha": [1.5, None, "é"],
        "count": 2,
    }
    assert outputs == {}  # nothing to convert
