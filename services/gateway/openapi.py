"""The gateway's OpenAPI document: what the routes declare beside FastAPI's own, and its pages.

- Errors: every route declares 400, 401, 403, 429, 503 and 504 plus its own; billing denials
  (402/403/429) and the gateway's rate limits (429) are the flat DenialEnvelope, everything else
  `{"detail": str}`.
- Authentication: an operation that needs an API key declares it with `keyed` (the `api_key`
  bearer scheme and the X-Organization-ID header; the turn start also Idempotency-Key). These
  are declarations only: the handlers read the headers themselves, so their 400s and 401s stay
  the documented ones, and nothing is added to a request's work.
- `finish_document` completes FastAPI's document once (security scheme, JSON Schema bounds, no
  422 the gateway never sends); `serve_docs` serves Swagger UI and ReDoc from local assets.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from loopline.assistant.v1 import events_pb2
from services.common.ids import MAX_ORG_ID_CHARS
from services.gateway.idempotency import MAX_KEY_LENGTH

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


# ---- authentication -----------------------------------------------------------------------

API_KEY = "api_key"  # the security scheme's name (Swagger UI's Authorize dialog shows it)
SECURITY_SCHEMES = {
    API_KEY: {
        "type": "http",
        "scheme": "bearer",
        "bearerFormat": "API key",
        "description": "`Authorization: Bearer <api key>`; missing, unknown, revoked or "
        "expired: 401. The key's user must be owner or admin of the X-Organization-ID "
        "organization (any member on /auth/me), and a key bound to an organization is used in "
        "that one (else 403).",
    }
}
ORGANIZATION_ID = {
    "name": "X-Organization-ID",
    "in": "header",
    "required": True,
    "description": "The organization the request acts in; missing or malformed: 400.",
    "schema": {
        "type": "string",
        "minLength": 1,
        "maxLength": MAX_ORG_ID_CHARS,
        "pattern": "^[!-~]+$",  # visible ASCII (services/common/ids.py)
    },
}
# The header where it is optional (`GET /auth/me`): with it, the caller's role there.
OPTIONAL_ORGANIZATION_ID = {
    **ORGANIZATION_ID,
    "required": False,
    "description": "An organization of the caller: the answer then gives the role there (403 "
    "when not a member); malformed: 400.",
}
IDEMPOTENCY_KEY = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "description": "Makes a retry safe: the same key and body replay the first answer "
    "(`Idempotent-Replayed: true`) and start nothing; another body is 422, a retry while the "
    "first runs 409.",
    "schema": {"type": "string", "minLength": 1, "maxLength": MAX_KEY_LENGTH},
}


REQUEST_ID_DESCRIPTION = (
    "The request's id, on every log line and span of the request in every service: the one "
    "sent when it is 1-128 characters of `[A-Za-z0-9._-]`, else a new one (32 hex characters)."
)
# Any value is taken (one that is not an id is replaced), so the schema refuses nothing.
REQUEST_ID = {
    "name": "X-Request-ID",
    "in": "header",
    "required": False,
    "description": REQUEST_ID_DESCRIPTION,
    "schema": {"type": "string"},
}
REQUEST_ID_HEADER = {
    "description": REQUEST_ID_DESCRIPTION,
    "schema": {"type": "string", "pattern": "^[A-Za-z0-9._-]{1,128}$"},
}


def keyed(
    extra: dict[str, Any] | None = None,
    *,
    idempotent: bool = False,
    organization_optional: bool = False,
) -> dict[str, Any]:
    """`openapi_extra` of an operation that needs an API key: `extra` (its request body or
    parameters) with the `api_key` security requirement and the X-Organization-ID header
    (optional with `organization_optional`), and with `idempotent` the Idempotency-Key header
    too."""
    operation = dict(extra or {})
    organization = OPTIONAL_ORGANIZATION_ID if organization_optional else ORGANIZATION_ID
    headers = [organization, IDEMPOTENCY_KEY] if idempotent else [organization]
    operation["parameters"] = [*operation.get("parameters", []), *headers]
    operation["security"] = [{API_KEY: []}]
    return operation


# ---- success answers that are not JSON ----------------------------------------------------

# The `type` of a frame: one per event of the run's stream (the oneof of events.proto), and the
# heartbeat the gateway sends after silence.
FRAME_TYPES = [
    *(field.name for field in events_pb2.Event.DESCRIPTOR.oneofs_by_name["payload"].fields),
    "heartbeat",
]
# One SSE event of a listen, as OpenAPI describes an event stream (Open API 3.2 "Server-Sent
# Events"; `schema` of text/event-stream in 3.1): its `data` is a frame's JSON. Each type's
# `data` is in docs/events.md and, as JSON Schema, schemas/sse-frame.json.
EVENT_STREAM = {
    "description": "The run's events as Server-Sent Events: each `data: <json>` and a blank "
    "line, no `event:` or `id:` line; the stream ends after the run's last event. A heartbeat "
    "frame comes after 15 s of silence.",
    "content": {
        "text/event-stream": {
            "schema": {
                "type": "object",
                "properties": {
                    "data": {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {
                            "type": "object",
                            "properties": {
                                "type": {"enum": FRAME_TYPES},
                                "data": {
                                    "type": "object",
                                    "description": "The event's payload (none in a heartbeat).",
                                },
                            },
                            "required": ["type"],
                        },
                    },
                    "event": {"const": "message", "description": "No `event:` line is sent."},
                },
                "required": ["data"],
            }
        }
    },
}


# ---- the document -------------------------------------------------------------------------


def finish_document(document: dict[str, Any]) -> dict[str, Any]:
    """FastAPI's `document` completed (changed in place and returned): the `api_key` security
    scheme the operations name, numeric bounds as JSON Schema keywords (`json_schema_bounds`),
    the X-Request-ID header on every operation and every answer (access_log.py), and without
    FastAPI's 422 "Validation Error", which the gateway never sends (a request that
    fails validation is 400 `{"detail": ...}`, application.py)."""
    json_schema_bounds(document)
    components = document.setdefault("components", {})
    components["securitySchemes"] = SECURITY_SCHEMES
    fastapi_422 = {"$ref": "#/components/schemas/HTTPValidationError"}
    for operations in document.get("paths", {}).values():
        for operation in operations.values():
            operation.setdefault("parameters", []).append(REQUEST_ID)
            responses = operation.get("responses", {})
            for response in responses.values():
                headers = response.setdefault("headers", {})
                headers["X-Request-ID"] = REQUEST_ID_HEADER
            declared = responses.get("422", {}).get("content", {}).get("application/json", {})
            if declared.get("schema") == fastapi_422:
                del responses["422"]
    schemas = components.get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    if not schemas:
        components.pop("schemas", None)
    return document


# ---- /docs and /redoc ---------------------------------------------------------------------

DOCS_STATIC = "/docs/static"  # the pages' scripts, styles and icon (the fastapi-offline package)


def serve_docs(app: FastAPI) -> None:
    """Serve Swagger UI at /docs and ReDoc at /redoc with their assets at DOCS_STATIC, from the
    fastapi-offline package: the pages need no CDN (nor Google's fonts) and work offline.

    Swagger UI's Authorize button takes the API key; "Try it out" sends the operation's headers.
    """
    app.mount(
        DOCS_STATIC, StaticFiles(packages=[("fastapi_offline", "static")]), name="docs-static"
    )
    openapi_url = app.openapi_url or "/openapi.json"

    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{DOCS_STATIC}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{DOCS_STATIC}/swagger-ui.css",
            swagger_favicon_url=f"{root}{DOCS_STATIC}/favicon.png",
            # no badge fetched from validator.swagger.io
            swagger_ui_parameters={"validatorUrl": None, "tryItOutEnabled": True},
        )

    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{DOCS_STATIC}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{DOCS_STATIC}/favicon.png",
            with_google_fonts=False,
        )

    app.add_api_route("/docs", swagger_ui, methods=["GET"], include_in_schema=False)
    app.add_api_route("/redoc", redoc, methods=["GET"], include_in_schema=False)
