"""Client-visible text is built, never passed through (docs/security.md).

Passed through, a stored secret reaches the client, the thread and the model in clear: an
`http` bearer token pasted with a trailing newline makes h11's error quote the header value
with the newline escaped (`b'Bearer tok…\\n'`), which exact-match redaction misses, and the
whole token goes into the `tool_result` frame, the stored chat, the orchestrator's database
and the next model call. A pattern-based scrub of a model failure's text lets an internal host
name without a dotted suffix (`db-internal-7`) through. These tests drive each
case through the public API (scripted model, real services, a local HTTP server) and look
for the secret, in each of its encodings, in every place a client or the model can read.
"""

from __future__ import annotations

import base64
import http.server
import json
import threading
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select

from services.orchestrator.models import Base
from services.orchestrator.providers.base import ModelError, TokenUsage
from services.orchestrator.providers.scripted import ScriptedModel
from services.tools.crypto import redact
from tests.conftest import script
from tests.sse_client import read_frames
from tests.tools.tools_stack import tools_stack

HOST, ADDRESS, PATH = "db-internal-7", "10.20.30.40", "/etc/loopline/secrets/db.pem"
INTERNAL = f"could not reach {HOST} ({ADDRESS}:5432): cannot read {PATH}"


# ---------------------------------------------------------------- a server that echoes credentials


class _Echo(http.server.BaseHTTPRequestHandler):
    """Answers as careless servers do, quoting the credential it got (Authorization, X-API-Key):
    /json: 401 with a JSON error body holding it; /escaped: 400 with that JSON as text/plain (its
    escapes kept); /redirect: 302 to a URL holding it URL-encoded; /basic: 401 naming the user and
    the password of a Basic header."""

    received: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        given = self.headers.get("Authorization") or self.headers.get("X-API-Key") or ""
        type(self).received.append(given)
        status, kind, body, extra = 200, "application/json", b"{}", {}
        if self.path.startswith("/json"):
            status, body = (
                401,
                json.dumps({"error": "invalid credentials", "received": given}).encode(),
            )
        elif self.path.startswith("/escaped"):
            status, kind = 400, "text/plain"
            body = json.dumps({"error": f"invalid key {given}"}).encode()
        elif self.path.startswith("/redirect"):
            status, body = 302, b""
            extra = {
                "Location": "https://login.example.com/callback?key="
                + urllib.parse.quote(given, safe="")
            }
        elif self.path.startswith("/basic"):
            user, _, password = base64.b64decode(given.split(" ", 1)[1]).decode().partition(":")
            status, body = (
                401,
                json.dumps(
                    {"error": f"wrong password {password} for user {user}", "header": given}
                ).encode(),
            )
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for name, value in extra.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence request logs
        return


@pytest.fixture
def echo_server() -> Iterator[str]:
    _Echo.received = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def model_inputs(monkeypatch) -> list[Any]:
    """Every `messages` list the scripted model is called with (the model calls of the stack)."""
    seen: list[Any] = []
    generate = ScriptedModel.generate

    async def recording(self, messages, tools, on_text, **kwargs):  # noqa: ANN001
        seen.append(json.loads(json.dumps(messages, default=str)))
        return await generate(self, messages, tools, on_text, **kwargs)

    monkeypatch.setattr(ScriptedModel, "generate", recording)
    return seen


# ------------------------------------------------------------ where a client or the model can read


def forms(secret: str) -> set[str]:
    """The forms a leak of `secret` takes: as is (and stripped), JSON-escaped, URL-encoded,
    base64."""
    found = set()
    for value in {secret, secret.strip()}:
        found |= {
            value,
            json.dumps(value)[1:-1],
            urllib.parse.quote(value, safe=""),
            base64.b64encode(value.encode()).decode(),
        }
    return {f for f in found if len(f) >= 4}


