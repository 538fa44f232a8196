"""Embeddings beside the chunks: `knowledge_vectors`, each knowledge base's embedding model, and
a document's `error_message`.

On PostgreSQL the vectors are pgvector `vector`s: the extension must be available on the
server (`make pgvector` builds it for a local PostgreSQL; images such as pgvector/pgvector
ship it). On SQLite they are float32 BLOBs compared by sqlite-vec at search time.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def _require_pgvector() -> None:
    """Create the `vector` extension unless it exists, or fail saying what the server lacks:
    the extension's files (make pgvector, or an image such as pgvector/pgvector), or a role
    allowed to create it (pgvector is not a trusted extension: a superuser runs
    `CREATE EXTENSION vector` in the tools database once)."""
    bind = op.get_bind()
    if bind.execute(sa.text("SELECT 1 FROM pg_extension WHERE extname = 'vector'")).scalar():
        return
    available = bind.execute(
        sa.text("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'")
    ).scalar()
    if not available:
        raise RuntimeError(
            "PostgreSQL lacks the pgvector extension ('vector'), which knowledge search needs:"
            " install it on the server (make pgvector, or an image such as pgvector/pgvector)"
        )
    allowed = bind.execute(
        sa.text("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
    ).scalar()
    if not allowed:
        raise RuntimeError(
            "the pgvector extension is not created in this database and this role may not create"
            " it: a superuser runs CREATE EXTENSION vector; in the tools database, once"
        )
    op.execute("CREATE EXTENSION vector")


def upgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    if postgres:
        _require_pgvector()
    with op.batch_alter_table("knowledge_bases", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("embedding_provider", sa.String(20), nullable=False, server_default="local")
        )
        batch_op.add_column(
            sa.Column(
                "embedding_model",
                sa.String(200),
                nullable=False,
                server_default="all-MiniLM-L6-v2",
            )
        )
        batch_op.add_column(
            sa.Column("embedding_dimensions", sa.Integer(), nullable=False, server_default="384")
        )
        batch_op.add_column(sa.Column("embedding_credential_id", sa.String(36), nullable=True))
    with op.batch_alter_table("knowledge_documents", schema=None) as batch_op:
        batch_op.add_column(sa.Column("error_message", sa.Text(), nullable=True))
    op.create_table(
        "knowledge_vectors",
        sa.Column(
            "chunk_id",
            sa.Integer(),
            sa.ForeignKey("knowledge_chunks.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("knowledge_base_id", sa.String(36), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("embedding", sa.LargeBinary(), nullable=False),
    )
    op.create_index(
        "ix_knowledge_vectors_knowledge_base_id", "knowledge_vectors", ["knowledge_base_id"]
    )
    if postgres:
        op.execute(
            "ALTER TABLE knowledge_vectors ALTER COLUMN embedding TYPE vector USING NULL::vector"
        )
        # The chunks' text search vectors, stored: ranking read them instead of computing each
        # matching chunk's again (seconds per search at 100,000 chunks).
        op.execute(
            "ALTER TABLE knowledge_chunks ADD COLUMN content_tsv tsvector"
            " GENERATED ALWAYS AS (to_tsvector('english', content)) STORED"
        )
        op.execute(
            "CREATE INDEX ix_knowledge_chunks_tsv ON knowledge_chunks USING gin (content_tsv)"
        )
        op.execute("DROP INDEX IF EXISTS ix_knowledge_chunks_fts")
    # Documents indexed before embeddings existed are embedded by the tools service's indexer.
    op.execute("UPDATE knowledge_documents SET status = 'processing' WHERE status = 'ready'")


def downgrade() -> None:
    op.execute("UPDATE knowledge_documents SET status = 'ready' WHERE status = 'processing'")
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP INDEX IF EXISTS ix_knowledge_chunks_tsv")
        op.execute("ALTER TABLE knowledge_chunks DROP COLUMN content_tsv")
        op.execute(
            "CREATE INDEX ix_knowledge_chunks_fts ON knowledge_chunks "
            "USING gin (to_tsvector('english', content))"
        )
    op.drop_index("ix_knowledge_vectors_knowledge_base_id", table_name="knowledge_vectors")
    op.drop_table("knowledge_vectors")
    with op.batch_alter_table("knowledge_documents", schema=None) as batch_op:
        batch_op.drop_column("error_message")
    with op.batch_alter_table("knowledge_bases", schema=None) as batch_op:
        batch_op.drop_column("embedding_credential_id")
        batch_op.drop_column("embedding_dimensions")
        batch_op.drop_column("embedding_model")
        batch_op.drop_column("embedding_provider")
