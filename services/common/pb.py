"""Conversions between JSON values and protobuf's Struct/Value/Timestamp.

Nesting depth (the one rule for JSON crossing a service boundary)
----------------------------------------------------------------
Python protobuf (upb) *encodes* a message of any depth but *decodes* at most
`PROTOBUF_MAX_DEPTH` (100) levels of messages nested inside the one decoded, and raises
DecodeError ("Exceeded upb_DecodeOptions_MaxDepth") past that: the sender succeeds and the
receiver fails (and building a message that holds a too-deep Struct can fail in-process).
Every JSON object level inside a Struct costs 3 message levels (map entry, Value, Struct), an
array level 2 (Value, ListValue). A Value at level k (the decoded message is level 0) holding
an object d levels deep reaches level k + 3·d (a Struct at level k: k + 3·d − 1), at most 100.

- `MAX_WIRE_DEPTH` (32) is the deepest a JSON value may be wherever it travels. The deepest
  place one does is a `done` event's tool call output, StreamRunResponse → Event → DoneEvent
  → ToolCallRecord → Value (k = 4): 4 + 3·32 = 100, and 33 would be 103. Every other Struct
  or Value field sits higher (tests/common/test_json_depth.py round-trips each at its limit).
- `MAX_JSON_DEPTH` (29) is the limit of values accepted from outside and produced by tools
  (request bodies at the gateway, a model's tool input, tool outputs): 3 below
  MAX_WIRE_DEPTH, because the thread wraps a tool call's input 3 levels deeper
  (`{"tool_calls": [{"input": ...}]}`, GetChat's `thinking`).

Depth counts objects and arrays on the deepest path: a scalar is 0, `{}` and `[1]` are 1,
`{"a": {"b": 1}}` is 2. `to_struct`/`to_value` measure it while they build (no second walk)
and raise `JsonTooDeep` past `max_depth`, or with `clip=True` replace every object or array
that would sit deeper by its JSON text (a string), so that the result always decodes; `clip`
is for what comes from outside (web pages, MCP servers) or was stored before the limit.
"""

from __future__ import annotations

import datetime
import json
import math
import re
from typing import Any

import orjson
from google.protobuf import json_format, struct_pb2, timestamp_pb2

PROTOBUF_MAX_DEPTH = (
    100  # upb's decode limit in Python protobuf (levels of messages nested in the decoded one)
)
#: Deepest JSON anywhere on the wire: (100 - 4 enclosing levels) // 3 (see the module docstring).
MAX_WIRE_DEPTH = 32
#: Deepest JSON accepted from outside or produced by a tool: MAX_WIRE_DEPTH - 3 (thread wrapping).
MAX_JSON_DEPTH = 29
CLIPPED_TOO_DEEP = "[JSON nested too deep to show]"  # a clipped part even json.dumps cannot write


class JsonTooDeep(ValueError):
    """A JSON value nested deeper than `limit` levels of objects and arrays (see the module
    docstring).

    `str()` is safe to show a client or a model: "JSON nested deeper than 29 levels of objects
    and arrays" (the limit is `MAX_JSON_DEPTH` unless the caller chose another).
    """

    def __init__(self, limit: int) -> None:
        super().__init__(f"JSON nested deeper than {limit} levels of objects and arrays")
        self.limit = limit


class _TooDeep(Exception):
    """Raised inside `_fill_value` past the limit (the public functions raise JsonTooDeep with
    it)."""


def json_depth(data: Any, limit: int | None = None) -> int:
    """The nesting depth of the JSON value `data`: objects (dict) and arrays (list, tuple) on its
    deepest path; 0 for a scalar (or any other object).

    Iterative (no recursion limit) and, with `limit`, it stops as soon as a level deeper than
    `limit` is seen and returns that level (limit + 1), so checking a big shallow value costs one
    walk and a deep one less. Raises nothing.
    """
    if not isinstance(data, (dict, list, tuple)):
        return 0
    deepest = 1
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        node, level = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        for child in children:
            if isinstance(child, (dict, list, tuple)):
                if level + 1 > deepest:
                    deepest = level + 1
                    if limit is not None and deepest > limit:
                        return deepest
                stack.append((child, level + 1))
    return deepest


