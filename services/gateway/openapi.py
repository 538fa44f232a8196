"""OpenAPI response declarations shared by every gateway route: the statuses each can return.

Every route declares 400, 401, 403, 429, 503 and 504 plus its own; billing denials (402/403/429)
and the gateway's rate limits (429) are the flat DenialEnvelope, everything else `{"detail": str}`.
`json_schema_bounds` repairs the integer bounds pydantic writes under its own names (see there).
"""

from __future__ import annotations

from typing import Any

_ERROR = {
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "properties": {"detail": {"type": "string"}},
                "required": ["detail"],
            }
        }
    }
}
_DENIAL = {
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "properties": {
                    "code": {"type": "string"},
                    "layer": {"type": "string"},
                    "key": {"type": ["string", "null"]},
                    "current": {"type": ["integer", "null"]},
                    "limit": {"type": ["integer", "null"]},
                    "reason": {"type": "string"},
                },
                "required": ["code", "layer", "reason"],
            }
        }
    }
}


# A 429 of any route: the gateway's own rate limits (services/gateway/ratelimit.py) answer with the
# DenialEnvelope; a limit of another kind may answer `{"detail": str}`.
_RATE_LIMITED = {
    "content": {
        "application/json": {
            "schema": {
                "anyOf": [
                    _DENIAL["content"]["application/json"]["schema"],
                    _ERROR["content"]["application/json"]["schema"],
                ]
            }
        }
    }
}


def error_responses(*codes: int, denial: bool = False) -> dict[int | str, dict[str, Any]]:
    """The `responses` of a route: 400, 401, 403, 429, 503, 504 and `codes`, each with its body
    schema.

    Every route may answer 429: each authenticated request counts against its API key's limit,
    and failed authentications against the client's (ratelimit.py). With `denial`, 402/403/429 are
    documented as the spec's flat DenialEnvelope.
    """
    names = {
        400: "Bad request",
        401: "Missing or unknown API key",
        402: "Billing denial (credit or wallet layer)",
        403: "Role not allowed, or quota denial",
        404: "Chat or run not found",
        409: "Conflict with the chat's state",
        413: "Request body too large",
        415: "Unsupported media type",
        422: "Idempotency-Key reused with another request",
        429: "Rate limited",
        503: "A backing service is unavailable",
        504: "Timed out",
    }
    result: dict[int | str, dict[str, Any]] = {}
    for code in (400, 401, 403, *codes, 429, 503, 504):
        shape = (
            _DENIAL
            if denial and code in (402, 403, 429)
            else _RATE_LIMITED
            if code == 429
            else _ERROR
        )
        result[code] = {"description": names.get(code, "Error"), **shape}
    return result


# pydantic's names of numeric bounds and their JSON Schema keywords
_BOUND_KEYWORDS = {
    "ge": "minimum",
    "le": "maximum",
    "gt": "exclusiveMinimum",
    "lt": "exclusiveMaximum",
    "multiple_of": "multipleOf",
}


def json_schema_bounds(document: Any) -> Any:
    """`document` (an OpenAPI document, changed in place and returned) with every numeric schema's
    bounds under their JSON Schema keywords.

    Why: a bound applied after a validator function, as `Query(ge=1, le=500)` on `WholeNumber`
    (query.py: its digits check runs before the integer parsing), is written by pydantic (2.14)
    as `"ge": 1, "le": 500`, which JSON Schema ignores: the document allowed `?limit=-128`, which
    the server refuses (security tester, schemathesis). Only schemas whose `type` is integer or
    number are changed, so a property that happens to be named `ge` is left alone.
    """
    stack = [document]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") in ("integer", "number"):
                for name, keyword in _BOUND_KEYWORDS.items():
                    if name in node and keyword not in node:
                        node[keyword] = node.pop(name)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return document
