"""The development organization's first turn: what seeding printed, the banner with a curl pair
to start a turn, and --smoke, which drives that turn once over HTTP."""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

import httpx

from scripts.dev_processes import Failure, console

CHAT_EXAMPLE = '{"message":"What integrations are available?"}'


def seeded_identity(output: str, command: str) -> dict[str, Any]:
    """The last JSON line with organization_id and api_key that the seed-dev `command` printed."""
    seeded = None
    for line in reversed(output.splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict) and {"organization_id", "api_key"} <= value.keys():
            seeded = value
            break
    if seeded is None:
        raise Failure(
            f"`{command}` printed no JSON line with "
            "organization_id and api_key; it printed:\n" + (output.strip() or "(nothing)"),
            "gateway",
        )
    return seeded


def print_banner(url: str, seeded: dict[str, Any], logs: str, stays_up: bool) -> None:
    """The gateway's and the console's URLs, the organization, the API key, the logs and curl
    commands to try a turn; with `stays_up`, how to stop."""
    org, key = str(seeded["organization_id"]), str(seeded["api_key"])
    auth = f"-H {_q(f'Authorization: Bearer {key}')} -H {_q(f'X-Organization-ID: {org}')}"
    post = (
        f"curl -sS -X POST {url}/assistant/chat {auth} "
        f"-H \"Content-Type: application/json\" -d '{CHAT_EXAMPLE}'"
    )
    chain = (
        f'R=$({post}) && echo "$R" && '
        'U=$(printf \'%s\' "$R" | sed -n \'s/.*"stream_url" *: *"\\([^"]*\\)".*/\\1/p\') && '
        f'curl -sS -N "{url}$U" {auth}'
    )
    console.say(
        "\n".join(
            [
                "",
                "Loopline is running.",
                f"  gateway          {url}",
                f"  console          {url}/console/  (sign in with the key and organization id)",
                f"  organization id  {org}",
                f"  API key          {key}",
                f"  logs             {logs}",
                "",
                "1) Start a turn (the answer holds chat_id, run_id and stream_url):",
                "",
                f"curl -sS -X POST {url}/assistant/chat \\",
                f"  -H {_q(f'Authorization: Bearer {key}')} \\",
                f"  -H {_q(f'X-Organization-ID: {org}')} \\",
                '  -H "Content-Type: application/json" \\',
                f"  -d '{CHAT_EXAMPLE}'",
                "",
                "2) Listen to it (put in the chat_id and run_id from the answer):",
                "",
                f"curl -N {url}/assistant/chat/CHAT_ID/listen/RUN_ID \\",
                f"  -H {_q(f'Authorization: Bearer {key}')} \\",
                f"  -H {_q(f'X-Organization-ID: {org}')}",
                "",
                "Or both in one line (POSIX shell, no jq or python needed):",
                "",
                chain,
                "",
                "Press Ctrl-C to stop all four services." if stays_up else "",
            ]
        )
    )


def smoke(url: str, seeded: dict[str, Any]) -> int:
    """Drive the printed curl pair once over HTTP and check the stream ends with `done`."""
    headers = {
        "Authorization": f"Bearer {seeded['api_key']}",
        "X-Organization-ID": str(seeded["organization_id"]),
    }
    with httpx.Client(base_url=url, trust_env=False, timeout=30.0) as client:
        response = client.post("/assistant/chat", headers=headers, json=json.loads(CHAT_EXAMPLE))
        console.say(f"[smoke] POST /assistant/chat -> {response.status_code} {response.text}")
        if response.status_code != 200:
            raise Failure("the smoke turn was refused", "gateway")
        body = response.json()
        path = (
            body.get("stream_url") or f"/assistant/chat/{body['chat_id']}/listen/{body['run_id']}"
        )
        types = []
        with client.stream("GET", path, headers=headers) as stream:
            if stream.status_code != 200:
                raise Failure(f"GET {path} answered {stream.status_code}", "gateway")
            for line in stream.iter_lines():
                if not line.startswith("data: "):
                    continue
                frame = json.loads(line[len("data: ") :])
                types.append(frame.get("type"))
                console.say(f"[smoke] {line}")
        if not types or types[-1] != "done":
            raise Failure(f"the stream ended without a done frame: {types}", "orchestrator")
    console.say(f"[smoke] OK: {' -> '.join(str(t) for t in types)}")
    return 0


def _q(value: str) -> str:
    """Double-quote `value` for a shell when that is safe, else single-quote it."""
    if re.fullmatch(r"[A-Za-z0-9 _.:/=+@,%-]*", value):
        return f'"{value}"'
    return shlex.quote(value)
