"""The web console: static pages under /console, served by the gateway from `console/`.

The pages are plain HTML, CSS and JavaScript modules committed to the repository (no build step, no
CDN); they call the same HTTP API as any client, with the API key the user typed, kept in the tab's
sessionStorage. Every answer carries a Content-Security-Policy that allows only this origin's
scripts and styles and no inline script, so a model's or tool's output that slipped into the page as
markup still could not run (the pages also insert such text as text only).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse, RedirectResponse
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.staticfiles import StaticFiles
from starlette.types import Message, Receive, Scope, Send

CONSOLE_PATH = "/console"
CONSOLE_DIR = Path(__file__).with_name("console")

# What the console's answers may load and do: same-origin scripts, styles, images and fetches only;
# no inline script, no plugin, no framing (clickjacking), no <base> tricks, forms post here only.
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    # the assets change with each release; revalidate (ETag) rather than run a stale page
    "cache-control": "no-cache",
}


class ConsoleFiles(StaticFiles):
    """StaticFiles that adds SECURITY_HEADERS to every answer, its refusals included (answered
    here in the API's `{"detail": ...}` shape rather than raised past the headers)."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        try:
            return await super().get_response(path, scope)
        except HTTPException as refused:
            allow = {"Allow": "GET, HEAD"} if refused.status_code == 405 else {}
            return JSONResponse(
                {"detail": refused.detail}, refused.status_code, headers=refused.headers or allow
            )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    (name, value)
                    for name, value in message.get("headers", [])
                    if name.decode("latin-1").lower() not in SECURITY_HEADERS
                ]
                headers += [(k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]
                message = {**message, "headers": headers}
            await send(message)

        await super().__call__(scope, receive, send_with_headers)


async def _to_console() -> RedirectResponse:
    # a relative-path Location: never built from the request's Host header
    return RedirectResponse(f"{CONSOLE_PATH}/", status_code=308)


def serve_console(app: FastAPI) -> None:
    """Mount the console at /console/ (its index at /console/, /console redirects there)."""
    app.add_api_route(CONSOLE_PATH, _to_console, methods=["GET", "HEAD"], include_in_schema=False)
    app.mount(CONSOLE_PATH, ConsoleFiles(directory=CONSOLE_DIR, html=True), name="console")
