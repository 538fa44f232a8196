"""Conversions between JSON values and protobuf's Struct/Value/Timestamp."""

from __future__ import annotations

import contextlib
import datetime
import math
from typing import Any

from google.protobuf import json_format, struct_pb2, timestamp_pb2


def to_struct(data: dict[str, Any] | None) -> struct_pb2.Struct:
    """A Struct holding the JSON object `data` (empty for None)."""
    struct = struct_pb2.Struct()
    if data:
        struct.update(data)
    return struct


def to_value(data: Any) -> struct_pb2.Value:
    """A Value holding any JSON value (dict, list/tuple, str, int, float, bool, None).

    The same result and errors as `json_format.ParseDict(data, Value())` (ParseError for a
    value of another type), built directly: ParseDict's generic walk costs several times more
    CPU per call, and every tool result goes through here.
    """
    value = struct_pb2.Value()
    with contextlib.suppress(Exception):  # ParseDict below raises its own error for the same input
        if _fill_value(value, data):
            return value
    value = struct_pb2.Value()
    json_format.ParseDict(data, value)
    return value


def from_struct(struct: struct_pb2.Struct) -> dict[str, Any]:
    """The JSON object in `struct` (integral numbers come back as int).

    The same result and errors as `json_format.MessageToDict` (ValueError for an infinite
    or NaN number) followed by the int rule, without the generic walk.
    """
    try:
        return {key: _json_of(item) for key, item in struct.fields.items()}
    except _Unsupported:
        return _ints(json_format.MessageToDict(struct))


def from_value(value: struct_pb2.Value) -> Any:
    """The JSON value in `value` (None when unset; integral numbers come back as int)."""
    if value.WhichOneof("kind") is None:
        return None
    try:
        return _json_of(value)
    except _Unsupported:
        return _ints(json_format.MessageToDict(value))


class _Unsupported(Exception):
    """A Value the direct conversion leaves to json_format (an infinite or NaN number)."""


def _fill_value(message: struct_pb2.Value, data: Any) -> bool:
    # Mirrors json_format's _ConvertValueMessage; False (nothing raised) for what it would refuse.
    if isinstance(data, dict):
        struct = message.struct_value
        struct.Clear()  # marks the struct set even when empty, as ParseDict does
        fields = struct.fields
        for key, item in data.items():
            if not isinstance(key, str) or not _fill_value(fields[key], item):
                return False
        return True
    if isinstance(data, (list, tuple)):
        values = message.list_value
        values.ClearField("values")
        for item in data:
            if not _fill_value(values.values.add(), item):
                return False
        return True
    if data is None:
        message.null_value = 0
    elif isinstance(data, bool):
        message.bool_value = data
    elif isinstance(data, str):
        message.string_value = data
    elif isinstance(data, (int, float)):
        message.number_value = data
    else:
        return False
    return True


def _json_of(value: struct_pb2.Value) -> Any:
    # Mirrors json_format's _ValueMessageToJsonObject, then `_ints`.
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return value.string_value
    if kind == "number_value":
        number = value.number_value
        if math.isnan(number) or math.isinf(number):
            raise _Unsupported
        return int(number) if number.is_integer() and abs(number) < 2**53 else number
    if kind == "struct_value":
        return {key: _json_of(item) for key, item in value.struct_value.fields.items()}
    if kind == "list_value":
        return [_json_of(item) for item in value.list_value.values]
    if kind == "bool_value":
        return value.bool_value
    return None  # null_value, or unset


def _ints(data: Any) -> Any:
    # Struct stores every number as a double; give integral ones back as int so that
    # {"count": 2} survives a round trip unchanged.
    if isinstance(data, float) and data.is_integer() and abs(data) < 2**53:
        return int(data)
    if isinstance(data, dict):
        return {k: _ints(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_ints(v) for v in data]
    return data


def timestamp(moment: datetime.datetime | None = None) -> timestamp_pb2.Timestamp:
    """A Timestamp of `moment` (now when None)."""
    ts = timestamp_pb2.Timestamp()
    ts.FromDatetime(moment or datetime.datetime.now(datetime.UTC))
    return ts


_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
_MIN_SECONDS, _MAX_SECONDS = -62135596800, 253402300799  # 0001-01-01T00:00:00Z .. 9999-12-31T23:59:59Z (protobuf's range)
_SECONDS_TEXT: dict[int, str] = {}  # whole seconds -> "YYYY-MM-DDTHH:MM:SS"; a run's events share a few seconds


def iso(ts: timestamp_pb2.Timestamp | datetime.datetime | None) -> str | None:
    """ISO 8601 UTC with offset, e.g. "2026-06-20T10:00:01.123456+00:00" (None when unset;
    microseconds truncated, omitted when zero, as `datetime.isoformat`).

    A Timestamp inside protobuf's valid range is rendered without a datetime per call: the
    date and time of each whole second are rendered once and cached (the SSE encoder renders
    one per frame; issue 9). Outside the range, ValueError as `Timestamp.ToDatetime` raises it.
    """
    if ts is None:
        return None
    if isinstance(ts, timestamp_pb2.Timestamp):
        seconds, nanos = ts.seconds, ts.nanos
        if seconds == 0 and nanos == 0:
            return None
        if _MIN_SECONDS <= seconds <= _MAX_SECONDS and 0 <= nanos < 1_000_000_000:
            text = _SECONDS_TEXT.get(seconds)
            if text is None:
                if len(_SECONDS_TEXT) >= 4096:
                    _SECONDS_TEXT.clear()
                text = _SECONDS_TEXT[seconds] = (_EPOCH + datetime.timedelta(seconds=seconds)).isoformat()[:19]
            micros = nanos // 1000
            return f"{text}.{micros:06d}+00:00" if micros else text + "+00:00"
        moment = ts.ToDatetime(tzinfo=datetime.UTC)
    else:
        moment = ts if ts.tzinfo else ts.replace(tzinfo=datetime.UTC)
    return moment.astimezone(datetime.UTC).isoformat()
