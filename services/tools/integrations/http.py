"""The `http` integration: one HTTP request to a URL the outbound policy allows.

Every connection goes through `services.tools.netpolicy` (loopback, link-local and
private destinations are refused unless the operator allows them). Redirects are not
followed: the model sees the 3xx status and the `location` header and may call again,
so every hop passes the same checks and a credential is never sent to a second host.
The response body is read up to the output cap (less 2 KiB for status and headers) and
no further; `body_truncated` tells when it was cut.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from services.common import pb
from services.tools import failures
from services.tools.catalogue import ActionContext, ActionError
from services.tools.netpolicy import OutboundPolicyError, guarded_client

if TYPE_CHECKING:
    import httpx

MANIFEST: dict[str, Any] = {
    "name": "http",
    "display_name": "HTTP",
    "description": "Send an HTTP request to a public URL and read the response (status, headers, "
    "body).",
    "categories": ["developer-tools", "web"],
    "auth": [
        {
            "type": "none",
            "label": "No authentication",
            "description": "Anonymous requests.",
            "fields": None,
        },
        {
            "type": "bearer",
            "label": "Bearer token",
            "description": "Sent as `Authorization: Bearer <token>`.",
            "fields": {
                "type": "object",
                "properties": {"token": {"type": "string", "minLength": 1, "writeOnly": True}},
                "required": ["token"],
                "additionalProperties": False,
            },
        },
        {
            "type": "api_key",
            "label": "API key header",
            "description": "Sent in the header `header_name` (default X-API-Key).",
            "fields": {
                "type": "object",
                "properties": {
                    "api_key": {"type": "string", "minLength": 1, "writeOnly": True},
                    "header_name": {"type": "string", "minLength": 1, "default": "X-API-Key"},
                },
                "required": ["api_key"],
                "additionalProperties": False,
            },
        },
    ],
    "actions": [
        {
            "name": "request",
            "description": "Send one HTTP request. JSON responses come back parsed in `json`, "
            "others as text in `body`.",
            "parameters": {
                "type": "object",
                "properties": {
                    "method": {
                        "type": "string",
                        "enum": ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"],
                        "default": "GET",
                    },
                    "url": {
                        "type": "string",
                        "pattern": "^https?://",
                        "description": "An http:// or https:// URL.",
                    },
                    "headers": {"type": "object", "additionalProperties": {"type": "string"}},
                    "query": {
                        "type": "object",
                        "additionalProperties": {"type": ["string", "number", "boolean"]},
                        "description": "Query-string parameters to add.",
                    },
                    "body": {
                        "description": "Request body: a string is sent as is, an object or array "
                        "as JSON.",
                        "type": ["string", "object", "array", "null"],
                    },
                },
                "required": ["url"],
                "additionalProperties": False,
            },
            "credit_cost_millicredits": 200,
            # any method to any URL: it may do anything a request can
            "effects": ["create", "update", "send", "delete"],
        }
    ],
}


def _auth_headers(ctx: ActionContext) -> dict[str, str]:
    """The credential's header. Its values are used with surrounding whitespace stripped: a token
    pasted with a trailing newline (common) is sent as the token; a line break inside one is a
    header error (`failures.BAD_HEADER`), whose message never quotes the value."""
    secret = ctx.secret or {}
    if ctx.auth_type == "bearer":
        return {"Authorization": f"Bearer {str(secret['token']).strip()}"}
    if ctx.auth_type == "api_key":
        return {
            (str(secret.get("header_name") or "").strip() or "X-API-Key"): str(
                secret["api_key"]
            ).strip()
        }
    return {}


async def request(ctx: ActionContext, params: dict[str, Any]) -> dict[str, Any]:
    """{"status_code", "url", "headers": {name: value}, "json" | "body", "body_truncated": bool}.

    A JSON body comes back parsed in `json` (its parts nested deeper than pb.MAX_JSON_DEPTH as
    their JSON text: the tools service clips every output, services/common/pb.py); one too deep
    for `json.loads` itself (about 1,000 levels), or holding NaN, Infinity or a number beyond a
    double's range (`pb.loads_strict`), comes back as text in `body`.

    Raises ActionError when the policy refuses the destination or the request fails
    (connection refused, TLS error, ...), naming the failure's kind (`services.tools.failures`),
    never the library's text. A 4xx/5xx status is a result, not an error.
    """
    headers, content, query = _outgoing(ctx, params)
    # Leave room for the status, headers and envelope so that a cut body still fits the output cap.
    limit = max(1024, ctx.max_output_bytes - 2048)
    import httpx  # loaded on the first request, not at start (see netpolicy)

    try:
        async with guarded_client(ctx.allow_private_network, ctx.timeout_s) as client:
            async with client.stream(
                params.get("method", "GET"),
                params["url"],
                headers=headers,
                params=query or None,
                content=content,
            ) as response:
                chunks: list[bytes] = []
                size = 0
                truncated = False
                async for chunk in response.aiter_bytes():
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > limit:
                        truncated = True
                        break
                raw = b"".join(chunks)[:limit]
    # built by netpolicy from the URL's host (the model's own input) and a kind
    except OutboundPolicyError as exc:
        raise ActionError(str(exc)) from exc
    except httpx.InvalidURL as exc:  # its text quotes the URL: the kind is enough
        raise ActionError(failures.INVALID_URL) from exc
    # a header (the model's or the credential's) with a character that is not ASCII
    except UnicodeEncodeError as exc:
        raise ActionError(f"the request could not be sent: {failures.BAD_HEADER}") from exc
    except UnicodeError:  # a host label that is empty or over 63 characters (IDNA)
        raise ActionError("invalid URL: the host name is not valid") from None
    # the kind only: h11 quotes an illegal header value, the token in it
    except httpx.HTTPError as exc:
        raise ActionError(f"the HTTP request failed: {failures.http_failure(exc)}") from exc
    return _result(response, raw, truncated)


def _outgoing(
    ctx: ActionContext, params: dict[str, Any]
) -> tuple[dict[str, str], bytes | None, dict[str, str]]:
    """The request's headers (the model's, then the credential's), body and query string: a
    string body is sent as is, any other as JSON; a boolean query value as true/false."""
    headers = dict(params.get("headers") or {})
    headers.update(_auth_headers(ctx))
    body = params.get("body")
    content: bytes | None = None
    if isinstance(body, str):
        content = body.encode()
    elif body is not None:
        content = json.dumps(body).encode()
        headers.setdefault("Content-Type", "application/json")
    query = {
        k: str(v).lower() if isinstance(v, bool) else str(v)
        for k, v in (params.get("query") or {}).items()
    }
    return headers, content, query


def _result(response: httpx.Response, raw: bytes, truncated: bool) -> dict[str, Any]:
    """The action's result for `response`, whose body (maybe cut) is `raw`: JSON parsed in
    `json` when it is whole and parses, else text in `body`; no set-cookie header."""
    result: dict[str, Any] = {
        "status_code": response.status_code,
        "url": str(response.url),
        "headers": {k: v for k, v in response.headers.items() if k.lower() != "set-cookie"},
        "body_truncated": truncated,
    }
    text = raw.decode(response.encoding or "utf-8", errors="replace")
    if not truncated and "json" in response.headers.get("content-type", ""):
        try:
            result["json"] = pb.loads_strict(text)
            return result
        except ValueError:  # not JSON (NaN and 1e400 included), or nested past json.loads
            pass
    result["body"] = text
    return result


HANDLERS = {"request": request}
