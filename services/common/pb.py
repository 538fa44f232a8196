"""Conversions between JSON values and protobuf's Struct/Value/Timestamp."""

from __future__ import annotations

import datetime
from typing import Any

from google.protobuf import json_format, struct_pb2, timestamp_pb2


def to_struct(data: dict[str, Any] | None) -> struct_pb2.Struct:
    """A Struct holding the JSON object `data` (empty for None)."""
    struct = struct_pb2.Struct()
    if data:
        struct.update(data)
    return struct


def to_value(data: Any) -> struct_pb2.Value:
    """A Value holding any JSON value."""
    value = struct_pb2.Value()
    json_format.ParseDict(data, value)
    return value


def from_struct(struct: struct_pb2.Struct) -> dict[str, Any]:
    """The JSON object in `struct` (integral numbers come back as int)."""
    return _ints(json_format.MessageToDict(struct))


def from_value(value: struct_pb2.Value) -> Any:
    """The JSON value in `value` (None when unset; integral numbers come back as int)."""
    if value.WhichOneof("kind") is None:
        return None
    return _ints(json_format.MessageToDict(value))


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


def iso(ts: timestamp_pb2.Timestamp | datetime.datetime | None) -> str | None:
    """ISO 8601 UTC with offset, e.g. "2026-06-20T10:00:01.123456+00:00" (None when unset)."""
    if ts is None:
        return None
    if isinstance(ts, timestamp_pb2.Timestamp):
        if ts.seconds == 0 and ts.nanos == 0:
            return None
        moment = ts.ToDatetime(tzinfo=datetime.UTC)
    else:
        moment = ts if ts.tzinfo else ts.replace(tzinfo=datetime.UTC)
    return moment.astimezone(datetime.UTC).isoformat()
