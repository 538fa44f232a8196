"""Tables of the tools service (its own database; no other service reads it).

- `credentials`: an organization's credentials; the secret is only ever stored as a
  Fernet token (`encrypted_secret`), see crypto.py. At most one default per
  organization and integration (a partial unique index). `needs_reconnect` marks an
  `oauth2` credential whose refresh the authorization server refused (oauth_refresh.py).
- `knowledge_bases`, `knowledge_documents`, `knowledge_chunks`: searchable knowledge.
  On SQLite the chunks are also indexed in the FTS5 table `knowledge_chunks_fts`
  (created by the migration, not by these models: rowid = knowledge_chunks.id).
  `knowledge_vectors`: one embedding per chunk (float32 BLOB on SQLite, pgvector `vector`
  on PostgreSQL), of the model its knowledge base names.
- `oauth_states`: pending OAuth2 authorization code flows (PKCE verifier encrypted).
"""

from __future__ import annotations

import datetime
import uuid
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator, UserDefinedType


def utcnow() -> datetime.datetime:
    """The current time, timezone-aware UTC."""
    return datetime.datetime.now(datetime.UTC)


def new_id() -> str:
    """A new row id of credentials, knowledge bases and documents: str(uuid.uuid4())."""
    return str(uuid.uuid4())


class Base(DeclarativeBase):
    """Declarative base of the tools service's tables."""


class Credential(Base):
    """A credential of one organization for one integration (secret encrypted at rest)."""

    __tablename__ = "credentials"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    org_id: Mapped[str] = mapped_column(String(64), nullable=False)
    integration: Mapped[str] = mapped_column(String(100), nullable=False)
    auth_type: Mapped[str] = mapped_column(String(20), nullable=False)
    display_name: Mapped[str] = mapped_column(String(200), nullable=False)
    is_default: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    encrypted_secret: Mapped[str] = mapped_column(Text, nullable=False)
    # The user who created it (the gateway's user id); NULL when not recorded.
    created_by: Mapped[str | None] = mapped_column(String(64), nullable=True, default=None)
    masked_secret: Mapped[str] = mapped_column(String(500), nullable=False, default="")
    # oauth2 only: its refresh was refused, so it works again only once the user connects it again.
    needs_reconnect: Mapped[bool] = mapped_column(
        Boolean, nullable=False, default=False, server_default=text("false")
    )
    metadata_json: Mapped[dict[str, Any]] = mapped_column(
        "metadata", JSON, nullable=False, default=dict
    )
    # MCP server credentials only: the tools last discovered ([{name, description, input_schema}])
    # and when.
    discovery: Mapped[list[dict[str, Any]] | None] = mapped_column(
        JSON, nullable=True, default=None
    )
    discovered_at: Mapped[datetime.datetime | None] = mapped_column(
        DateTime(timezone=True), nullable=True, default=None
    )
    created_at: Mapped[datetime.datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, default=utcnow
    )
    updated_at: Mapped[datetime.datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, default=utcnow
    )

    __table_args__ = (
        Index("ix_credentials_org_integration", "org_id", "integration"),
        Index(
            "uq_credentials_one_default",
            "org_id",
            "integration",
            unique=True,
            sqlite_where=text("is_default"),
            postgresql_where=text("is_default"),
        ),
    )


class KnowledgeBase(Base):
    """A named collection of documents of one organization."""

    __tablename__ = "knowledge_bases"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    org_id: Mapped[str] = mapped_column(String(64), nullable=False, index=True)
    name: Mapped[str] = mapped_column(String(200), nullable=False)
    description: Mapped[str] = mapped_column(Text, nullable=False, default="")
    # The user who created it (the gateway's user id); NULL when not recorded.
    created_by: Mapped[str | None] = mapped_column(String(64), nullable=True, default=None)
    created_at: Mapped[datetime.datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, default=utcnow
    )
    # How its chunks are embedded: "local" (the tools service's own model) or "openai" (an
    # OpenAI-compatible API with the organization's credential `embedding_credential_id`).
    embedding_provider: Mapped[str] = mapped_column(
        String(20), nullable=False, default="local", server_default="local"
    )
    embedding_model: Mapped[str] = mapped_column(
        String(200), nullable=False, default="all-MiniLM-L6-v2", server_default="all-MiniLM-L6-v2"
    )
    embedding_dimensions: Mapped[int] = mapped_column(
        Integer, nullable=False, default=384, server_default="384"
    )
    embedding_credential_id: Mapped[str | None] = mapped_column(
        String(36), nullable=True, default=None
    )


