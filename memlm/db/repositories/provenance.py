"""The reads behind a neighbour's provenance: a document's card and windows of its text.

Answering a /predict with 100 neighbours must not read 100 whole documents (up to
``MEMLM_MAX_TEXT_CHARS`` each, outside the model executor's cost accounting): a card
selects only the columns a neighbour shows, and a snippet reads only its window of the
text (``substr`` in the database). Read-only queries of the API's hot path; the writes of
documents are in :mod:`memlm.db.repositories`.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy import Integer, cast, func, literal, select, union_all
from sqlalchemy.orm import Session

from memlm.db.models import Document

# Windows per statement: SQLite refuses a compound SELECT of more than 500 parts.
WINDOWS_PER_QUERY = 200


@dataclass(frozen=True)
class DocumentCard:
    """What a neighbour shows of its document: never its text."""

    id: int
    status: str
    title: str
    published_at: dt.date
    source: str


@dataclass(frozen=True)
class TextWindow:
    """Characters [start, stop) of a document's text (fewer where the text ends first)."""

    document_id: int
    start: int
    stop: int


class ProvenanceRepository:
    """Documents as neighbours show them; callers run it in a worker thread."""

    def __init__(self, session: Session) -> None:
        self.s = session

    def cards(self, ids: Iterable[int]) -> dict[int, DocumentCard]:
        ids = sorted(set(ids))
        if not ids:
            return {}
        q = select(
            Document.id, Document.status, Document.title, Document.published_at, Document.source
        ).where(Document.id.in_(ids))
        return {r.id: DocumentCard(*r) for r in self.s.execute(q)}

    def windows(self, wanted: Sequence[TextWindow]) -> list[str | None]:
        """Each window's characters, in order; None where the document does not exist."""
        out: list[str | None] = [None] * len(wanted)
        for first in range(0, len(wanted), WINDOWS_PER_QUERY):
            parts = [
                select(
                    literal(first + i, Integer).label("k"),
                    # substr counts characters from 1, on SQLite and PostgreSQL alike; the
                    # casts keep PostgreSQL from guessing bigint, for which it has no substr
                    func.substr(
                        Document.text,
                        cast(literal(w.start + 1), Integer),
                        cast(literal(max(0, w.stop - w.start)), Integer),
                    ).label("t"),
                ).where(Document.id == w.document_id)
                for i, w in enumerate(wanted[first : first + WINDOWS_PER_QUERY])
            ]
            q = parts[0] if len(parts) == 1 else union_all(*parts)
            for k, t in self.s.execute(q):
                out[k] = t
        return out

    def texts(self, ids: Iterable[int]) -> dict[int, str]:
        """Whole texts: only for documents whose token spans were never stored (memorised
        before migration 0002), which must be tokenised to find a position's characters."""
        ids = sorted(set(ids))
        if not ids:
            return {}
        q = select(Document.id, Document.text).where(Document.id.in_(ids))
        return {r.id: r.text for r in self.s.execute(q)}
