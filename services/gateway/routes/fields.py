"""The fields of the credentials and knowledge routes' JSON bodies: limits, checks, JSON Schema.

Size limits (400 past them, checked before the tools service is called, so nothing is stored):
every string field at most STRING_LIMITS[field] characters (MAX_TEXT_CHARS for a field not
listed); the JSON objects at most OBJECT_LIMITS[field] bytes as compact UTF-8 JSON; a
multi-search names at most MAX_SEARCH_BASES knowledge bases. Errors name the field and the
limit, never the value.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import Depends, Request

from loopline.tools.v1 import tools_pb2_grpc
from services.gateway.bodies import read_json_object
from services.gateway.context import authenticate, context_of
from services.gateway.errors import BodyError

# The deadlines of the tools service's calls: most, and the slow ones (MCP discovery, indexing).
TIMEOUT_S = 30.0
SLOW_TIMEOUT_S = 120.0

# The longest value of a string field of these routes, in characters, by field name. Names fit
# the tools service's columns (a credential's display_name and a knowledge base's name are
# VARCHAR(200) there, an integration name VARCHAR(100)); a listed credential or knowledge base
# also lands in model tool results, so its free text stays small.
STRING_LIMITS = {
    "display_name": 200,
    "name": 200,
    "integration_name": 100,
    "auth_type": 32,
    "expires_at": 64,
    "description": 10_000,
}
# Any other string field (server_url, redirect_uri, scope, a search query), in characters.
MAX_TEXT_CHARS = 2_048
# The largest JSON object field, in bytes of compact UTF-8 JSON, by field name: credential metadata
# (returned by every listing) 16 KiB; a secret (auth_data, MCP headers) 64 KiB / 16 KiB.
OBJECT_LIMITS = {"metadata": 16 * 1024, "auth_data": 64 * 1024, "headers": 16 * 1024}
# The most knowledge bases one multi-search names, and the longest id (ids are 36-character UUIDs).
MAX_SEARCH_BASES = 100
MAX_ID_CHARS = 64

# ---- OpenAPI request bodies ---------------------------------------------------------------
# What each route's hand-written checks accept (`string_field`, `object_field`, `bool_field`,
# `int_field`, `number_field`, `check_fields`), as JSON Schema for `openapi_extra`: a generated
# client sends the body, and a body the schema allows passes the gateway's checks. Byte limits of
# JSON objects cannot be written in JSON Schema; they are in the descriptions.


def text_schema(name: str, *, required: bool = False) -> dict[str, Any]:
    """A `string_field`: required ones are non-blank strings (null is refused), others a string
    or null."""
    limit = STRING_LIMITS.get(name, MAX_TEXT_CHARS)
    if required:
        return {"type": "string", "minLength": 1, "maxLength": limit, "pattern": r"\S"}
    return {"type": ["string", "null"], "maxLength": limit}


def object_schema(name: str, description: str = "") -> dict[str, Any]:
    """An `object_field`: a JSON object or null (at most OBJECT_LIMITS[name] bytes as JSON)."""
    schema: dict[str, Any] = {"type": ["object", "null"]}
    limit = OBJECT_LIMITS.get(name)
    text = " ".join(
        part
        for part in (description, f"At most {limit} bytes as compact UTF-8 JSON." if limit else "")
        if part
    )
    if text:
        schema["description"] = text
    return schema


BOOLEAN = {"type": "boolean"}  # `bool_field`: absent is false; null is refused
NOT_SUPPORTED = {
    "type": "null",
    "description": "Not supported: any value but null is refused (400).",
}


def json_body(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    """`openapi_extra` declaring a required JSON object body with exactly `properties`."""
    schema = {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def string_field(
    body: dict[str, Any], name: str, *, required: bool = False, default: str = ""
) -> str:
    """The string field `name` of `body` (`default` when absent or null).

    Raises BodyError 400 when it is not a string, is required and missing or blank, or is
    longer than STRING_LIMITS[name] (MAX_TEXT_CHARS for other fields) characters.
    """
    value = body.get(name)
    if value is None:
        if required:
            raise BodyError(400, f"{name} is required")
        return default
    if not isinstance(value, str) or (required and not value.strip()):
        raise BodyError(
            400, f"{name} must be a non-empty string" if required else f"{name} must be a string"
        )
    limit = STRING_LIMITS.get(name, MAX_TEXT_CHARS)
    if len(value) > limit:
        raise BodyError(400, f"{name} must be at most {limit} characters (it has {len(value)})")
    return value


def object_field(body: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The JSON object field `name` of `body`, or None when absent or null.

    Raises BodyError 400 when it is not an object, or (for a field in OBJECT_LIMITS) larger
    than its limit as compact UTF-8 JSON (`check_json_size`).
    """
    value = body.get(name)
    if value is not None and not isinstance(value, dict):
        raise BodyError(400, f"{name} must be an object")
    if value is not None and name in OBJECT_LIMITS:
        check_json_size(name, value, OBJECT_LIMITS[name])
    return value


def check_json_size(name: str, value: Any, limit: int) -> None:
    """BodyError 400 when `value` is larger than `limit` bytes as compact UTF-8 JSON (the error
    names `name` and the sizes, never the content: it may be a secret)."""
    size = len(orjson.dumps(value))
    if size > limit:
        raise BodyError(
            400, f"{name} must be at most {limit} bytes when JSON-encoded (it has {size})"
        )


def bool_field(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise BodyError(400, f"{name} must be a boolean")
    return value


def int_field(body: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    """`body[name]` (else `default`) as an int in `low`..`high`; BodyError 400 otherwise.

    A number with a zero fractional part (`19.0`) is an integer, as JSON Schema's `integer`
    type that the OpenAPI document declares says (JSON Schema 2020-12 Validation, section 6.1.1;
    JSON itself has one number type); `19.5`, a string or a boolean is not."""
    value = body.get(name, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BodyError(400, f"{name} must be an integer between {low} and {high}")
    return value


def number_field(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BodyError(400, f"{name} must be a number")
    return float(value)


Who = Depends(authenticate)  # the routes' `who: Principal = Who`: an owner or admin, checked first


async def body_of(request: Request) -> dict[str, Any]:
    """The request's JSON object body (bounded by the gateway's `max_body_bytes`)."""
    return await read_json_object(request, context_of(request).settings.max_body_bytes)


def tools_of(request: Request) -> tools_pb2_grpc.ToolsServiceStub:
    """The tools service's stub (these routes are included only when the gateway has one)."""
    tools = context_of(request).tools
    assert tools is not None
    return tools
