"""`python -m services.tools reembed`: embed knowledge again, after the model changed.

Vectors of another model than their knowledge base's are dropped (all of them with
`everything`, for a local model whose weights changed under the same name); the documents
concerned go back to "processing" (failed ones too: this retries them) and the indexer
embeds them, in this process, before the command answers. Searches meanwhile still rank by
keywords, and by meaning the chunks already done. `spec` first switches the knowledge bases
named to another model.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import text, update

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


async def reembed(
    store: KnowledgeStore,
    sessions: Any,
    base_ids: list[str],
    everything: bool = False,
    spec: EmbeddingSpec | None = None,
) -> dict[str, Any]:
    """Re-embed the knowledge bases `base_ids` (every one when empty); returns the JSON answer
    `{"knowledge_bases", "documents", "failed": [document ids]}` (`{"error"}` for an unknown id)."""
    async with sessions() as session, session.begin():
        query = text("SELECT id, embedding_model FROM knowledge_bases")
        bases = {row[0]: row[1] for row in (await session.execute(query)).all()}
        unknown = [b for b in base_ids if b not in bases]
        if unknown:
            return {"error": f"no knowledge base {', '.join(unknown)}"}
        chosen = base_ids or list(bases)
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
    store.indexer.kick()
    await store.indexer.wait_idle()
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
