"""Model calls reuse their provider connections: one kept SDK client per provider, base URL and
key (services/orchestrator/providers/clients.py), against a local HTTPS fake provider that
counts the TCP connections it accepts and the TLS handshakes it completes."""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

import pytest

from services.orchestrator.providers.clients import ClientSpec, ProviderClients
from services.orchestrator.providers.openai_compat import OpenAICompatModel
from services.orchestrator.providers.retry import RetryPolicy
from tests.conftest import start_stack, stop_stack
from tests.orchestrator.helpers import types
from tests.orchestrator.providers.fakes import (
    FakeLLMServer,
    Reply,
    anthropic_end,
    anthropic_start,
    anthropic_text_block,
    anthropic_tool_block,
    openai_text,
    openai_tool_call,
)
from tests.sse_client import read_frames
from tests.tools.fake_apis import make_test_ca

USER = [{"role": "user", "content": "hello"}]
# no summary call: each turn makes exactly the model calls its replies script
FAST = {"llm_retry_base_delay_s": 0.01, "llm_timeout_s": 10.0, "summarization_budget_tokens": 0}


class HttpsFakeLLMServer(FakeLLMServer):
    """FakeLLMServer behind TLS: counts accepted TCP connections (`connections`), completed TLS
    handshakes (`handshakes`) and connections still open (`open`; `all_closed` is set when none
    is)."""

    def __init__(self, replies: list[Reply], tls: ssl.SSLContext) -> None:
        super().__init__(replies)
        self.tls = tls
        self.connections = 0
        self.handshakes = 0
        self.open = 0
        self.all_closed = asyncio.Event()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    async def __aenter__(self) -> HttpsFakeLLMServer:
        # plain TCP first, TLS on top: an accepted socket is counted before its handshake
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        self.all_closed.clear()
        try:
            try:
                await writer.start_tls(self.tls)
            except (ssl.SSLError, ConnectionError):
                writer.close()
                return
            self.handshakes += 1
            await self._handle(reader, writer)
        finally:
            self.open -= 1
            if self.open == 0:
                self.all_closed.set()


@pytest.fixture
def provider_tls(tmp_path, monkeypatch) -> ssl.SSLContext:
    """The fake provider's server TLS context; its certificate is trusted the way a deployment
    trusts a private CA: SSL_CERT_FILE."""
    ca_file, cert_file, key_file = make_test_ca(tmp_path, ["localhost"])
    monkeypatch.setenv("SSL_CERT_FILE", ca_file)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    return context


def three_steps(provider: str) -> list[Reply]:
    """A turn of three model calls: two tool calls, then the answer."""
    if provider == "openai":
        return [
            Reply(events=openai_tool_call("get_available_integrations", "{}", call_id="call_1")),
            Reply(events=openai_tool_call("get_available_integrations", "{}", call_id="call_2")),
            Reply(events=openai_text("Three ", "integrations.")),
        ]
    replies = []
    for tool_id in ("toolu_1", "toolu_2"):
        events = [anthropic_start()] + anthropic_tool_block(
            0, "get_available_integrations", "{}", tool_id=tool_id
        )
        replies.append(Reply(events=events + anthropic_end(5, "tool_use")))
    answer = [anthropic_start()] + anthropic_text_block(0, "Three ", "integrations.")
    replies.append(Reply(events=answer + anthropic_end(4)))
    return replies


def provider_settings(provider: str, url: str) -> dict[str, Any]:
    """Orchestrator settings pointing `provider`'s platform key at the fake."""
    if provider == "openai":
        return {
            "openai_base_url": f"{url}/v1",
            "openai_api_key": "sk-platform-key-123456",
            "openai_models": "gpt-test",
        }
    return {
        "anthropic_base_url": url,
        "anthropic_api_key": "sk-ant-platform-123456",
        "anthropic_models": "claude-test",
    }


