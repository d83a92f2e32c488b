"""Neighbours' provenance: document, date and a snippet around the token position.

Provenance names memorised documents and tokens, so it is answered only to callers who may
read memorised text (:func:`check_neighbour_access`; docs/service.md, "What an anonymous
caller learns"). A snippet is a slice of the document's text at the character span of the
neighbour's token. The spans of every token are stored at ingest (``document_spans``,
committed with the document), so answering costs a database read, not a tokenisation, and
recently named documents' spans stay in a bounded cache. Only a window of the text around
each token is read (:class:`memlm.db.repositories.provenance.ProvenanceRepository`), never the whole
document. Documents memorised before spans were stored are read whole and tokenised once
here, in a worker thread (never on the event loop).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy.orm import Session, sessionmaker

from memlm.api import NeighbourOut
from memlm.db.repositories import SpanRepository
from memlm.db.repositories.provenance import ProvenanceRepository, TextWindow
from service.errors import Unauthorized

log = logging.getLogger(__name__)

SNIPPET_CHARS = 240  # about two lines either side of the token
# Spans cached: 4M tokens (32 MB as int32 pairs), about 80 documents of 200k characters.
SPAN_CACHE_TOKENS = 1 << 22


# Neighbours of a document being forgotten show neither title nor snippet.
HIDDEN = ("forgetting", "forgotten")

NEIGHBOURS_NEED_READ = (
    "neighbours name memorised documents and tokens: asking for them needs a read, ingest "
    "or admin bearer token (without one, only suggestions are answered)"
)


def check_neighbour_access(may_read: bool) -> None:
    """Refuse (401) a request for neighbours from a caller who may not read memorised text.

    Called before any model work: a stored token with its document and position rebuilds
    what was memorised, so without read rights no neighbour leaves the service at all.
    """
    if not may_read:
        raise Unauthorized(NEIGHBOURS_NEED_READ)


def snippet_window(start: int, end: int, width: int = SNIPPET_CHARS) -> tuple[int, int]:
    """The characters [lo, hi) of a text that the snippet of [start, end) needs: one more
    than it shows at the end, which tells whether the text goes on."""
    return max(0, start - width // 2), end + width // 2 + 1


def snippet(text: str, start: int, end: int, width: int = SNIPPET_CHARS) -> str:
    """Text around [start, end) cut at word boundaries, the token marked with [[ ]]."""
    lo, hi = snippet_window(start, end, width)
    return snippet_of(text[lo:hi], lo, start, end, width)


def snippet_of(piece: str, lo: int, start: int, end: int, width: int = SNIPPET_CHARS) -> str:
    """:func:`snippet` from ``piece``, the text's characters from ``lo`` on that
    :func:`snippet_window` names (fewer where the text ends)."""
    start, end = start - lo, end - lo
    stop = end + width // 2
    goes_on = len(piece) > stop
    a, b = 0, min(len(piece), stop)
    if lo > 0:
        space = piece.find(" ", a, start)
        a = space + 1 if space != -1 else a
    if goes_on:
        space = piece.rfind(" ", end, b)
        b = space if space != -1 else b
    head = ("…" if lo > 0 else "") + piece[a:start]
    tail = piece[end:b] + ("…" if goes_on else "")
    return f"{head}[[{piece[start:end]}]]{tail}".replace("\n", " ")


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

    def discard(self, doc_id: int) -> None:
        with self._lock:
            old = self._spans.pop(doc_id, None)
            if old is not None:
                self._tokens -= len(old)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()
            self._tokens = 0


@dataclass(frozen=True)
class _Window:
    """The text a neighbour's snippet needs, and its token's characters in that text."""

    text: TextWindow
    start: int
    end: int


def provenance(
    sessions: sessionmaker[Session], neighbours: Sequence[Any], cache: SpanCache
) -> list[NeighbourOut]:
    """The neighbours with their documents' title, date, source and a snippet (blocking:
    run it in a worker thread; only for callers who pass :func:`check_neighbour_access`).

    Reads each document's card, its spans unless cached, and the window of text around
    each token: never a whole document, except one without stored spans (tokenised once).
    """
    ids = {int(n.doc_id) for n in neighbours}
    with sessions() as s:
        repo = ProvenanceRepository(s)
        cards = repo.cards(ids)
        shown = {i for i, card in cards.items() if card.status not in HIDDEN}
        spans = {i: cache.cached(i) for i in shown}
        missing = [i for i in sorted(shown) if spans[i] is None]
        for doc_id, stored in SpanRepository(s).many(missing).items():
            spans[doc_id] = cache.put(doc_id, stored)
        unspanned = [i for i in missing if spans[i] is None]
        texts = repo.texts(unspanned) if cache.char_spans is not None else {}
        where = [
            _token_window(spans[int(n.doc_id)], int(n.doc_id), int(n.position))
            if int(n.doc_id) in shown.difference(texts)
            else None
            for n in neighbours
        ]
        read = iter(repo.windows([w.text for w in where if w is not None]))
        pieces = [None if w is None else next(read) for w in where]
    for doc_id in cards.keys() - shown:
        cache.discard(doc_id)  # neither snippet nor title of a document being forgotten
    # Tokenised here, after the session: SQLite transactions take the write lock.
    char_spans = cache.char_spans
    if char_spans is not None:
        spans.update((i, cache.put(i, char_spans(t))) for i, t in texts.items())
    out = []
    for n, window, piece in zip(neighbours, where, pieces, strict=True):
        doc_id, position = int(n.doc_id), int(n.position)
        item = NeighbourOut(
            entry_id=int(n.entry_id),
            document_id=doc_id,
            token=str(n.token),
            distance=float(n.distance),
            position=position,
        )
        card = cards.get(doc_id)
        if card is not None and doc_id in shown:
            item.title = card.title
            item.published_at = card.published_at
            item.source = card.source
            if doc_id in texts:
                window = _token_window(spans[doc_id], doc_id, position)
                if window is not None:
                    piece = texts[doc_id][window.text.start : window.text.stop]
            if window is not None and piece is not None:  # None: deleted since its card
                item.snippet = snippet_of(piece, window.text.start, window.start, window.end)
        out.append(item)
    return out


def _token_window(spans: np.ndarray | None, doc_id: int, position: int) -> _Window | None:
    """The window of text the snippet of the token at ``position`` needs; None when the
    document has no such position."""
    if spans is None:  # an engine that cannot tell (the fakes of some tests)
        start = end = 0
    elif not 0 <= position < len(spans):
        log.warning("document %d has %d tokens, no position %d", doc_id, len(spans), position)
        return None
    else:
        start, end = int(spans[position][0]), int(spans[position][1])
    lo, hi = snippet_window(start, end)
    return _Window(TextWindow(doc_id, lo, hi), start, end)
