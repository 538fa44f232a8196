"""The tools service's checks of request fields, with the HTTP gateway's limits and messages.

A caller reaching this service directly must not store, look up or send on what the gateway
refuses, so each limit here is the gateway's, and each refusal is an RpcError INVALID_ARGUMENT
in TOOLS_DOMAIN whose message names the field and the limit, never the value (it may be a
secret).
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

import grpc
import orjson

from loopline.tools.v1 import tools_pb2
from services.common import pb
from services.common.errors import TOOLS_DOMAIN, RpcError

#: The longest value each string field may hold, in characters (Python's len, as the gateway
#: counts): the gateway's string limits. The columns are as wide: display_name and name
#: VARCHAR(200), an integration name VARCHAR(100), a document's name VARCHAR(500) (the gateway's
#: upload route cuts a file's name there).
TEXT_LIMITS = {
    "display_name": 200,
    "name": 200,
    "description": 10_000,
    "document_name": 500,
    "integration_name": 100,
    "auth_type": 32,
    "server_url": 2_048,
    "redirect_uri": 2_048,
    "scope": 2_048,
    "query": 2_048,
}

#: The largest JSON object each Struct field may hold, in bytes as compact UTF-8 JSON (measured
#: as the gateway measures it, with orjson). A credential's metadata comes back in every listing;
#: auth_data and an MCP server's headers are secrets, encrypted and stored.
JSON_LIMITS = {"metadata": 16 * 1024, "auth_data": 64 * 1024, "headers": 16 * 1024}

#: The most values each repeated field may hold, counted as sent (duplicates included): a search
#: names at most 100 knowledge bases, as at the gateway.
COUNT_LIMITS = {"knowledge_base_ids": 100}
#: What each counted field names, for the message.
_COUNTED = {"knowledge_base_ids": "knowledge bases"}


def invalid(reason: str, message: str) -> RpcError:
    """RpcError INVALID_ARGUMENT `reason` in TOOLS_DOMAIN."""
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, reason, message, domain=TOOLS_DOMAIN)


def check_length(field: str, value: str, limit: int) -> None:
    """Refuse `value` of the request field `field` when it is longer than `limit` characters.

    Raises RpcError INVALID_ARGUMENT FIELD_TOO_LONG (metadata `field`, `limit`) with the
    gateway's message ("display_name must be at most 200 characters (it has 5000)").
    """
    if len(value) > limit:
        raise RpcError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "FIELD_TOO_LONG",
            f"{field} must be at most {limit} characters (it has {len(value)})",
            domain=TOOLS_DOMAIN,
            metadata={"field": field, "limit": str(limit)},
        )


def check_lengths(request: Any, *fields: str) -> None:
    """`check_length` for each string field `fields` of `request`, at its TEXT_LIMITS, in order."""
    for field in fields:
        check_length(field, getattr(request, field), TEXT_LIMITS[field])


def check_json_size(field: str, value: dict[str, Any]) -> None:
    """Refuse the JSON object `value` of the request field `field` when it is larger than
    JSON_LIMITS[field] bytes as compact UTF-8 JSON.

    Raises RpcError INVALID_ARGUMENT FIELD_TOO_LARGE (metadata `field`, `limit`) with the
    gateway's message ("metadata must be at most 16384 bytes when JSON-encoded (it has 20000)").
    """
    limit = JSON_LIMITS[field]
    size = len(orjson.dumps(value))
    if size > limit:
        raise RpcError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "FIELD_TOO_LARGE",
            f"{field} must be at most {limit} bytes when JSON-encoded (it has {size})",
            domain=TOOLS_DOMAIN,
            metadata={"field": field, "limit": str(limit)},
        )


def check_count(field: str, values: Sized) -> None:
    """Refuse the repeated request field `field` when it holds more than COUNT_LIMITS[field] values.

    Raises RpcError INVALID_ARGUMENT TOO_MANY_<FIELD> (metadata `field`, `limit`) with the
    gateway's message and the count ("knowledge_base_ids must name at most 100 knowledge bases
    (it names 101)").
    """
    limit = COUNT_LIMITS[field]
    if len(values) > limit:
        raise RpcError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"TOO_MANY_{field.upper()}",
            f"{field} must name at most {limit} {_COUNTED[field]} (it names {len(values)})",
            domain=TOOLS_DOMAIN,
            metadata={"field": field, "limit": str(limit)},
        )


def page_size(field: str, value: int, low: int, high: int, default: int) -> int:
    """The page size `value` of the request field `field`: `default` for 0 (proto3's unset), else
    `value` when it is from `low` to `high`, as tools.proto documents the field.

    Raises RpcError INVALID_ARGUMENT INVALID_<FIELD> (metadata `field`) for any other value
    rather than clamping it: a caller asking for -1 or a million results is told so.
    """
    if value == 0:
        return default
    if not low <= value <= high:
        raise RpcError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"INVALID_{field.upper()}",
            f"{field} must be between {low} and {high} (0 means {default}), not {value}",
            domain=TOOLS_DOMAIN,
            metadata={"field": field},
        )
    return value


def tool_input(request: tools_pb2.ExecuteToolRequest) -> dict[str, Any]:
    """The call's input: `input_json` (numbers exact) when it is set, else the `input` Struct of
    an older client (`pb.object_of`, the rule of every `<name>_json` pair).

    A set `input_json` that is not a JSON object as UTF-8 text raises RpcError INVALID_ARGUMENT
    INVALID_INPUT_JSON (metadata field=input_json) naming what it is, never its content: falling
    back to `input` would fail the tool with a misleading "'query' is required".
    """
    try:
        return pb.object_of(request, "input")
    except pb.NotAnObject as bad:
        raise RpcError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_INPUT_JSON",
            str(bad),
            domain=TOOLS_DOMAIN,
            metadata={"field": "input_json"},
        ) from None
