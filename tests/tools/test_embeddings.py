"""The embedding models of knowledge search (services/tools/embeddings.py).

LocalEmbedder is checked against embeddings_reference.json: vectors that the real
sentence-transformers computed for the same texts from the same package's files (its "source"
says how). OpenAIEmbedder talks to a fake OpenAI-compatible server on 127.0.0.1, port 0.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import socket
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from services.tools import embeddings
from services.tools.embeddings import Embedder, EmbeddingError, LocalEmbedder, OpenAIEmbedder

REFERENCE = json.loads((Path(__file__).parent / "embeddings_reference.json").read_text())
KEY = "sk-test-secret-key-4242"
BODY_MARKER = "PROVIDER-BODY-TEXT"


@pytest.fixture(scope="module")
def local() -> LocalEmbedder:
    """One loaded LocalEmbedder for the module (the weights load once)."""
    embedder = LocalEmbedder()
    embedder.embed_sync(["load"])
    return embedder


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def long_text(words: int) -> str:
    return " ".join(f"word{i % 50} of the long chunk" for i in range(words // 5))


# --- LocalEmbedder -----------------------------------------------------------------------


def test_local_matches_sentence_transformers(local: LocalEmbedder) -> None:
    vectors = local.embed_sync(REFERENCE["texts"])
    expected = np.array(REFERENCE["embeddings"], dtype=np.float32)
    assert vectors.shape == (6, 384) and vectors.dtype == np.float32
    assert np.abs(vectors - expected).max() < 1e-4
    for row, reference in zip(vectors, expected, strict=True):
        assert cosine(row, reference) > 0.9999
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_local_satisfies_the_protocol(local: LocalEmbedder) -> None:
    embedder: Embedder = local
    assert (embedder.provider, embedder.model) == ("local", "all-MiniLM-L6-v2")
    assert (embedder.dimensions, embedder.max_tokens) == (384, 256)


def test_local_truncates_texts_beyond_256_tokens(local: LocalEmbedder) -> None:
    text = REFERENCE["texts"][3]
    assert local.count_tokens(text) > 256
    longer = text + " and then many more words that the model never sees" * 20
    same = local.embed_sync([text, longer])
    assert np.array_equal(same[0], same[1])


def test_local_count_tokens_are_wordpieces_without_special_tokens(local: LocalEmbedder) -> None:
    assert local.count_tokens("") == 0
    assert local.count_tokens("hello world") == 2
    assert local.count_tokens("embeddings") == 4  # em ##bed ##ding ##s
    assert local.count_tokens("Unbelievably tokenised!") == 8
    assert local.count_tokens("東京") == 2  # one token per CJK character
    assert local.count_tokens(long_text(1000)) > 1000


def test_local_paraphrase_is_closer_than_unrelated_text(local: LocalEmbedder) -> None:
    query, paraphrase, unrelated = local.embed_sync(
        [
            "How do I reset my password?",
            "I forgot my password and need to change it.",
            "The train to Lyon leaves at nine in the morning.",
        ]
    )
    assert cosine(query, paraphrase) > cosine(query, unrelated) + 0.3


def test_local_keeps_input_order_across_length_sorted_batches() -> None:
    embedder = LocalEmbedder(batch_size=2)
    texts = [long_text(200), "short", long_text(40), "a", "medium length text here", ""]
    together = embedder.embed_sync(texts)
    for text, row in zip(texts, together, strict=True):
        assert np.allclose(embedder.embed_sync([text])[0], row, atol=1e-5)


def test_local_finds_numpys_blas_thread_setting() -> None:
    # Without it every worker's matmuls spread over all cores and spin: 5x slower when busy.
    assert embeddings._blas_threads_setter() is not None


def test_local_embeds_an_empty_list(local: LocalEmbedder) -> None:
    vectors = local.embed_sync([])
    assert vectors.shape == (0, 384) and vectors.dtype == np.float32


async def test_local_concurrent_embeds_load_once_and_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[int] = []
    prepare = embeddings._prepare

    def counted(*args: Any) -> dict[str, Any]:
        loads.append(1)
        return prepare(*args)

    monkeypatch.setattr(embeddings, "_prepare", counted)
    embedder = LocalEmbedder(batch_size=4)  # not loaded: both calls race to load it
    first = REFERENCE["texts"] + [long_text(120)]
    second = [long_text(60), "concurrent", REFERENCE["texts"][0]]
    a, b = await asyncio.gather(embedder.embed(first), embedder.embed(second))
    assert np.allclose(a, embedder.embed_sync(first), atol=1e-5)
    assert np.allclose(b, embedder.embed_sync(second), atol=1e-5)
    assert np.abs(a[:6] - np.array(REFERENCE["embeddings"])).max() < 1e-4
    assert loads == [1]


async def test_local_event_loop_keeps_running_while_a_batch_embeds(local: LocalEmbedder) -> None:
    ticks: list[float] = []

    async def ticker() -> None:
        while True:
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.01)

    task = asyncio.create_task(ticker())
    started = time.perf_counter()
    vectors = await local.embed([f"{i} " + long_text(200) for i in range(24)])
    elapsed = time.perf_counter() - started
    task.cancel()
    assert vectors.shape == (24, 384)
    gaps = np.diff([started, *ticks])
    assert elapsed > 0.3  # the batch took real time, during which the loop kept ticking:
    assert len(ticks) > elapsed / 0.01 / 4 and gaps.max() < 0.25


# --- OpenAIEmbedder against a fake OpenAI-compatible server ----------------------------------


class FakeEmbeddingsAPI(http.server.BaseHTTPRequestHandler):
    """POST /v1/embeddings: vector [len(text), 1, 0, 0, ...] per input (width `dimensions` or
    8), listed in reverse order with their index. `mode` makes it answer 401/500, stall, or
    answer 8 wide whatever was asked (narrow), or one vector short (short)."""

    mode = "ok"
    seen: list[dict[str, Any]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append({**request, "authorization": self.headers.get("Authorization")})
        if self.mode == "stall":
            time.sleep(2)
        status, payload = 200, dict[str, Any]()
        if self.mode in ("401", "500"):  # bodies that echo the key and carry a marker
            status = int(self.mode)
            payload = {"error": {"message": f"Incorrect API key {KEY} {BODY_MARKER}"}}
        else:
            width = 8 if self.mode == "narrow" else request.get("dimensions", 8)
            if self.mode == "short":  # one vector fewer than texts
                request["input"] = request["input"][1:]
            data = [
                {
                    "object": "embedding",
                    "index": i,
                    "embedding": [len(t), 1.0] + [0.0] * (width - 2),
                }
                for i, t in enumerate(request["input"])
            ]
            payload = {"object": "list", "data": data[::-1], "model": request["model"]}
        body = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence request logs
        return


@pytest.fixture
def fake_api() -> Iterator[tuple[str, type[FakeEmbeddingsAPI]]]:
    """(base URL ending in /v1, the handler class whose `mode` and `seen` tests use)."""
    handler = type("Handler", (FakeEmbeddingsAPI,), {"mode": "ok", "seen": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    server.block_on_close = False
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", handler
    finally:
        server.shutdown()
        server.server_close()


async def test_openai_batches_of_256_in_input_order_normalised(fake_api: Any) -> None:
    url, handler = fake_api
    embedder = OpenAIEmbedder(url, KEY, "text-embedding-3-small")
    texts = ["x" * (i % 7 + 1) for i in range(600)]
    vectors = await embedder.embed(texts)
    await embedder.aclose()
    assert [len(r["input"]) for r in handler.seen] == [256, 256, 88]
    assert all(r["authorization"] == f"Bearer {KEY}" for r in handler.seen)
    assert all(r["model"] == "text-embedding-3-small" for r in handler.seen)
    assert "dimensions" not in handler.seen[0]
    assert vectors.shape == (600, 8) and vectors.dtype == np.float32
    assert embedder.dimensions == 8  # learnt from the answer
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)
    lengths = np.array([len(t) for t in texts], dtype=np.float32)
    assert np.allclose(vectors[:, 0], lengths / np.sqrt(lengths**2 + 1), atol=1e-6)


async def test_openai_asks_for_configured_dimensions(fake_api: Any) -> None:
    url, handler = fake_api
    embedder = OpenAIEmbedder(url, KEY, "text-embedding-3-large", dimensions=16)
    vectors = await embedder.embed(["one", "two"])
    assert handler.seen[0]["dimensions"] == 16
    assert vectors.shape == (2, 16)
    assert (await embedder.embed([])).shape == (0, 16)
    assert len(handler.seen) == 1  # nothing to embed asks nothing


def assert_leaks_nothing(error: EmbeddingError) -> None:
    shown = str(error) + repr(error) + "".join(traceback.format_exception(error))
    assert KEY not in shown and BODY_MARKER not in shown


@pytest.mark.parametrize(
    ("mode", "status", "reason"),
    [
        ("401", 401, "the embeddings API refused the key (401)"),
        ("500", 500, "the embeddings API answered HTTP 500"),
    ],
)
async def test_openai_refusals_raise_embedding_error_without_key_or_body(
    fake_api: Any, mode: str, status: int, reason: str
) -> None:
    url, handler = fake_api
    handler.mode = mode
    embedder = OpenAIEmbedder(url, KEY, "text-embedding-3-small", max_retries=0)
    with pytest.raises(EmbeddingError) as caught:
        await embedder.embed(["hello"])
    assert (caught.value.reason, caught.value.status) == (reason, status)
    assert str(caught.value) == reason
    assert_leaks_nothing(caught.value)


async def test_openai_retries_a_500_twice_by_default(fake_api: Any) -> None:
    url, handler = fake_api
    handler.mode = "500"
    with pytest.raises(EmbeddingError):
        await OpenAIEmbedder(url, KEY, "m").embed(["hello"])
    assert len(handler.seen) == 3


async def test_openai_timeout_raises_embedding_error(fake_api: Any) -> None:
    url, handler = fake_api
    handler.mode = "stall"
    embedder = OpenAIEmbedder(url, KEY, "m", timeout_s=0.3, max_retries=0)
    started = time.perf_counter()
    with pytest.raises(EmbeddingError) as caught:
        await embedder.embed(["hello"])
    assert time.perf_counter() - started < 1.5
    assert caught.value.reason == "the embeddings API did not answer within 0.3s"
    assert_leaks_nothing(caught.value)


async def test_openai_unreachable_raises_embedding_error() -> None:
    with socket.socket() as bound:  # bound, not listening: connections are refused
        bound.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound.getsockname()[1]}/v1"
        embedder = OpenAIEmbedder(url, KEY, "m", max_retries=0)
        with pytest.raises(EmbeddingError) as caught:
            await embedder.embed(["hello"])
    assert caught.value.reason == "the embeddings API could not be reached"


async def test_openai_answer_of_another_width_is_an_error(fake_api: Any) -> None:
    url, handler = fake_api
    handler.mode = "narrow"  # ignores the dimensions asked for
    embedder = OpenAIEmbedder(url, KEY, "m", dimensions=16)
    with pytest.raises(EmbeddingError) as caught:
        await embedder.embed(["hello"])
    assert caught.value.reason == "the embeddings API returned 8 dimensions, not 16"


async def test_openai_answer_missing_a_vector_is_an_error(fake_api: Any) -> None:
    url, handler = fake_api
    handler.mode = "short"
    with pytest.raises(EmbeddingError) as caught:
        await OpenAIEmbedder(url, KEY, "m").embed(["one", "two"])
    assert caught.value.reason == "the embeddings API did not return one vector per text"
