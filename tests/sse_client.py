"""A raw SSE reader for tests: frames exactly as they arrive on the wire."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import httpx
import jsonschema

_SCHEMA = json.loads(
    (pathlib.Path(__file__).resolve().parents[1] / "schemas" / "sse-frame.json").read_text()
)
_VALIDATOR = jsonschema.Draft202012Validator(
    _SCHEMA, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
)


def validate_frame(frame: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError unless `frame` matches schemas/sse-frame.json."""
    _VALIDATOR.validate(frame)


async def read_frames(
    client: httpx.AsyncClient,
    url: str,
    *,
    heartbeats: bool = False,
    params: dict[str, Any] | None = None,
    raw: list[bytes] | None = None,
    limit: int = 10_000,
) -> list[dict[str, Any]]:
    """GET `url` and return its frames (parsed JSON) until the server ends the stream.

    Raises AssertionError when a frame is not exactly `data: <json>\\n\\n`. `raw`, when given,
    receives the raw frame bytes. Heartbeats are dropped unless `heartbeats` is true.
    """
    frames: list[dict[str, Any]] = []
    async with client.stream(
        "GET", url, params=params, timeout=httpx.Timeout(30, read=30)
    ) as response:
        assert response.status_code == 200, (response.status_code, await response.aread())
        assert response.headers["content-type"].startswith("text/event-stream")
        buffer = b""
        async for chunk in response.aiter_bytes():
            buffer += chunk
            while b"\n\n" in buffer:
                frame, buffer = buffer.split(b"\n\n", 1)
                if raw is not None:
                    raw.append(frame + b"\n\n")
                assert frame.startswith(b"data: "), frame
                assert b"\n" not in frame, frame
                data = json.loads(frame[len(b"data: ") :])
                validate_frame(data)
                if data.get("type") == "heartbeat" and not heartbeats:
                    continue
                frames.append(data)
                if len(frames) >= limit:
                    return frames
        assert buffer == b"", buffer
    return frames
