"""Request bodies: reading them (bounded), parsing them as JSON objects, and the shared checks.

Every JSON body of the API is read through `json_object`, so each rule (a JSON object, the
depth limit, no U+0000, no name given twice, unknown fields refused) is one check for every
route. Bad input raises `BodyError` (errors.py), which the app renders as `{"detail": ...}`
with 400 or 413, never FastAPI's 422.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from fastapi import Request
from starlette.types import Receive

from loopline.assistant.v1 import assistant_pb2
from services.common import pb
from services.common.errors import bounded
from services.gateway.errors import BodyError

_NUL = "Request body contains a NUL character (\\u0000) in a string; text fields cannot hold it"
_TOO_DEEP = (
    f"Request body is nested deeper than {pb.MAX_JSON_DEPTH} levels of objects and arrays"
    " (the body itself counts as one)"
)
# The `llm` object of a turn or a resume, as JSON Schema (`parse_llm` checks the same).
LLM_SCHEMA = {
    "type": ["object", "null"],
    "properties": {
        "integration_name": {"type": "string", "minLength": 1, "pattern": r"\S"},
        "provider_id": {"type": "string", "minLength": 1, "pattern": r"\S"},
        "model_id": {"type": "string", "minLength": 1, "pattern": r"\S"},
        "credential_id": {"type": ["string", "null"]},
    },
    "required": ["integration_name", "provider_id", "model_id"],
    "additionalProperties": False,
}


class ClientGone(Exception):
    """The client disconnected before its request body was complete (nothing is answered)."""


async def read_body(request: Request, limit: int) -> bytes:
    """The request body's bytes; BodyError 413 past `limit` bytes (Content-Length, else as read)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise BodyError(413, f"Request body exceeds {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyError(413, f"Request body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json_object(request: Request, limit: int) -> dict[str, Any]:
    """The request body as a JSON object; BodyError 413 past `limit` bytes, 400 as `json_object`."""
    return json_object(await read_body(request, limit))


async def refuse_body(request: Request, limit: int) -> None:
    """The check of a route that takes no body (a cancel, a delete, set-default), after its caller
    is known: no body, or `{}` (what a client that always sends one sends), is taken; anything else
    is refused as any body is: over `limit` bytes 413, not a JSON object 400, a field 400."""
    raw = await read_body(request, limit)
    if raw.strip():
        check_fields(json_object(raw), set())


async def receive_json_object(receive: Receive, declared: str | None, limit: int) -> dict[str, Any]:
    """`read_json_object` straight from ASGI `receive` (the lean handlers of hot_path.py).

    `declared` is the Content-Length header (str or None); BodyError 413 past `limit` bytes,
    400 as `json_object`; ClientGone when the client disconnects first.
    """
    if declared and declared.isdigit() and int(declared) > limit:
        raise BodyError(413, f"Request body exceeds {limit} bytes")
    message = await receive()
    if message["type"] == "http.request" and not message.get("more_body", False):
        raw = message.get("body", b"")  # the whole body in one message: the common case
        if len(raw) > limit:
            raise BodyError(413, f"Request body exceeds {limit} bytes")
        return json_object(raw)
    chunks, size = [], 0
    while True:
        if message["type"] == "http.disconnect":
            raise ClientGone
        if message["type"] == "http.request":
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BodyError(413, f"Request body exceeds {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return json_object(b"".join(chunks))
        message = await receive()


def json_object(raw: bytes) -> dict[str, Any]:
    """`raw` parsed as a JSON object; BodyError 400 when empty, not JSON (UTF-8), not an object,
    nested deeper than `pb.MAX_JSON_DEPTH` levels of objects and arrays (the body is level 1),
    holding U+0000 in a string, or giving a name twice in one object (RFC 8259 §4, RFC 7493 §2.3).

    The depth rule is that of values crossing a gRPC boundary (services/common/pb.py: protobuf
    decodes at most 100 message levels, 3 per JSON level in a Struct): a body the orchestrator or
    the tools service could not decode is a 400 naming the limit, not a 500.
    """
    if not raw.strip():
        raise BodyError(400, "Request body must be a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        # orjson refuses past 1,024 levels ("depth limit exceeded") before reading the rest: valid
        # JSON, too deep, so the depth answer (not "not valid JSON")
        if any(word in str(exc).lower() for word in ("depth limit", "recursion")):
            raise BodyError(400, _TOO_DEEP) from None
        raise BodyError(400, "Request body is not valid JSON (UTF-8, no lone surrogates)") from None
    except RecursionError:  # a parser that recurses instead (none today): the same answer
        raise BodyError(400, _TOO_DEEP) from None
    if not isinstance(body, dict):
        raise BodyError(400, "Request body must be a JSON object")
    # Fewer brackets than the limit cannot nest deeper than it (a count in C, so the common small
    # body is never walked; brackets inside strings only make the walk happen).
    if (
        raw.count(b"{") + raw.count(b"[") > pb.MAX_JSON_DEPTH
        and pb.json_depth(body, pb.MAX_JSON_DEPTH) > pb.MAX_JSON_DEPTH
    ):
        raise BodyError(400, _TOO_DEEP)
    # PostgreSQL's text types cannot hold U+0000, so a string with one is refused on either
    # backend. Valid JSON can only write it as the escape \u0000, so the common body is not walked.
    if b"\\u0000" in raw and pb.holds_nul(body):
        raise BodyError(400, _NUL)
    # A name given twice in one object is refused, not read as its last value (parsers differ on
    # which value wins). orjson keeps the last silently, so the few bodies with more than one name
    # are read again by the standard library with a hook that sees every name.
    if raw.count(b":") > 1:
        try:
            json.loads(raw, object_pairs_hook=_unique_names)
        except _RepeatedName as exc:
            name = bounded(json.dumps(exc.name, ensure_ascii=False), 200)
            raise BodyError(
                400,
                f"Request body gives the name {name} more than once in one object; give it once",
            ) from None
        except (ValueError, RecursionError):  # a limit of the second parser: orjson read the body
            pass
    return body


class _RepeatedName(Exception):
    def __init__(self, name: str) -> None:
        self.name = name


def _unique_names(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json.loads' object hook: the object, or _RepeatedName for a name it has twice."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                raise _RepeatedName(name)
            seen.add(name)
    return obj


def check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    """BodyError 400 naming the fields of `body` outside `allowed` (unknown fields are refused)."""
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BodyError(400, f"Unknown field(s): {', '.join(unknown)}")


def parse_llm(value: Any) -> assistant_pb2.LlmConfig | None:
    """The `llm` object {integration_name, provider_id, model_id, credential_id?} or None;
    BodyError 400 when malformed."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BodyError(
            400, "llm must be an object {integration_name, provider_id, model_id, credential_id?}"
        )
    check_fields(value, {"integration_name", "provider_id", "model_id", "credential_id"})
    fields = {}
    for name in ("integration_name", "provider_id", "model_id"):
        item = value.get(name)
        if not isinstance(item, str) or not item.strip():
            raise BodyError(400, f"llm.{name} must be a non-empty string")
        fields[name] = item
    credential = value.get("credential_id")
    if credential is not None and not isinstance(credential, str):
        raise BodyError(400, "llm.credential_id must be a string")
    return (
        assistant_pb2.LlmConfig(**fields, credential_id=credential)
        if credential
        else assistant_pb2.LlmConfig(**fields)
    )