LLM = {
    "openai": {"integration_name": "openai", "provider_id": "openai", "model_id": "gpt-test"},
    "anthropic": {
        "integration_name": "anthropic",
        "provider_id": "anthropic",
        "model_id": "claude-test",
    },
}


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_turns_of_several_model_calls_share_one_connection_closed_at_shutdown(
    tmp_path, provider_tls, provider
):
    # two turns on one chat: 3 model calls (tool, tool, answer), then 3 more
    replies = three_steps(provider) + three_steps(provider)
    async with HttpsFakeLLMServer(replies, provider_tls) as server:
        stack = await start_stack(
            tmp_path, orchestrator={**provider_settings(provider, server.url), **FAST}
        )
        try:
            chat_id = None
            async with stack.client() as client:
                for _ in range(2):
                    body: dict[str, Any] = {"message": "Which apps?", "llm": LLM[provider]}
                    if chat_id:
                        body["chat_id"] = chat_id
                    started = await client.post("/assistant/chat", json=body)
                    assert started.status_code == 200, started.text
                    chat_id = started.json()["chat_id"]
                    frames = await read_frames(client, started.json()["stream_url"])
                    assert types(frames).count("tool_result") == 2 and types(frames)[-1] == "done"
                    assert frames[-1]["data"]["response"] == "Three integrations."
            kept = list(stack.orchestrator.provider_clients._entries.values())
        finally:
            await stop_stack(stack)
        assert len(server.requests) == 6
        assert (server.connections, server.handshakes) == (1, 1)
        assert len(kept) == 1 and kept[0].client.is_closed()
        # the shutdown closed the kept connection
        await asyncio.wait_for(server.all_closed.wait(), 10)


class Collector:
    def __init__(self) -> None:
        self.chunks: list[str] = []
        self.first = asyncio.Event()

    async def __call__(self, chunk: str) -> None:
        self.chunks.append(chunk)
        self.first.set()


