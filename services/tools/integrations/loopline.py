"""The `loopline` integration: small utilities that need no credential (demos and checks)."""

from __future__ import annotations

import asyncio
import datetime
import zoneinfo
from typing import Any

from services.tools.catalogue import ActionContext, ActionError

MANIFEST: dict[str, Any] = {
    "name": "loopline",
    "display_name": "Loopline utilities",
    "description": "Built-in utilities that need no credential: echo a message, read the current "
    "time, wait a while.",
    "categories": ["utilities"],
    "auth": [
        {
            "type": "none",
            "label": "No authentication",
            "description": "Always available.",
            "fields": None,
        }
    ],
    "actions": [
        {
            "name": "echo",
            "description": "Return the message unchanged (a no-op round trip).",
            "parameters": {
                "type": "object",
                "properties": {"message": {"type": "string"}},
                "required": ["message"],
                "additionalProperties": False,
            },
            "credit_cost_millicredits": 0,
        },
        {
            "name": "now",
            "description": "The current date and time, in UTC or an IANA time zone.",
            "parameters": {
                "type": "object",
                "properties": {
                    "timezone": {
                        "type": "string",
                        "default": "UTC",
                        "description": "IANA name, e.g. Europe/Paris.",
                    }
                },
                "additionalProperties": False,
            },
            "credit_cost_millicredits": 0,
        },
        {
            "name": "wait",
            "description": "Wait for a number of seconds (at most 300), then return; for demos of "
            "long actions and cancel.",
            "parameters": {
                "type": "object",
                "properties": {"seconds": {"type": "number", "minimum": 0, "maximum": 300}},
                "required": ["seconds"],
                "additionalProperties": False,
            },
            "credit_cost_millicredits": 0,
        },
    ],
}


async def echo(ctx: ActionContext, params: dict[str, Any]) -> dict[str, Any]:
    """{"message": <the message>}."""
    return {"message": params["message"]}


async def now(ctx: ActionContext, params: dict[str, Any]) -> dict[str, Any]:
    """{"timezone", "iso": "2026-06-20T12:00:01+02:00", "unix": seconds}. ActionError for an unknown
    zone."""
    name = params.get("timezone") or "UTC"
    try:
        zone = zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError) as exc:
        raise ActionError(f"unknown time zone {name!r}") from exc
    moment = datetime.datetime.now(zone)
    return {"timezone": name, "iso": moment.isoformat(), "unix": int(moment.timestamp())}


async def wait(ctx: ActionContext, params: dict[str, Any]) -> dict[str, Any]:
    """{"waited_seconds": n} after sleeping n seconds; cancellable (the tool call's cancel stops
    it)."""
    seconds = float(params["seconds"])
    await asyncio.sleep(seconds)
    return {"waited_seconds": seconds}


HANDLERS = {"echo": echo, "now": now, "wait": wait}
