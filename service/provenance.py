"""Neighbours' provenance: document, date and a snippet around the token position.

A snippet is a slice of the document's text at the character span of the neighbour's
token. The spans of every token are stored at ingest (``document_spans``, committed with
the document), so answering costs a database read, not a tokenisation, and recently named
documents' spans stay in a bounded cache. Documents memorised before spans were stored
are tokenised once here, in a worker thread (never on the event loop).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from sqlalchemy.orm import Session, sessionmaker

from memlm.db.models import Document
from memlm.db.repositories import DocumentRepository, SpanRepository
from service.schemas import NeighbourOut

log = logging.getLogger(__name__)

SNIPPET_CHARS = 240  # about two lines either side of the token
# Spans cached: 4M tokens (32 MB as int32 pairs), about 80 documents of 200k characters.
SPAN_CACHE_TOKENS = 1 << 22


def snippet(text: str, start: int, end: int, width: int = SNIPPET_CHARS) -> str:
    """Text around [start, end) cut at word boundaries, the token marked with [[ ]]."""
    lo, hi = max(0, start - width // 2), min(len(text), end + width // 2)
    if lo > 0:
        space = text.find(" ", lo, start)
        lo = space + 1 if space != -1 else lo
    if hi < len(text):
        space = text.rfind(" ", end, hi)
        hi = space if space != -1 else hi
    head = ("…" if lo > 0 else "") + text[lo:start]
    tail = text[end:hi] + ("…" if hi < len(text) else "")
    return f"{head}[[{text[start:end]}]]{tail}".replace("\n", " ")


class SpanCache:
    """Token spans of recently named documents: read from ``document_spans``, or computed
    once for documents that have none stored (least recently used go first). Called from
    worker threads: the dictionary is guarded; two threads that miss the same document at
    once both read or tokenise it, which is harmless."""

    def __init__(
        self, char_spans: Callable[[str], np.ndarray] | None, max_tokens: int = SPAN_CACHE_TOKENS
    ) -> None:
        self.char_spans = char_spans
        self.max_tokens = max_tokens
        self._spans: OrderedDict[int, np.ndarray] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def cached(self, doc_id: int) -> np.ndarray | None:
        with self._lock:
            hit = self._spans.get(doc_id)
            if hit is not None:
                self._spans.move_to_end(doc_id)
            return hit

    def put(self, doc_id: int, spans: np.ndarray) -> np.ndarray:
        spans = np.asarray(spans, dtype=np.int32).reshape(-1, 2)
        with self._lock:
            if doc_id not in self._spans:
                self._spans[doc_id] = spans
                self._tokens += len(spans)
            while self._tokens > self.max_tokens and len(self._spans) > 1:
                _, old = self._spans.popitem(last=False)
                self._tokens -= len(old)
        return spans

    def get(self, doc: Document) -> np.ndarray | None:
        """The document's (n, 2) spans, tokenised here if none were stored or cached; None
        when the engine cannot tell them."""
        hit = self.cached(doc.id)
        if hit is not None or self.char_spans is None:
            return hit
        return self.put(doc.id, self.char_spans(doc.text))

    def discard(self, doc_id: int) -> None:
        with self._lock:
            old = self._spans.pop(doc_id, None)
            if old is not None:
                self._tokens -= len(old)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()
            self._tokens = 0


def provenance(
    sessions: sessionmaker[Session],
    neighbours: Sequence[Any],
    cache: SpanCache,
    *,
    snippets: bool,
) -> list[NeighbourOut]:
    """The neighbours joined with their documents (blocking: run it in a worker thread).

    ``snippets``: whether the caller may read memorised text; without, neighbours keep
    their document, date and title but carry no snippet.
    """
    ids = {int(n.doc_id) for n in neighbours}
    with sessions() as s:
        docs = DocumentRepository(s).many(ids)
        missing = [i for i in ids if cache.cached(i) is None] if snippets else []
        for doc_id, spans in SpanRepository(s).many(missing).items():
            cache.put(doc_id, spans)
    out = []
    for n in neighbours:
        doc = docs.get(int(n.doc_id))
        item = NeighbourOut(
            entry_id=int(n.entry_id),
            document_id=int(n.doc_id),
            token=str(n.token),
            distance=float(n.distance),
            position=int(n.position),
        )
        if doc is not None and doc.status in ("forgetting", "forgotten"):
            cache.discard(doc.id)  # neither snippet nor title of a document being forgotten
        elif doc is not None:
            item.title = doc.title
            item.published_at = doc.published_at
            item.source = doc.source
            if snippets:
                item.snippet = _snippet(doc, int(n.position), cache)
        out.append(item)
    return out


def _snippet(doc: Document, position: int, cache: SpanCache) -> str | None:
    spans = cache.get(doc)
    if spans is None:  # an engine that cannot tell (the fakes of some tests)
        return snippet(doc.text, 0, 0)
    if not 0 <= position < len(spans):
        log.warning("document %d has %d tokens, no position %d", doc.id, len(spans), position)
        return None
    start, end = spans[position]
    return snippet(doc.text, int(start), int(end))
