"""The gateway's access log and request ids: one JSON line per HTTP request.

`RequestLog` is made at the top of `GatewayApp.__call__`, the outermost level of the application
(the two requests of every turn are served ahead of FastAPI and its middleware: hot_path.py).
It takes the request's `X-Request-ID` when it is 1-128 characters of `[A-Za-z0-9._-]`, else
makes one (32 hex characters), binds it in the log context as `request_id` (every line logged
while the request is served carries it, and every internal gRPC call sends it on:
services/common/request_ids.py), and adds it to the response's headers, errors and event
streams included. When the request has been answered (an event stream: when it ends), it logs
one line, `request`, through the services' JSON logging (logger `loopline.access`, INFO):
`method`, `route` (the route's template, `/assistant/chat/{chat_id}`, never the path with its
ids; null for a path no route serves), `status` (0: the client left before any answer),
`duration_ms`, `org_id` (once authenticated) and `request_id`. uvicorn's own access log stays
off (the raw path, no organization).

Answers the HTTP server gives before a request reaches the application (uvicorn's 400 for a
malformed request, http_limits.py's 408, 431 and the 503 of too many connections) carry no id
and make no line.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.types import Message, Scope

from services.common import logging as loopline_logging
from services.common import request_ids

ACCESS = logging.getLogger("loopline.access")

#: Scope keys: the organization of the authenticated caller (ratelimit.RequestLimits sets it)
#: and the route template of a request a lean handler serves (hot_path.py).
ORGANIZATION = "loopline.organization_id"
ROUTE = "loopline.route"


class RequestLog:
    """The access-log record of one HTTP request (see the module docstring)."""

    __slots__ = ("request_id", "status", "_header", "_started", "_token")

    def __init__(self, scope: Scope) -> None:
        given = None
        for name, value in scope["headers"]:
            if name == request_ids.HEADER:
                given = value
                break
        self.request_id = request_id = request_ids.accept_or_make(given)
        self.status = 0  # until the response starts
        self._header = (request_ids.HEADER, request_id.encode("ascii"))
        self._started = time.perf_counter()
        self._token = loopline_logging.bind_token(request_id=request_id)

    def response_start(self, message: Message) -> Message:
        """`message` (`http.response.start`) with the X-Request-ID header; keeps its status."""
        self.status = message["status"]
        message["headers"] = [*message.get("headers", ()), self._header]
        return message

    def end(self, scope: Scope) -> None:
        """Log the request's line (when INFO is on) and unbind its id (in the context that
        bound it)."""
        try:
            if ACCESS.isEnabledFor(logging.INFO):
                ACCESS.info("request", extra={"fields": self.fields(scope)})
        finally:
            loopline_logging.unbind(self._token)

    def fields(self, scope: Scope) -> dict[str, Any]:
        """The access line's fields for the request of `scope`."""
        fields: dict[str, Any] = {
            "method": scope["method"],
            "route": route_template(scope),
            "status": self.status,
            "duration_ms": round((time.perf_counter() - self._started) * 1000, 2),
        }
        organization = scope.get(ORGANIZATION)
        if organization is not None:
            fields["org_id"] = organization
        fields["request_id"] = self.request_id
        return fields


def route_template(scope: Scope) -> str | None:
    """The template of the route that served `scope`'s request, or None when none did.

    FastAPI puts its matched APIRoute in the scope; a plain Starlette route or mount (the OpenAPI
    document, the docs' assets) leaves only its endpoint there, found among the app's routes (a
    few requests, never a turn's); a lean handler of hot_path.py sets ROUTE."""
    route = scope.get("route")
    if route is None and (endpoint := scope.get("endpoint")) is not None:
        routes = getattr(getattr(scope.get("app"), "router", None), "routes", ())
        route = next(
            (r for r in routes if endpoint in (getattr(r, "endpoint", None), getattr(r, "app", 0))),
            None,
        )
    template: str | None = getattr(route, "path_format", None) or scope.get(ROUTE)
    return template
