"""`python -m services.tools reembed`: embed knowledge again, after the model changed.

Vectors of another model than their knowledge base's are dropped (all of them with
`everything`, for a local model whose weights changed under the same name); the documents
concerned go back to "processing" (failed ones too: this retries them) and the indexer
embeds them, in this process (only those: the service's own indexer also picks them up
within a poll), before the command answers. Searches meanwhile still rank by keywords, and by
meaning the chunks already done. `spec` first switches the knowledge bases named to another
model, after checking that an "openai" one's credential is each organization's.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import text, update

from services.common.errors import RpcError
from services.tools.knowledge import KnowledgeStore
from services.tools.knowledge_indexer import EmbeddingSpec
from services.tools.models import KnowledgeBase

_STALE = (
    "DELETE FROM knowledge_vectors WHERE knowledge_base_id = :kb AND (:all_ OR model <> :model)"
)
_REOPEN = (
    "UPDATE knowledge_documents SET status = 'processing', error_message = NULL"
    " WHERE knowledge_base_id = :kb AND (status = 'failed' OR EXISTS (SELECT 1"
    " FROM knowledge_chunks c WHERE c.document_id = knowledge_documents.id AND NOT EXISTS"
    " (SELECT 1 FROM knowledge_vectors v WHERE v.chunk_id = c.id AND v.model = :model)))"
)


async def _credential_refused(
    credentials: Any, orgs: set[str], spec: EmbeddingSpec | None
) -> str | None:
    """Why `spec` cannot serve these organizations (its credential is not each one's "openai"
    credential), or None."""
    if spec is None or spec.provider != "openai" or credentials is None:
        return None
    for org_id in sorted(orgs):
        try:
            info = await credentials.get(org_id, spec.credential_id)
        except RpcError:
            info = None
        if info is None or info.integration != "openai":
            return f"credential {spec.credential_id} is not an 'openai' credential of {org_id}"
    return None


async def reembed(
    store: KnowledgeStore,
    sessions: Any,
    base_ids: list[str],
    everything: bool = False,
    spec: EmbeddingSpec | None = None,
    credentials: Any = None,
) -> dict[str, Any]:
    """Re-embed the knowledge bases `base_ids` (every one when empty); returns the JSON answer
    `{"knowledge_bases", "documents", "failed": [document ids]}` (`{"error"}` for an unknown id
    or a credential that `credentials`, the CredentialStore, does not know)."""
    async with sessions() as session, session.begin():
        query = text("SELECT id, embedding_model, org_id FROM knowledge_bases")
        rows = (await session.execute(query)).all()
        bases, orgs = {r[0]: r[1] for r in rows}, {r[0]: r[2] for r in rows}
        unknown = [b for b in base_ids if b not in bases]
        if unknown:
            return {"error": f"no knowledge base {', '.join(unknown)}"}
        chosen = base_ids or list(bases)
        refused = await _credential_refused(credentials, {orgs[b] for b in chosen}, spec)
        if refused:
            return {"error": refused}
        if spec is not None:
            await session.execute(
                update(KnowledgeBase)
                .where(KnowledgeBase.id.in_(chosen))
                .values(
                    embedding_provider=spec.provider,
                    embedding_model=spec.model,
                    embedding_dimensions=spec.dimensions,
                    embedding_credential_id=spec.credential_id or None,
                )
            )
            bases.update({b: spec.model for b in chosen})
        documents = 0
        for base_id in chosen:
            params = {"kb": base_id, "model": bases[base_id], "all_": everything}
            await session.execute(text(_STALE), params)
            documents += (await session.execute(text(_REOPEN), params)).rowcount or 0
    indexer = store.indexer_for(chosen)
    indexer.kick()
    await indexer.wait_idle()
    await indexer.stop()
    async with sessions() as session:
        failed = [
            row[0]
            for base_id in chosen
            for row in (
                await session.execute(
                    text(
                        "SELECT id FROM knowledge_documents"
                        " WHERE knowledge_base_id = :kb AND status = 'failed'"
                    ),
                    {"kb": base_id},
                )
            ).all()
        ]
    return {"knowledge_bases": len(chosen), "documents": documents, "failed": failed}
