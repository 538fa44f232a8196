"""The gateway's HTTP server spans: opentelemetry-instrumentation-asgi around the whole app.

`traced(app)` wraps the gateway's app, the lean turn requests of hot_path.py included, in
OpenTelemetryMiddleware when tracing is on (services/common/tracing.py), and returns the app
unchanged when it is off. Each request's server span is named `{METHOD} {route template}`
(`span_details`: the two turn requests by their fixed shape, any other by the route the router
chose, renamed when its answer starts; a path no route serves by its method alone), so ids
never make span names unbounded. It carries the request's id (`loopline.request_id`: the
X-Request-ID the response returns) and no query string (an OAuth callback's `code` is one).
The probes and /metrics are not traced. The server's own `send` is left in the scope for the
SSE fast path (listener.SERVER_SEND), so event frames never pass through the instrumentation.
"""

from __future__ import annotations

from typing import Any

from starlette.routing import Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common import request_ids, tracing
from services.gateway.listener import SERVER_SEND

TURN_ROUTE = "/assistant/chat"
LISTEN_ROUTE = "/assistant/chat/{chat_id}/listen/{run_id}"
UNTRACED = "/healthz$,/readyz$,/metrics$"  # probes and scrapes (tracing.asgi_middleware)
_SPAN = "loopline.server_span"  # scope key: the request's server span
_LEAN = "loopline.lean_route"  # scope key: the span was named by `lean_route`
HTTP_ROUTE = "http.route"
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def lean_route(scope: Scope) -> str | None:
    """The route template of the two turn requests, told by their shape before any routing (as
    hot_path.GatewayApp tells them); None for any other request."""
    path = scope.get("path", "")
    if path == TURN_ROUTE:
        return TURN_ROUTE
    if (
        scope.get("method") == "GET"
        and path.startswith("/assistant/chat/")
        and path.count("/") == 5
    ):
        if path.split("/")[4] == "listen":
            return LISTEN_ROUTE
    return None


def routed_template(scope: Scope) -> str | None:
    """The template of the route the router chose for `scope` (FastAPI and Starlette leave it in
    `scope["route"]` before the endpoint runs), None when no route was chosen (a 404)."""
    route = scope.get("route")
    template = getattr(route, "path_format", None)
    if not isinstance(template, str):
        return None
    return f"{template}/{{path}}" if isinstance(route, Mount) else template


def _header(headers: Any, name: bytes) -> bytes | None:
    for key, value in headers or ():
        if key.lower() == name:
            return value
    return None


def _request_hook(span: Any, scope: Scope) -> None:
    """At the server span's start: drop the query string from its attributes (it may hold an
    OAuth code or state) and note the span in the scope (`_note_response`)."""
    scope[_SPAN] = span
    if scope.get("query_string"):
        attributes = getattr(span, "attributes", None) or {}
        url = attributes.get("http.url")
        if isinstance(url, str):
            span.set_attribute("http.url", url.split("?", 1)[0])
        if "url.query" in attributes:
            span.set_attribute("url.query", "REDACTED")


def _note_response(scope: Scope, message: Message) -> None:
    """At the response's start: a span still named by its method alone takes the template of
    the route that serves it, and the X-Request-ID the response returns (the request's id,
    accepted or made by access_log.RequestLog) goes on it."""
    span = scope.get(_SPAN)
    if span is None:
        return
    if _LEAN not in scope:
        template = routed_template(scope)
        if template is not None:
            span.update_name(f"{_method(scope)} {template}")
            span.set_attribute(HTTP_ROUTE, template)
    returned = _header(message.get("headers"), request_ids.HEADER)
    if returned is not None:
        span.set_attribute(tracing.REQUEST_ID, returned.decode("latin-1"))


def _method(scope: Scope) -> str:
    """The request's method for a span name (HTTP for a method outside the known ones)."""
    method = scope.get("method", "")
    return method if method in _METHODS else "HTTP"


class TracedApp:
    """The gateway's ASGI app inside OpenTelemetryMiddleware (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._traced = tracing.asgi_middleware(app, self.span_details, _request_hook, UNTRACED)

    @staticmethod
    def span_details(scope: Scope) -> tuple[str, dict[str, Any]]:
        """(span name, attributes) of a request as it starts: `{METHOD} {template}` and
        `http.route` for the two turn requests, else the method alone, renamed with the route's
        template once the router has chosen it (`_note_response`; a 404 keeps the method)."""
        template = lean_route(scope)
        if template is None:
            return _method(scope), {}
        scope[_LEAN] = True
        return f"{_method(scope)} {template}", {HTTP_ROUTE: template}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope[SERVER_SEND] = send  # the server's own (hot_path.GatewayApp keeps it)

        async def noting(message: Message) -> None:
            if message["type"] == "http.response.start":
                _note_response(scope, message)
            await send(message)

        await self._traced(scope, receive, noting)


def traced(app: ASGIApp) -> ASGIApp:
    """`app` with HTTP server spans when tracing is on; `app` itself when it is off."""
    return TracedApp(app) if tracing.enabled() else app