async def test_cancel_closes_the_stream_of_a_kept_client_and_the_next_call_still_works(
    provider_tls,
):
    hanging = Reply(events=openai_text("partial ")[:2], end="hang")
    async with HttpsFakeLLMServer([hanging, Reply(events=openai_text("fine"))], provider_tls) as (
        server
    ):
        clients = ProviderClients()
        model = OpenAICompatModel(
            "openai",
            "gpt-test",
            base_url=f"{server.url}/v1",
            api_key="sk-test-123456",
            policy=RetryPolicy(max_retries=0),
            timeout_s=5,
            clients=clients,
        )
        user = [{"role": "user", "content": "hi"}]
        chunks = Collector()
        task = asyncio.create_task(model.generate(user, [], chunks))
        await asyncio.wait_for(chunks.first.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(server.disconnected.wait(), 5)
        reply = await model.generate(user, [], Collector())
        assert reply.text == "fine"
        # the cancelled stream's connection was closed, the client kept: a new connection
        assert len(clients) == 1 and server.connections == 2
        await clients.aclose()
        await asyncio.wait_for(server.all_closed.wait(), 10)


class FakeClient:
    """Stands in for an SDK client: records whether it was closed."""

    def __init__(self, spec: ClientSpec) -> None:
        self.spec = spec
        self.closed = False

    async def close(self) -> None:
        self.closed = True


def spec(key: str, base_url: str = "https://api.example/v1") -> ClientSpec:
    return ClientSpec("openai", base_url, key, 120.0)


async def test_one_client_per_provider_base_url_and_key():
    clients = ProviderClients()
    async with clients.lease(spec("sk-a"), FakeClient) as first:
        async with clients.lease(spec("sk-a"), FakeClient) as same:
            assert same is first
    async with clients.lease(spec("sk-b"), FakeClient) as other_key:
        assert other_key is not first
    async with clients.lease(spec("sk-a", "https://other.example/v1"), FakeClient) as other_url:
        assert other_url is not first
    anthropic = ClientSpec("anthropic", first.spec.base_url, "sk-a", 120.0)
    async with clients.lease(anthropic, FakeClient) as other_kind:
        assert other_kind is not first
    assert len(clients) == 4 and not first.closed


def test_the_key_is_kept_out_of_the_cache_key_and_the_repr():
    key = "sk-org-own-SECRET-123456"
    assert key not in repr(spec(key)) and key not in repr(spec(key).cache_key)


async def test_the_least_recently_used_client_is_evicted_and_closed_when_no_call_uses_it():
    clients = ProviderClients(max_clients=2)
    async with clients.lease(spec("sk-1"), FakeClient) as one:
        pass
    async with clients.lease(spec("sk-2"), FakeClient) as two:
        pass
    async with clients.lease(spec("sk-1"), FakeClient):  # sk-1 used last: sk-2 goes next
        pass
    async with clients.lease(spec("sk-3"), FakeClient):
        assert two.closed and not one.closed
    assert len(clients) == 2


async def test_an_evicted_client_in_use_is_closed_when_its_call_ends():
    clients = ProviderClients(max_clients=1)
    async with clients.lease(spec("sk-1"), FakeClient) as busy:
        async with clients.lease(spec("sk-2"), FakeClient):
            assert not busy.closed  # its call is still streaming
        assert not busy.closed
    assert busy.closed and len(clients) == 1


async def test_shutdown_closes_every_client_and_later_calls_get_their_own():
    clients = ProviderClients()
    async with clients.lease(spec("sk-1"), FakeClient) as idle:
        pass
    async with clients.lease(spec("sk-2"), FakeClient) as busy:
        await clients.aclose()
        assert idle.closed and not busy.closed
    assert busy.closed and len(clients) == 0
    async with clients.lease(spec("sk-1"), FakeClient) as late:
        assert late is not idle
    assert late.closed and len(clients) == 0


async def test_a_client_that_fails_to_close_never_fails_the_call(caplog):
    class Broken(FakeClient):
        async def close(self) -> None:
            raise RuntimeError("sk-secret-in-the-error")

    clients = ProviderClients(max_clients=0)
    async with clients.lease(spec("sk-1"), Broken):
        pass
    records = [r for r in caplog.records if r.name.endswith("providers.clients")]
    assert [r.getMessage() for r in records] == ["closing a provider client failed"]
    assert records[0].fields == {"error_class": "RuntimeError"}
    assert "sk-secret-in-the-error" not in caplog.text


class GatedFakeLLMServer(FakeLLMServer):
    """FakeLLMServer that holds every answer until `gate` requests are waiting at once."""

    def __init__(self, replies: list[Reply], gate: int) -> None:
        super().__init__(replies)
        self.gate = gate
        self.opened = asyncio.Event()

    async def __aenter__(self) -> GatedFakeLLMServer:
        # a backlog for every call connecting at once (asyncio's default, 100, resets the rest)
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, backlog=4096)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _respond(self, reply, reader, writer) -> bool:  # noqa: ANN001
        if len(self.requests) >= self.gate:
            self.opened.set()
        try:
            await asyncio.wait_for(self.opened.wait(), 20)
        except TimeoutError:
            return await super()._respond(Reply(status=503, body={}), reader, writer)
        return await super()._respond(reply, reader, writer)


async def test_more_streamed_calls_than_the_sdks_default_pool_are_in_flight_at_once():
    # the SDKs' own pool holds 1,000 connections, and a streamed call holds one for its answer
    calls = 1_001
    async with GatedFakeLLMServer([Reply(events=openai_text("hi"))], gate=calls) as server:
        clients = ProviderClients()
        model = OpenAICompatModel(
            "openai",
            "gpt-test",
            base_url=f"{server.url}/v1",
            api_key="sk-test",
            policy=RetryPolicy(max_retries=0, base_delay_s=0.01, max_delay_s=0.01),
            timeout_s=30,
            clients=clients,
        )

        async def on_text(chunk: str) -> None:
            return None

        replies = await asyncio.gather(*(model.generate(USER, [], on_text) for _ in range(calls)))
        await clients.aclose()
    assert server.opened.is_set() and {reply.text for reply in replies} == {"hi"}
