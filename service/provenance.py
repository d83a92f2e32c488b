"""Neighbours' provenance: document, date and a snippet around the token position."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from memlm.db.models import Document
from service.schemas import NeighbourOut

SNIPPET_CHARS = 240  # about two lines either side of the token


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


def neighbours_out(
    neighbours: Sequence[Any],
    docs: dict[int, Document],
    char_span: Callable[[str, int], tuple[int, int]] | None,
) -> list[NeighbourOut]:
    """Join the engine's neighbours with their documents.

    ``char_span(text, position)`` gives the characters of the token at ``position``;
    without it (fake engines) the snippet is the start of the document.
    """
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
        if doc is not None and doc.status not in ("forgetting", "forgotten"):
            start, end = char_span(doc.text, int(n.position)) if char_span else (0, 0)
            item.title = doc.title
            item.published_at = doc.published_at
            item.source = doc.source
            item.snippet = snippet(doc.text, start, end)
        out.append(item)
    return out