class KnowledgeDocument(Base):
    """A document of a knowledge base; `status` is "ready" once its chunks are indexed."""

    __tablename__ = "knowledge_documents"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    knowledge_base_id: Mapped[str] = mapped_column(
        String(36), ForeignKey("knowledge_bases.id", ondelete="CASCADE"), nullable=False, index=True
    )
    org_id: Mapped[str] = mapped_column(String(64), nullable=False)
    name: Mapped[str] = mapped_column(String(500), nullable=False)
    content_type: Mapped[str] = mapped_column(String(100), nullable=False, default="text/plain")
    status: Mapped[str] = mapped_column(String(20), nullable=False, default="ready")
    chunk_count: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    file_size_bytes: Mapped[int] = mapped_column(
        Integer, nullable=False, default=0, server_default="0"
    )
    token_count: Mapped[int] = mapped_column(Integer, nullable=False, default=0, server_default="0")
    created_at: Mapped[datetime.datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, default=utcnow
    )
    # Why indexing failed (status "failed"), from known causes only.
    error_message: Mapped[str | None] = mapped_column(Text, nullable=True, default=None)
    # When its last chunk was embedded (status "ready"); None until then.
    indexed_at: Mapped[datetime.datetime | None] = mapped_column(
        DateTime(timezone=True), nullable=True, default=None
    )


class KnowledgeChunk(Base):
    """One searchable piece of a document (a few paragraphs, at most ~1000 characters)."""

    __tablename__ = "knowledge_chunks"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    document_id: Mapped[str] = mapped_column(
        String(36),
        ForeignKey("knowledge_documents.id", ondelete="CASCADE"),
        nullable=False,
        index=True,
    )
    knowledge_base_id: Mapped[str] = mapped_column(String(36), nullable=False)
    org_id: Mapped[str] = mapped_column(String(64), nullable=False)
    chunk_index: Mapped[int] = mapped_column(Integer, nullable=False)
    content: Mapped[str] = mapped_column(Text, nullable=False)

    __table_args__ = (Index("ix_knowledge_chunks_org_kb", "org_id", "knowledge_base_id"),)


class _PgVector(UserDefinedType[Any]):
    """pgvector's `vector` column type, of any length (each knowledge base's model sets it)."""

    cache_ok = True

    def get_col_spec(self, **kw: Any) -> str:
        return "vector"


class Embedding(TypeDecorator[bytes]):
    """A float32 vector: a BLOB on SQLite, a pgvector `vector` on PostgreSQL (written and read
    as SQL text there by vectors.py, never through this type's Python values)."""

    impl = LargeBinary
    cache_ok = True

    def load_dialect_impl(self, dialect: Any) -> Any:
        if dialect.name == "postgresql":
            return dialect.type_descriptor(_PgVector())
        return dialect.type_descriptor(LargeBinary())


class KnowledgeVector(Base):
    """The embedding of one chunk by `model` (its knowledge base's model when written)."""

    __tablename__ = "knowledge_vectors"

    chunk_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("knowledge_chunks.id", ondelete="CASCADE"), primary_key=True
    )
    knowledge_base_id: Mapped[str] = mapped_column(String(36), nullable=False, index=True)
    model: Mapped[str] = mapped_column(String(200), nullable=False)
    embedding: Mapped[bytes] = mapped_column(Embedding, nullable=False)


class OAuthState(Base):
    """A pending OAuth2 authorization (one per InitiateOAuth2), consumed by the callback.

    `state` is the random, single-use value sent to the authorization server; the PKCE
    code verifier is kept encrypted (a Fernet token, like credential secrets).
    """

    __tablename__ = "oauth_states"

    state: Mapped[str] = mapped_column(String(64), primary_key=True)
    org_id: Mapped[str] = mapped_column(String(64), nullable=False)
    user_id: Mapped[str] = mapped_column(String(64), nullable=False, default="")
    integration: Mapped[str] = mapped_column(String(100), nullable=False)
    encrypted_verifier: Mapped[str] = mapped_column(Text, nullable=False)
    redirect_uri: Mapped[str] = mapped_column(Text, nullable=False)
    scope: Mapped[str] = mapped_column(Text, nullable=False, default="")
    display_name: Mapped[str] = mapped_column(String(200), nullable=False, default="")
    make_default: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    expires_at: Mapped[datetime.datetime] = mapped_column(DateTime(timezone=True), nullable=False)
