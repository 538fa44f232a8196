"""A fast, deterministic stand-in for the embedding model, for tests about storage and flow.

Each word is hashed into one of DIMENSIONS buckets; a text's vector is its bucket counts,
normalized. Texts that share words are close, as with a real model, at no CPU cost.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np

from services.tools.knowledge_indexer import EmbeddingSpec, EmbeddingUnavailable

DIMENSIONS = 64


class HashingEmbedder:
    """Bag-of-hashed-words vectors; `fail` makes every call raise EmbeddingUnavailable."""

    provider, model, dimensions = "local", "all-MiniLM-L6-v2", DIMENSIONS

    def __init__(self, fail: str = "") -> None:
        self.fail = fail
        self.calls = 0

    async def embed(self, texts: list[str]) -> np.ndarray:
        self.calls += 1
        if self.fail:
            raise EmbeddingUnavailable(self.fail)
        rows = np.zeros((len(texts), DIMENSIONS), dtype=np.float32)
        for i, text in enumerate(texts):
            for word in re.findall(r"\w+", text.lower()):
                rows[i, hashlib.blake2b(word.encode(), digest_size=2).digest()[0] % DIMENSIONS] += 1
        norms = np.linalg.norm(rows, axis=1, keepdims=True)
        return rows / np.where(norms == 0, 1, norms)

    async def __call__(self, org_id: str, spec: EmbeddingSpec) -> HashingEmbedder:
        return self