def leaks(value: Any, needles: set[str], where: str = "") -> list[str]:
    """Where in `value` (a JSON value, text, bytes, database rows) any of `needles` shows; JSON
    text found in a string is looked into as well."""
    found: list[str] = []
    if isinstance(value, (bytes, bytearray, memoryview)):
        value = bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, str):
        if any(n in value for n in needles):
            found.append(f"{where}: {value[:200]!r}")
        stripped = value.strip()
        if stripped[:1] in ("{", "[", '"'):
            try:
                found += leaks(json.loads(stripped), needles, where + "(json)")
            except ValueError:
                pass
    elif isinstance(value, dict):
        for key, item in value.items():
            found += leaks(key, needles, f"{where}.key") + leaks(item, needles, f"{where}.{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found += leaks(item, needles, f"{where}[{index}]")
    return found


async def orchestrator_rows(services) -> list[dict[str, Any]]:
    """Every row of every orchestrator table, as {column: value}."""
    rows = []
    async with services.orchestrator.runner.sessions() as session:
        for table in Base.metadata.sorted_tables:
            for row in (await session.execute(select(table))).mappings():
                rows.append({"table": table.name, **{k: v for k, v in row.items()}})
    return rows


async def everywhere(
    services, client, chat_id: str, frames: list[dict[str, Any]], model_inputs: list[Any]
) -> dict[str, Any]:
    """What a client and the model can read of a chat: its SSE frames, GET /assistant/chat/{id},
    the orchestrator's database and every model call."""
    chat = await client.get(f"/assistant/chat/{chat_id}")
    assert chat.status_code == 200, chat.text
    return {
        "frames": frames,
        "chat": chat.json(),
        "database": await orchestrator_rows(services),
        "model": model_inputs,
    }


def assert_nowhere(places: dict[str, Any], *secrets: str) -> None:
    needles = set().union(*(forms(s) for s in secrets))
    found = [hit for name, value in places.items() for hit in leaks(value, needles, name)]
    assert not found, "\n".join(found[:10])


async def _turn(
    client, *steps: dict[str, Any], chat_id: str | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    body = {"message": script(*steps), **({"chat_id": chat_id} if chat_id else {})}
    started = await client.post("/assistant/chat", json=body)
    assert started.status_code == 200, started.text
    return started.json(), await read_frames(client, started.json()["stream_url"])


async def _credential(client, auth_type: str, auth_data: dict[str, Any]) -> str:
    created = await client.post(
        "/credentials",
        json={"integration_name": "http", "auth_type": auth_type, "auth_data": auth_data},
    )
    assert created.status_code in (200, 201), created.text
    return created.json()["credential_id"]


def _request(url: str, credential_id: str) -> dict[str, Any]:
    return {
        "tool": "execute_integration_tool",
        "input": {
            "integration": "http",
            "action": "request",
            "parameters": {"url": url},
            "credential_id": credential_id,
        },
    }


def _tool_result(frames: list[dict[str, Any]]) -> dict[str, Any]:
    return next(f for f in frames if f["type"] == "tool_result")["data"]["output"]


# ------------------------------------------------------------ the `http` integration's credentials


async def test_a_token_pasted_with_a_trailing_newline_is_sent_stripped_and_shows_nowhere(
    tmp_path, echo_server, model_inputs
):
    token = "tok-newline-5829-secret\n"
    async with tools_stack(tmp_path) as stack, stack.client() as client:
        credential = await _credential(client, "bearer_token", {"token": token})
        body, frames = await _turn(
            client, _request(f"{echo_server}/json", credential), {"say": "done"}
        )
        places = await everywhere(stack, client, body["chat_id"], frames, model_inputs)
    assert len(model_inputs) == 2  # the call after the tool result read it
    assert_nowhere(places, token)
    assert [f["type"] for f in frames] == [
        "metadata",
        "tool_call",
        "tool_result",
        "response_chunk",
        "done",
    ], frames
    # the server got the token without the newline (the request was sent); its echo came back
    # redacted
    assert _Echo.received == ["Bearer tok-newline-5829-secret"]
    result = _tool_result(frames)["result"]
    assert result["status_code"] == 401 and result["json"]["received"] == "Bearer ***"


async def test_a_line_break_inside_a_token_is_a_header_error_that_never_quotes_it(
    tmp_path, echo_server, model_inputs
):
    token = "tok-inner\nbreak-6620-secret"
    async with tools_stack(tmp_path) as stack, stack.client() as client:
        credential = await _credential(client, "bearer_token", {"token": token})
        body, frames = await _turn(
            client, _request(f"{echo_server}/json", credential), {"say": "done"}
        )
        places = await everywhere(stack, client, body["chat_id"], frames, model_inputs)
    assert_nowhere(places, "tok-inner", "break-6620-secret", token)
    assert _Echo.received == []
    result = _tool_result(frames)
    assert result["success"] is False
    assert (
        result["error"] == "http.request failed: the HTTP request failed: "
        "a header name or value is not valid HTTP (a line break or a character that is not ASCII)"
    )


async def test_a_token_a_server_puts_url_encoded_in_a_redirect_shows_nowhere(
    tmp_path, echo_server, model_inputs
):
    key = "uRlKey/9931+s3cret=end"
    async with tools_stack(tmp_path) as stack, stack.client() as client:
        credential = await _credential(client, "api_key", {"api_key": key})
        body, frames = await _turn(
            client, _request(f"{echo_server}/redirect", credential), {"say": "done"}
        )
        places = await everywhere(stack, client, body["chat_id"], frames, model_inputs)
    assert_nowhere(places, key)
    result = _tool_result(frames)["result"]
    assert (
        result["status_code"] == 302
        and result["headers"]["location"] == "https://login.example.com/callback?key=***"
    )


async def test_a_token_a_server_echoes_json_escaped_in_an_error_body_shows_nowhere(
    tmp_path, echo_server, model_inputs
):
    key = 'esc\\aped"key-4471-secret'  # a backslash and a quote: JSON escapes both
    async with tools_stack(tmp_path) as stack, stack.client() as client:
        credential = await _credential(client, "api_key", {"api_key": key})
        body, frames = await _turn(
            client, _request(f"{echo_server}/escaped", credential), {"say": "done"}
        )
        places = await everywhere(stack, client, body["chat_id"], frames, model_inputs)
    assert_nowhere(places, key)
    assert _Echo.received == [key]
    result = _tool_result(frames)["result"]
    assert result["status_code"] == 400 and result["body"] == '{"error": "invalid key ***"}'


async def test_the_user_and_password_of_a_basic_header_show_nowhere(
    tmp_path, echo_server, model_inputs
):
    encoded = base64.b64encode(b"alice:pw-hunter-2207").decode()
    async with tools_stack(tmp_path) as stack, stack.client() as client:
        credential = await _credential(
            client, "api_key", {"api_key": f"Basic {encoded}", "header_name": "Authorization"}
        )
        body, frames = await _turn(
            client, _request(f"{echo_server}/basic", credential), {"say": "done"}
        )
        places = await everywhere(stack, client, body["chat_id"], frames, model_inputs)
    assert_nowhere(places, "pw-hunter-2207", encoded, "alice:pw-hunter-2207")
    assert _tool_result(frames)["result"]["json"] == {
        "error": "wrong password *** for user alice",
        "header": "***",
    }


# ------------------------------------------------------------ a tool's or a model's failure text


@pytest.mark.parametrize(
    "raised", [OSError(INTERNAL), RuntimeError(INTERNAL)], ids=["driver-error", "unexpected-error"]
)
async def test_a_tool_failure_naming_a_host_an_address_and_a_path_shows_none_of_them(
    tmp_path, monkeypatch, model_inputs, raised
):
    import asyncpg

    async def connect(*_args: Any, **_kwargs: Any) -> Any:
        raise raised

    monkeypatch.setattr(asyncpg, "connect", connect)
    call = {
        "tool": "execute_integration_tool",
        "input": {"integration": "postgresql", "action": "list_schemas", "parameters": {}},
    }
    async with tools_stack(tmp_path) as stack, stack.client() as client:
        created = await client.post(
            "/credentials",
            json={
                "integration_name": "postgresql",
                "auth_data": {"dsn": f"postgresql://app:pw-db-0991@{HOST}:5432/app"},
            },
        )
        assert created.status_code in (200, 201), created.text
        body, frames = await _turn(client, call, {"say": "done"})
        places = await everywhere(stack, client, body["chat_id"], frames, model_inputs)
    assert len(model_inputs) == 2
    assert_nowhere(places, HOST, ADDRESS, PATH, "secrets/db.pem", "pw-db-0991")
    result = _tool_result(frames)
    assert result["success"] is False
    if isinstance(raised, OSError):
        assert (
            result["error"] == "postgresql.list_schemas failed: could not connect to PostgreSQL: "
            "the server could not be reached or broke the connection"
        )
    else:
        assert (
            result["error"]
            == "postgresql.list_schemas failed: an internal error in the integration (logged)"
        )


async def test_a_model_failure_naming_a_host_an_address_and_a_path_shows_none_of_them(
    tmp_path, monkeypatch, model_inputs
):
    recording = ScriptedModel.generate  # records the call (fixture model_inputs), then answers

    async def fails_when_asked(self, messages, tools, on_text, **kwargs):  # noqa: ANN001
        if (
            messages[-1]["content"] == "please fail"
        ):  # a provider's failure whose text names internal places
            await recording(self, messages, tools, on_text, **kwargs)
            raise ModelError(
                f"upstream error: {INTERNAL}", usage=TokenUsage(input_tokens=3, output_tokens=1)
            )
        return await recording(self, messages, tools, on_text, **kwargs)

    monkeypatch.setattr(ScriptedModel, "generate", fails_when_asked)
    async with tools_stack(tmp_path) as stack, stack.client() as client:
        started = await client.post("/assistant/chat", json={"message": "please fail"})
        assert started.status_code == 200, started.text
        body = started.json()
        frames = await read_frames(client, body["stream_url"])
        _, after = await _turn(
            client, {"say": "next"}, chat_id=body["chat_id"]
        )  # the next model call reads the thread
        places = await everywhere(stack, client, body["chat_id"], frames + after, model_inputs)
    assert len(model_inputs) == 2
    assert_nowhere(places, HOST, ADDRESS, PATH, "secrets/db.pem")
    assert [f["type"] for f in frames][-2:] == ["error", "done"]
    assert frames[-2]["data"]["message"] == "scripted: the model call failed"
    assert after[-1]["data"]["response"] == "next"


# ---------------------------------------------------------------- the redaction pass itself


@pytest.mark.parametrize(
    ("secret", "text"),
    [
        (
            {"token": "tok-abc-123\n"},
            "Illegal header value b'Bearer tok-abc-123\\n'",
        ),  # h11's message: the newline escaped
        ({"token": "tok-abc-123\n"}, "got tok-abc-123 back"),  # stripped, as sent
        ({"token": "tok\tabc\r123"}, "header 'tok\\tabc\\r123' refused"),  # backslash escapes
        ({"api_key": 'q"uo\\te-key'}, '{"error": "bad key q\\"uo\\\\te-key"}'),  # JSON escapes
        (
            {"api_key": "k€y-ünicode"},
            '{"error": "bad key k\\u20acy-\\u00fcnicode"}',
        ),  # JSON \\u escapes
        ({"api_key": "a/b+c=d&e"}, "https://x.example/cb?k=a%2Fb%2Bc%3Dd%26e"),  # URL-encoded
        ({"api_key": "a/b+c=d&e"}, "https://x.example/cb?k=a%2fb%2bc%3dd%26e"),  # lower-case hex
        ({"api_key": "two words key"}, "q=two+words+key"),  # form-encoded
        (
            {"api_key": "alice:pw-1234"},
            "Authorization: Basic YWxpY2U6cHctMTIzNA==",
        ),  # base64 inside Basic
        (
            {"api_key": "Basic YWxpY2U6cHctMTIzNA=="},
            "wrong password pw-1234 for alice",
        ),  # what a Basic header holds
        (
            {"dsn": "postgresql://u:p%40ss-99@db/x"},
            "password p@ss-99 refused",
        ),  # a URL's password, percent-decoded
        (
            {"url": "https://mcp.example", "headers": {"Authorization": "Bearer mcp-tok-77"}},
            "echo mcp-tok-77",
        ),  # nested
    ],
)
def test_redaction_knows_every_encoding_a_secret_takes_in_an_error(secret, text):
    redacted = redact(text, secret)
    assert "***" in redacted, redacted
    for value in (
        "tok-abc-123",
        "tok\tabc\r123",
        "tok\\tabc\\r123",
        'q"uo\\te-key',
        'q\\"uo\\\\te-key',
        "k\\u20acy",
        "a%2Fb",
        "a%2fb",
        "two+words",
        "YWxpY2U6cHctMTIzNA",
        "pw-1234",
        "p@ss-99",
        "p%40ss-99",
        "mcp-tok-77",
    ):
        assert value not in redacted, (value, redacted)


def test_redaction_leaves_a_header_name_and_text_without_the_secret_alone():
    assert (
        redact("send X-API-Key: ***", {"api_key": "k-123456", "header_name": "X-API-Key"})
        == "send X-API-Key: ***"
    )
    assert redact("nothing secret here", {"token": "tok-abc-123"}) == "nothing secret here"
