"""SQLAlchemy 2 tables: documents (and their token offsets), per-day statistics, index builds,
the active policy.

Schemas for HTTP live in ``memlm.api``; these classes are storage only.
Every timestamp column is :class:`UTCDateTime`: stored in UTC, read back aware (UTC).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    Date,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    func,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

# Stable constraint names so Alembic autogenerate and downgrades agree across databases.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# forgetting: DELETE asked for it; the worker (the datastore's one writer) then hides the
# entries and marks the document forgotten in the same transaction as the counters.
DOCUMENT_STATUSES = ("pending", "processing", "done", "failed", "forgetting", "forgotten")
BUILD_STATUSES = ("queued", "building", "done", "failed")


class UTCDateTime(TypeDecorator[dt.datetime]):
    """A timestamp that leaves the database timezone-aware in UTC, on every backend.

    PostgreSQL keeps ``timestamptz`` but answers in the session's TimeZone; SQLite keeps
    no zone at all, so values are stored there as naive UTC text, which is what its
    ``CURRENT_TIMESTAMP`` (the server defaults) writes too and which sorts as time.
    A naive datetime is refused rather than guessed: it does not say which zone it is in.
    The DDL is plain ``DateTime(timezone=True)``, so no migration is involved.
    """

    impl = DateTime
    cache_ok = True

    def __init__(self) -> None:
        super().__init__(timezone=True)

    def process_bind_param(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(
                f"naive datetime {value.isoformat()} refused: pass an aware datetime "
                "(e.g. datetime.now(datetime.UTC))"
            )
        value = value.astimezone(dt.UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(
        self, value: dt.datetime | None, dialect: Dialect
    ) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:  # SQLite: stored as UTC
            return value.replace(tzinfo=dt.UTC)
        return value.astimezone(dt.UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Document(Base):
    """One ingested document and, once processed, where its entries sit in the datastore."""

    __tablename__ = "documents"
    __table_args__ = (
        UniqueConstraint("source", "external_id"),
        UniqueConstraint("content_hash"),
        CheckConstraint(_in("status", DOCUMENT_STATUSES), name="status"),
        # The worker's queue: pending documents in publication order.
        Index("ix_documents_status_published", "status", "published_at", "id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    source: Mapped[str] = mapped_column(String(200))
    external_id: Mapped[str | None] = mapped_column(String(200))
    title: Mapped[str] = mapped_column(String(1000), default="")
    text: Mapped[str] = mapped_column(Text)
    # sha256 of the UTF-8 text, hex: the second deduplication key.
    content_hash: Mapped[str] = mapped_column(String(64))
    published_at: Mapped[dt.date] = mapped_column(Date)
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), server_default=func.now())
    claimed_by: Mapped[str | None] = mapped_column(String(200))
    claimed_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    processed_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    # Failed tries so far (kept across restarts); a pending document waits for retry_at.
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    retry_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    policy: Mapped[str | None] = mapped_column(String(32))
    tokens_seen: Mapped[int | None] = mapped_column(Integer)
    tokens_stored: Mapped[int | None] = mapped_column(Integer)
    # Datastore entries [entry_start, entry_end) appended for this document.
    entry_start: Mapped[int | None] = mapped_column(BigInteger)
    entry_end: Mapped[int | None] = mapped_column(BigInteger)


class DocumentSpans(Base):
    """The character span of every token of a memorised document, written in the same
    transaction that marks it done, so a neighbour's snippet is a slice of its text.

    A row of its own (not a column of ``documents``) so that listing or claiming documents
    never reads it, and forgetting a document deletes it (``mark_forgotten``).
    """

    __tablename__ = "document_spans"

    document_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("documents.id", ondelete="CASCADE"), primary_key=True
    )
    tokens: Mapped[int] = mapped_column(Integer)
    # zlib of the int32 differences of (start_0, end_0, start_1, end_1, ...): about one
    # byte per token, where the raw spans take eight.
    spans: Mapped[bytes] = mapped_column(LargeBinary)


class DayStat(Base):
    """Counters of one stream day under one policy (MemRate = stored / seen)."""

    __tablename__ = "day_stats"

    day: Mapped[dt.date] = mapped_column(Date, primary_key=True)
    policy: Mapped[str] = mapped_column(String(32), primary_key=True)
    documents: Mapped[int] = mapped_column(Integer, default=0)
    tokens_seen: Mapped[int] = mapped_column(BigInteger, default=0)
    tokens_stored: Mapped[int] = mapped_column(BigInteger, default=0)
    # Entries of this day's documents later removed by DELETE /admin/documents/{id}.
    entries_forgotten: Mapped[int] = mapped_column(BigInteger, default=0)


class IndexBuild(Base):
    """A requested or finished index build; ``request_key`` makes requests idempotent."""

    __tablename__ = "index_builds"
    __table_args__ = (
        UniqueConstraint("request_key"),
        CheckConstraint(_in("status", BUILD_STATUSES), name="status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    request_key: Mapped[str] = mapped_column(String(100))
    requested_by: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16), default="queued")
    version: Mapped[str | None] = mapped_column(String(100))
    entries: Mapped[int | None] = mapped_column(BigInteger)
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    requested_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), server_default=func.now())
    started_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    seconds: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text)


class PolicySetting(Base):
    """The memorisation policy the worker applies now (a single row, id 1)."""

    __tablename__ = "policy_settings"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    policy: Mapped[str] = mapped_column(String(32))
    delta: Mapped[float | None] = mapped_column(Float)  # None: the policy's default
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    updated_at: Mapped[dt.datetime] = mapped_column(
        UTCDateTime(), server_default=func.now(), onupdate=func.now()
    )
