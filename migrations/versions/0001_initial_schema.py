"""initial schema: documents, day_stats, index_builds, policy_settings

Revision ID: 0001
Revises:
Create Date: 2026-11-22 01:23:38
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "day_stats",
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("policy", sa.String(length=32), nullable=False),
        sa.Column("documents", sa.Integer(), nullable=False),
        sa.Column("tokens_seen", sa.BigInteger(), nullable=False),
        sa.Column("tokens_stored", sa.BigInteger(), nullable=False),
        sa.Column("entries_forgotten", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("day", "policy", name=op.f("pk_day_stats")),
    )
    op.create_table(
        "documents",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("source", sa.String(length=200), nullable=False),
        sa.Column("external_id", sa.String(length=200), nullable=True),
        sa.Column("title", sa.String(length=1000), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("content_hash", sa.String(length=64), nullable=False),
        sa.Column("published_at", sa.Date(), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("claimed_by", sa.String(length=200), nullable=True),
        sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("processed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("policy", sa.String(length=32), nullable=True),
        sa.Column("tokens_seen", sa.Integer(), nullable=True),
        sa.Column("tokens_stored", sa.Integer(), nullable=True),
        sa.Column("entry_start", sa.BigInteger(), nullable=True),
        sa.Column("entry_end", sa.BigInteger(), nullable=True),
        sa.CheckConstraint(
            "status IN ('pending', 'processing', 'done', 'failed', 'forgetting', 'forgotten')",
            name=op.f("ck_documents_status"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_documents")),
        sa.UniqueConstraint("content_hash", name=op.f("uq_documents_content_hash")),
        sa.UniqueConstraint("source", "external_id", name=op.f("uq_documents_source_external_id")),
    )
    op.create_index("ix_documents_status_published", "documents", ["status", "published_at", "id"])
    op.create_table(
        "index_builds",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("request_key", sa.String(length=100), nullable=False),
        sa.Column("requested_by", sa.String(length=32), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("version", sa.String(length=100), nullable=True),
        sa.Column("entries", sa.BigInteger(), nullable=True),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column(
            "requested_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("seconds", sa.Float(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.CheckConstraint(
            "status IN ('queued', 'building', 'done', 'failed')",
            name=op.f("ck_index_builds_status"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_index_builds")),
        sa.UniqueConstraint("request_key", name=op.f("uq_index_builds_request_key")),
    )
    op.create_table(
        "policy_settings",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("policy", sa.String(length=32), nullable=False),
        sa.Column("delta", sa.Float(), nullable=True),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_policy_settings")),
    )


def downgrade() -> None:
    op.drop_table("policy_settings")
    op.drop_table("index_builds")
    op.drop_index("ix_documents_status_published", table_name="documents")
    op.drop_table("documents")
    op.drop_table("day_stats")
