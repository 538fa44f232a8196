"""Which embedding model serves a knowledge base: the local one, or the organization's API.

The local model (all-MiniLM-L6-v2, embeddings.LocalEmbedder) is loaded once per process, on
first use. An "openai" knowledge base is embedded through the OpenAI-compatible API at the
deployment's `LOOPLINE_EMBEDDING_OPENAI_BASE_URL` with the key of the organization's
credential (integration "openai"); its client is kept for CLIENT_TTL_S so connections are
reused, and read again after that so a rotated or deleted key takes effect.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from cachetools import TTLCache

from services.tools.crypto import SecretBoxError
from services.tools.knowledge_indexer import EmbeddingSpec, EmbeddingUnavailable

if TYPE_CHECKING:
    import numpy as np

CLIENT_TTL_S = 300.0


class _Checked:
    """An embedder whose failures are EmbeddingUnavailable (their text is safe to show)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.provider, self.model, self.dimensions = inner.provider, inner.model, inner.dimensions

    async def embed(self, texts: list[str]) -> np.ndarray:
        from services.tools.embeddings import EmbeddingError

        try:
            return await self.inner.embed(texts)
        except EmbeddingError as exc:
            raise EmbeddingUnavailable(exc.reason, permanent=not exc.transient) from None


_local: _Checked | None = None


def local_embedder() -> _Checked:
    """The process's local model, shared by every store (its weights load on first embed). It
    embeds on all the CPUs this process may use but one, which stays free to serve requests
    while a large document is indexed."""
    global _local
    if _local is None:
        from services.tools.embeddings import LocalEmbedder  # numpy and the model: on first use

        _local = _Checked(LocalEmbedder(threads=max(1, len(os.sched_getaffinity(0)) - 1)))
    return _local


async def local_only(org_id: str, spec: EmbeddingSpec) -> Any:
    """An `embedder_for` that serves the local model only (no credentials to read)."""
    if spec.provider != "local":
        raise EmbeddingUnavailable(f"embedding provider {spec.provider!r} is not configured")
    return local_embedder()


class Embedders:
    """`(organization_id, spec) -> embedder`, the `embedder_for` of the KnowledgeStore.

    Args:
        credentials: the tools service's CredentialStore (resolve(org, integration, id)).
        openai_base_url: the OpenAI-compatible API's base URL.
        timeout_s: seconds one API call may take.
    """

    def __init__(self, credentials: Any, openai_base_url: str, timeout_s: float = 30.0) -> None:
        self._credentials = credentials
        self._base_url = openai_base_url
        self._timeout_s = timeout_s
        self._clients: TTLCache[tuple[str, EmbeddingSpec], _Checked] = TTLCache(256, CLIENT_TTL_S)

    async def __call__(self, org_id: str, spec: EmbeddingSpec) -> Any:
        if spec.provider == "local":
            return local_embedder()
        if spec.provider != "openai":
            raise EmbeddingUnavailable(f"unknown embedding provider {spec.provider!r}")
        key = (org_id, spec)
        client = self._clients.get(key)
        if client is None:
            api_key = await self.api_key(org_id, spec.credential_id)
            from services.tools.embeddings import OpenAIEmbedder

            client = _Checked(
                OpenAIEmbedder(
                    self._base_url, api_key, spec.model, spec.dimensions, self._timeout_s
                )
            )
            self._clients[key] = client
        return client

    async def api_key(self, org_id: str, credential_id: str) -> str:
        """The key of the organization's "openai" credential; EmbeddingUnavailable when it is
        absent, not the organization's, has no key, or cannot be decrypted."""
        try:
            resolved = await self._credentials.resolve(org_id, "openai", credential_id)
        except SecretBoxError:
            raise EmbeddingUnavailable(
                f"credential {credential_id} cannot be decrypted with the configured keys"
            ) from None
        secret = resolved[1] if resolved is not None else None
        key = secret.get("api_key") or secret.get("token") if isinstance(secret, dict) else None
        if not isinstance(key, str) or not key:
            raise EmbeddingUnavailable(
                f"credential {credential_id} is not an 'openai' credential of this organization"
                " with an api_key"
            )
        return key