def clipped(data: Any, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`data` as JSON with every object or array that sits deeper than `max_depth` levels replaced
    by its JSON text (a string; `_json_text`), so that `json_depth(result) <= max_depth`.

    The JSON counterpart of `to_struct(..., clip=True)`, for a copy kept as JSON (a thread row);
    shallow enough parts are copied as they are. Raises what `json.dumps` raises for a value it
    cannot encode inside a clipped part (TypeError).
    """
    if not isinstance(data, (dict, list, tuple)):
        return data
    if max_depth < 1:
        return _json_text(data)
    if isinstance(data, dict):
        return {key: clipped(item, max_depth - 1) for key, item in data.items()}
    return [clipped(item, max_depth - 1) for item in data]


def _json_text(data: Any) -> str:
    """The compact JSON text of a clipped part; a marker instead when it is too deep even for
    `json.dumps` (Python's recursion limit, about 1,000 levels, near what json.loads and orjson
    let through)."""
    try:
        return json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    except RecursionError:
        return CLIPPED_TOO_DEEP


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def scrub(data: Any) -> Any:
    """`data` (a JSON value) with every lone UTF-16 surrogate in its strings and object keys
    replaced by U+FFFD. JSON text may escape one (`"\\ud800"` is valid JSON) and json.loads
    reads it into a str that no UTF-8 encoder takes, so protobuf, orjson and the databases
    refuse it (a model's tool call with one would fail the whole turn). Returns a
    string without one unchanged (cheap for ASCII), containers copied."""
    if isinstance(data, str):
        if data.isascii() or not _LONE_SURROGATE.search(data):
            return data
        return _LONE_SURROGATE.sub("\ufffd", data)
    if isinstance(data, dict):
        return {scrub(key): scrub(item) for key, item in data.items()}
    if isinstance(data, (list, tuple)):
        return [scrub(item) for item in data]
    return data


def holds_nul(value: Any) -> bool:
    """Whether a decoded JSON value holds U+0000 in a string or an object key. PostgreSQL's text
    types cannot store it, and an answer cannot carry it (the gateway refuses it in request
    bodies); the caller bounds the depth (`json_depth`) or knows it is bounded."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any("\x00" in key or holds_nul(item) for key, item in value.items())
    if isinstance(value, list):
        return any(holds_nul(item) for item in value)
    return False


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    number = float(text)
    if math.isinf(number):
        raise ValueError(f"{text} is beyond a double's range")
    return number


def loads_strict(text: str | bytes) -> Any:
    """`json.loads(text)` as RFC 8259 reads JSON: `NaN`, `Infinity` and `-Infinity` (which
    json.loads takes) and a number beyond a double's range (which it reads as infinity) raise
    ValueError, like any text that is not JSON; so does nesting past json.loads' own limit
    (RecursionError). For a body from elsewhere (a web page, an OAuth2 API) that is kept as
    text when it is not JSON, rather than have such numbers written as null, silently."""
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError("JSON nested deeper than json.loads reads") from None


def _finite(data: Any) -> Any:
    """`data` with NaN and infinities as None (what orjson writes for them), for json.dumps."""
    if isinstance(data, float) and (math.isnan(data) or math.isinf(data)):
        return None
    if isinstance(data, dict):
        return {key: _finite(item) for key, item in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(item) for item in data]
    return data


def json_bytes(data: Any, *, clip: bool = False, max_depth: int = MAX_JSON_DEPTH) -> bytes:
    """The compact JSON text (UTF-8, orjson) of a JSON value, for a `*_json` bytes field (a tool's
    output: `ExecuteToolResponse.output_json`, `ToolResultEvent.output_json`).

    The same depth rule as `to_value`: past `max_depth` JsonTooDeep, or with `clip=True` every
    deeper object or array as its JSON text (`clipped`), so the text parses wherever it goes.
    Object keys keep their order. A lone surrogate becomes U+FFFD (`scrub`) and an integer past
    64 bits is written exactly (json.dumps, which also writes a key that is not a string as
    its text), as orjson takes neither. Raises TypeError for a value JSON cannot hold (orjson
    writes datetimes as RFC 3339 text and NaN or an infinity as null).
    """
    if isinstance(data, (dict, list, tuple)) and json_depth(data, max_depth) > max_depth:
        if not clip:
            raise JsonTooDeep(max_depth)
        data = clipped(data, max_depth)
    try:
        return orjson.dumps(data)
    except (
        orjson.JSONEncodeError
    ) as error:  # a TypeError subclass: a lone surrogate, an integer past 64 bits, another type
        failure = str(error)
    data = scrub(data)
    try:
        return orjson.dumps(data)
    except orjson.JSONEncodeError:
        pass
    try:
        return json.dumps(
            _finite(data), ensure_ascii=False, separators=(",", ":"), allow_nan=False
        ).encode()
    except (TypeError, ValueError):
        raise TypeError(failure) from None


def output_json(message: Any) -> bytes:
    """A tool output's JSON text from a message with `output_json` and the older `output` Value
    (ExecuteToolResponse, ToolResultEvent, ToolCallRecord): `output_json` when set, else the
    Value's JSON (`null` when neither is)."""
    if message.output_json:
        return message.output_json
    return orjson.dumps(from_value(message.output))


def output_of(message: Any) -> Any:
    """The tool output of `message` as a JSON value (`output_json` parsed; see `output_json`).
    Raises orjson.JSONDecodeError (a ValueError) when its text is not JSON."""
    return orjson.loads(output_json(message))


# A JSON field pair: a Struct or Value field `name` (messages of an older version) and the bytes
# field `<name>_json` beside it holding the same value as JSON text, set instead of it
# (ChatMessage `content` and `thinking`, Chat `pending_user_input_request`,
# UserInputRequestEvent `request`, ResumeRequest `response`). A writer sets `<name>_json`
# (`json_bytes`); a reader takes it when it is set, else the Struct or Value.


def _older_field(message: Any, name: str) -> Any:
    """The JSON value of the Struct or Value field `name` of `message` (`from_struct`/`from_value`),
    None when it is unset."""
    if not message.HasField(name):
        return None
    field = getattr(message, name)
    return from_struct(field) if isinstance(field, struct_pb2.Struct) else from_value(field)


def field_fragment(message: Any, name: str) -> Any:
    """The JSON field pair `name` of `message` for a response body written by orjson: `<name>_json`
    as an orjson.Fragment (written into the body as it is, never parsed or encoded again), else
    the Struct's or Value's JSON value (a message of an older version), None when neither is set.

    The text is trusted to be JSON (it comes from `json_bytes` in another service); raises
    AttributeError or ValueError for a message without the pair.
    """
    text = getattr(message, f"{name}_json")
    if text:
        return orjson.Fragment(text)
    return _older_field(message, name)


class NotAnObject(ValueError):
    """A `<name>_json` field that is set but is not a JSON object; the message names the field
    and what it holds instead, never its content."""


def object_of(message: Any, name: str) -> dict[str, Any]:
    """The JSON object of the Struct field pair `name` of `message` (ResumeRequest `response`):
    `<name>_json` parsed when it is set, else the Struct `name` as `from_struct` gives it ({}
    when unset: a caller checks the object's fields; a client of an older version sends the
    Struct). Raises NotAnObject when `<name>_json` is set but is not a JSON object (not JSON,
    not UTF-8, too deep for the parser, an array or a scalar) rather than fall back to the
    Struct silently, which would make the answer's check say something misleading.
    AttributeError for a message without the pair.
    """
    text = getattr(message, f"{name}_json")
    if not text:
        return from_struct(getattr(message, name))
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError:
        why = "it is not valid JSON"
    else:
        if isinstance(data, dict):
            return data
        why = f"it is {_JSON_KINDS.get(type(data), 'not an object')}"
    raise NotAnObject(f"{name}_json must be a JSON object (UTF-8 JSON text): {why}")


_JSON_KINDS = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


def to_struct(
    data: dict[str, Any] | None, *, clip: bool = False, max_depth: int = MAX_JSON_DEPTH
) -> struct_pb2.Struct:
    """A Struct holding the JSON object `data` (empty for None or {}).

    `data` itself is level 1 of `max_depth` (module docstring). Past it: JsonTooDeep (a
    ValueError), or with `clip=True` every deeper object or array becomes its JSON text.
    `max_depth` above MAX_JSON_DEPTH is only for a value that wraps an already-limited one
    (never above MAX_WIRE_DEPTH). Other errors as `Struct.update` (ValueError for a value of
    another type, TypeError for a key that is not a string).
    """
    struct = struct_pb2.Struct()
    if not data:
        return struct
    try:
        fields = struct.fields
        if all(
            isinstance(key, str) and _fill_value(fields[key], item, max_depth - 1, clip)
            for key, item in data.items()
        ):
            return struct
    except _TooDeep:
        raise JsonTooDeep(max_depth) from None
    except Exception:  # noqa: BLE001, S110 - Struct.update below raises its own error for the same input
        pass
    struct = struct_pb2.Struct()
    struct.update(data)
    _check_fallback(data, max_depth)
    return struct


def to_value(data: Any, *, clip: bool = False, max_depth: int = MAX_JSON_DEPTH) -> struct_pb2.Value:
    """A Value holding any JSON value (dict, list/tuple, str, int, float, bool, None).

    An object or array `data` is level 1 of `max_depth`; past it JsonTooDeep (a ValueError), or
    with `clip=True` every deeper object or array becomes its JSON text (module docstring).
    Otherwise the same result and errors as `json_format.ParseDict(data, Value())` (ParseError
    for a value of another type), built directly: ParseDict's generic walk costs several times
    more CPU per call, and every tool result goes through here.
    """
    value = struct_pb2.Value()
    try:
        if _fill_value(value, data, max_depth, clip):
            return value
    except _TooDeep:
        raise JsonTooDeep(max_depth) from None
    except Exception:  # noqa: BLE001, S110 - ParseDict below raises its own error for the same input
        pass
    value = struct_pb2.Value()
    json_format.ParseDict(data, value)
    _check_fallback(data, max_depth)
    return value


def _check_fallback(data: Any, max_depth: int) -> None:
    # The generic converters accepted what `_fill_value` refused (not expected: it mirrors them);
    # they know no depth, so the rule is checked here.
    if json_depth(data, max_depth) > max_depth:
        raise JsonTooDeep(max_depth)


def from_struct(struct: struct_pb2.Struct) -> dict[str, Any]:
    """The JSON object in `struct` (integral numbers come back as int), every object's keys sorted.

    A Struct is a protobuf map: it keeps no key order, and the order it iterates in differs
    between processes, so an SSE frame replayed by another process (a restart, another
    gateway) would list an object's keys in another order than the live one.
    Sorted keys make every rendering of the same value the same bytes.

    The same result and errors as `json_format.MessageToDict` (ValueError for an infinite
    or NaN number) followed by the int rule, without the generic walk.
    """
    try:
        return {key: _json_of(item) for key, item in sorted(struct.fields.items())}
    except _Unsupported:
        return _ints(json_format.MessageToDict(struct))


def from_value(value: struct_pb2.Value) -> Any:
    """The JSON value in `value` (None when unset; integral numbers come back as int; object
    keys sorted, see `from_struct`)."""
    if value.WhichOneof("kind") is None:
        return None
    try:
        return _json_of(value)
    except _Unsupported:
        return _ints(json_format.MessageToDict(value))


class _Unsupported(Exception):
    """A Value the direct conversion leaves to json_format (an infinite or NaN number)."""


def _fill_value(message: struct_pb2.Value, data: Any, room: int, clip: bool) -> bool:
    # Mirrors json_format's _ConvertValueMessage; False (nothing raised) for what it would refuse.
    # `room`: the levels of objects and arrays `data` may still open (it being one); none left:
    # _TooDeep, or with `clip` the JSON text in place of the object or array.
    if isinstance(data, dict):
        if room <= 0:
            return _clip(message, data, clip)
        struct = message.struct_value
        struct.Clear()  # marks the struct set even when empty, as ParseDict does
        fields = struct.fields
        for key, item in data.items():
            if not isinstance(key, str) or not _fill_value(fields[key], item, room - 1, clip):
                return False
        return True
    if isinstance(data, (list, tuple)):
        if room <= 0:
            return _clip(message, data, clip)
        values = message.list_value
        values.ClearField("values")
        for item in data:
            if not _fill_value(values.values.add(), item, room - 1, clip):
                return False
        return True
    if data is None:
        message.null_value = struct_pb2.NULL_VALUE
    elif isinstance(data, bool):
        message.bool_value = data
    elif isinstance(data, str):
        message.string_value = data
    elif isinstance(data, (int, float)):
        message.number_value = data
    else:
        return False
    return True


def _clip(message: struct_pb2.Value, data: Any, clip: bool) -> bool:
    if not clip:
        raise _TooDeep
    message.string_value = _json_text(data)
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
        return {key: _json_of(item) for key, item in sorted(value.struct_value.fields.items())}
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
_MIN_SECONDS, _MAX_SECONDS = (
    -62135596800,
    253402300799,
)  # 0001-01-01T00:00:00Z .. 9999-12-31T23:59:59Z (protobuf's range)
_SECONDS_TEXT: dict[
    int, str
] = {}  # whole seconds -> "YYYY-MM-DDTHH:MM:SS"; a run's events share a few seconds


def iso(ts: timestamp_pb2.Timestamp | datetime.datetime | None) -> str | None:
    """ISO 8601 UTC with offset, e.g. "2026-06-20T10:00:01.123456+00:00" (None when unset;
    microseconds truncated, omitted when zero, as `datetime.isoformat`).

    A Timestamp inside protobuf's valid range is rendered without a datetime per call: the
    date and time of each whole second are rendered once and cached (the SSE encoder renders
    one per frame). Outside the range, ValueError as `Timestamp.ToDatetime` raises it.
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
                text = _SECONDS_TEXT[seconds] = (
                    _EPOCH + datetime.timedelta(seconds=seconds)
                ).isoformat()[:19]
            micros = nanos // 1000
            return f"{text}.{micros:06d}+00:00" if micros else text + "+00:00"
        moment = ts.ToDatetime(tzinfo=datetime.UTC)
    else:
        moment = ts if ts.tzinfo else ts.replace(tzinfo=datetime.UTC)
    return moment.astimezone(datetime.UTC).isoformat()
