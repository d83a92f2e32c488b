"""document_spans: every token's character span, stored at ingest for provenance snippets

Documents memorised before this revision have no row; the API re-tokenises those (off
the event loop, cached), so nothing needs backfilling.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24 17:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "document_spans",
        sa.Column("document_id", sa.Integer(), nullable=False),
        sa.Column("tokens", sa.Integer(), nullable=False),
        sa.Column("spans", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["document_id"],
            ["documents.id"],
            name=op.f("fk_document_spans_document_id_documents"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("document_id", name=op.f("pk_document_spans")),
    )


def downgrade() -> None:
    op.drop_table("document_spans")
