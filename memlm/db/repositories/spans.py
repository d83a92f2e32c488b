"""The character spans of a document's tokens, stored beside it (neighbour snippets)."""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import numpy as np
from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from memlm.db.models import DocumentSpans


def encode_spans(spans: np.ndarray) -> bytes:
    """(n, 2) character spans -> zlib of the int32 differences of the flattened spans."""
    flat = np.asarray(spans, dtype=np.int64).reshape(-1)
    return zlib.compress(np.diff(flat, prepend=0).astype("<i4").tobytes(), 6)


def decode_spans(data: bytes, tokens: int) -> np.ndarray:
    """The inverse of :func:`encode_spans`: (tokens, 2) int64 spans."""
    deltas = np.frombuffer(zlib.decompress(data), dtype="<i4")
    if len(deltas) != 2 * tokens:
        raise ValueError(f"stored spans hold {len(deltas) // 2} tokens, {tokens} expected")
    return np.cumsum(deltas, dtype=np.int64).reshape(tokens, 2)


class SpanRepository:
    """The character span of every token of a memorised document (provenance snippets)."""

    def __init__(self, session: Session) -> None:
        self.s = session

    def put(self, doc_id: int, spans: np.ndarray | None) -> None:
        """Store (or replace, when a document is processed again) a document's spans."""
        if spans is None:
            return
        row = DocumentSpans(document_id=doc_id, tokens=len(spans), spans=encode_spans(spans))
        self.s.merge(row)

    def many(self, ids: Iterable[int]) -> dict[int, np.ndarray]:
        """Spans of the documents among ``ids`` that have them (those memorised since 0002)."""
        ids = sorted(set(ids))
        if not ids:
            return {}
        q = select(DocumentSpans).where(DocumentSpans.document_id.in_(ids))
        return {r.document_id: decode_spans(r.spans, r.tokens) for r in self.s.scalars(q)}

    def delete(self, doc_id: int) -> None:
        self.s.execute(delete(DocumentSpans).where(DocumentSpans.document_id == doc_id))
