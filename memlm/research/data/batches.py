"""Batches of the training pipeline: truncated-BPTT windows and fixed-length segments.

* :func:`bptt_batches` -- truncated BPTT over ``batch_size`` rows, each row a
  concatenation of whole documents (the recurrent models);
* :class:`Segments` -- fixed-length rows with the document and position of every pair,
  for the Transformer (:func:`make_segments`, :func:`stream_segments`,
  :func:`consecutive_batches`).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from memlm.research.data.encoded import EncodedCorpus


@dataclass(frozen=True)
class BPTTBatch:
    """One window of truncated BPTT; state carries from the previous window of each row."""

    x: torch.Tensor  # (B, T) int64 inputs
    y: torch.Tensor  # (B, T) int64 targets
    reset: torch.Tensor  # (B, T) bool: zero the state before step t (a document starts)
    mask: torch.Tensor  # (B, T) bool: a real target (False on padding)
    first: bool  # the first window of a pass: every row starts from a zero state


def _assign_rows(lengths: np.ndarray, order: np.ndarray, n_rows: int) -> list[list[int]]:
    """Give documents, in ``order``, to the currently shortest row (ties: lowest row)."""
    rows: list[list[int]] = [[] for _ in range(n_rows)]
    heap = [(0, r) for r in range(n_rows)]
    for i in order:
        total, r = heapq.heappop(heap)
        rows[r].append(int(i))
        heapq.heappush(heap, (total + int(lengths[i]), r))
    return rows


def bptt_batches(
    corpus: EncodedCorpus,
    batch_size: int,
    bptt: int,
    shuffle_seed: int | None = None,
    pad_id: int | None = None,
) -> Iterator[BPTTBatch]:
    """Windows of ``bptt`` steps over ``batch_size`` rows of whole documents.

    Documents go to rows greedily (shortest row first), in stream order or in a seeded
    random order; each row is the concatenation of its documents' input/target pairs, so
    a row never splits a document across rows and the state of row ``b`` carries across
    windows until ``reset`` marks a new document.  Rows are padded to equal length
    (``mask`` False, input ``pad_id``, default the boundary id).
    """
    if batch_size < 1 or bptt < 1:
        raise ValueError("batch_size and bptt must be positive")
    pad = corpus.boundary_id if pad_id is None else pad_id
    n_docs = len(corpus)
    pairs = np.diff(corpus.offsets) - 1  # (D,) pairs per document
    if shuffle_seed is None:
        order = np.arange(n_docs)
    else:
        order = np.random.default_rng(shuffle_seed).permutation(n_docs)
    rows = _assign_rows(pairs, order, min(batch_size, max(n_docs, 1)))
    width = max((int(pairs[r].sum()) for r in rows), default=0)
    n_win = -(-width // bptt)
    total = n_win * bptt
    x = np.full((batch_size, total), pad, dtype=np.int64)
    y = np.full((batch_size, total), pad, dtype=np.int64)
    reset = np.zeros((batch_size, total), dtype=bool)
    mask = np.zeros((batch_size, total), dtype=bool)
    for b, docs in enumerate(rows):
        t = 0
        for i in docs:
            seq = corpus.doc(i)
            n = len(seq) - 1
            x[b, t : t + n] = seq[:-1]
            y[b, t : t + n] = seq[1:]
            reset[b, t] = True
            mask[b, t : t + n] = True
            t += n
    for w in range(n_win):
        s = slice(w * bptt, (w + 1) * bptt)
        yield BPTTBatch(
            x=torch.from_numpy(x[:, s].copy()),
            y=torch.from_numpy(y[:, s].copy()),
            reset=torch.from_numpy(reset[:, s].copy()),
            mask=torch.from_numpy(mask[:, s].copy()),
            first=w == 0,
        )


def positions_in_document(reset: torch.Tensor, start: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) index of each step within its document, given the resets of a window.

    ``start`` (B,) is the position the first step would have without a reset (the
    previous window's last position + 1); zero when omitted.
    """
    b, t = reset.shape
    base = torch.zeros(b, dtype=torch.long) if start is None else start.clone()
    out = torch.empty(b, t, dtype=torch.long)
    cur = base
    for i in range(t):
        cur = torch.where(reset[:, i], torch.zeros_like(cur), cur)
        out[:, i] = cur
        cur = cur + 1
    return out


# --- fixed-length segments (Transformer training and evaluation) ---------------------------


@dataclass(frozen=True)
class Segments:
    """Rows of ``L`` (input, target) pairs with the document and position of every pair.

    ``doc[s, t]`` is the corpus index of the document the pair belongs to and ``pos[s, t]``
    the index of the pair within that document (0 is the leading boundary input); both are
    -1 on padding. A row may hold the end of one document and the start of the next
    (:func:`stream_segments`), so memories are masked per position, never per row.
    """

    x: np.ndarray  # (S, L) int64 inputs
    y: np.ndarray  # (S, L) int64 targets
    valid: np.ndarray  # (S, L) bool: a real target
    doc: np.ndarray  # (S, L) int64 document index, -1 on padding
    pos: np.ndarray  # (S, L) int64 pair index within its document, -1 on padding

    def __post_init__(self) -> None:
        shape = self.x.shape
        assert len(shape) == 2 and all(
            a.shape == shape for a in (self.y, self.valid, self.doc, self.pos)
        )
        assert bool(np.all((self.doc >= 0) == self.valid)), "doc is -1 exactly on padding"

    def __len__(self) -> int:
        return int(self.x.shape[0])

    @property
    def seg_len(self) -> int:
        return int(self.x.shape[1])


def document_segments(seq: np.ndarray, seg_len: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Split one encoded document into consecutive (inputs, targets) segments.

    Every segment but the last has ``seg_len`` pairs; inputs of segment j+1 continue
    exactly where those of segment j stop.
    """
    if seg_len < 1:
        raise ValueError("seg_len must be positive")
    x, y = seq[:-1], seq[1:]
    return [(x[s : s + seg_len], y[s : s + seg_len]) for s in range(0, len(x), seg_len)]


def make_segments(corpus: EncodedCorpus, seg_len: int) -> Segments:
    """Document-aligned rows: each document cut into segments of ``seg_len``, the last padded.

    The evaluation layout: a row never mixes documents, and the rows of a document follow
    each other in corpus order.
    """
    n_rows = sum(-(-(len(corpus.doc(i)) - 1) // seg_len) for i in range(len(corpus)))
    pad = corpus.boundary_id
    x = np.full((n_rows, seg_len), pad, np.int64)
    y = np.full((n_rows, seg_len), pad, np.int64)
    doc = np.full((n_rows, seg_len), -1, np.int64)
    pos = np.full((n_rows, seg_len), -1, np.int64)
    r = 0
    for i in range(len(corpus)):
        for j, (sx, sy) in enumerate(document_segments(corpus.doc(i), seg_len)):
            n = len(sx)
            x[r, :n], y[r, :n] = sx, sy
            doc[r, :n] = i
            pos[r, :n] = j * seg_len + np.arange(n)
            r += 1
    return Segments(x=x, y=y, valid=doc >= 0, doc=doc, pos=pos)


def stream_segments(corpus: EncodedCorpus, seg_len: int, rows_multiple: int = 1) -> Segments:
    """Full rows: the documents' pairs laid end to end in corpus order, cut every ``seg_len``.

    Every row holds exactly ``seg_len`` real targets (a row may end one document and start
    the next; the boundary token sits between them, as in the encoded corpus). The number
    of rows is rounded down to a multiple of ``rows_multiple`` (the batch size, so that
    every batch of an epoch is full): the dropped tail is fewer than
    ``rows_multiple * seg_len`` pairs at the end of the corpus.
    """
    if seg_len < 1 or rows_multiple < 1:
        raise ValueError("seg_len and rows_multiple must be positive")
    lengths = np.diff(corpus.offsets) - 1  # (D,) pairs per document
    n_rows = int(lengths.sum()) // seg_len // rows_multiple * rows_multiple
    if n_rows == 0:
        raise ValueError(
            f"{int(lengths.sum())} pairs do not fill {rows_multiple} rows of {seg_len}"
        )
    # the pairs of document i are ids[offsets[i] + p] -> ids[offsets[i] + p + 1], p < len_i
    doc = np.repeat(np.arange(len(corpus), dtype=np.int64), lengths)
    starts = np.repeat(
        corpus.offsets[:-1] - np.cumsum(np.concatenate([[0], lengths[:-1]])), lengths
    )
    src = np.arange(len(doc), dtype=np.int64) + starts  # index of the input in ids
    pos = src - corpus.offsets[:-1][doc]
    n = n_rows * seg_len
    ids = corpus.ids.astype(np.int64)
    shape = (n_rows, seg_len)
    return Segments(
        x=ids[src[:n]].reshape(shape),
        y=ids[src[:n] + 1].reshape(shape),
        valid=np.ones(shape, dtype=bool),
        doc=doc[:n].reshape(shape),
        pos=pos[:n].reshape(shape),
    )


def consecutive_batches(n_rows: int, batch_segments: int, m: int, seed: int = 0) -> list[list[int]]:
    """TrimeLM_long batches: groups of ``m`` consecutive rows, ``batch_segments // m`` a batch.

    Over :func:`stream_segments` rows, a group is ``m * L`` consecutive pairs of the
    stream, so the later segments of a document find its earlier ones in the same batch
    (the memory mask keeps each position to its own document). Groups are shuffled with
    ``seed``; each row appears exactly once. When ``n_rows`` is a multiple of
    ``batch_segments`` and ``batch_segments`` of ``m``, every batch holds exactly
    ``batch_segments`` rows and every group is whole.
    """
    if m < 1 or batch_segments < m or batch_segments % m:
        raise ValueError(
            f"batch_segments ({batch_segments}) must be a positive multiple of m ({m})"
        )
    groups = [list(range(a, min(a + m, n_rows))) for a in range(0, n_rows, m)]
    per_batch = batch_segments // m
    order = np.random.default_rng(seed).permutation(len(groups))
    return [
        [r for g in order[k : k + per_batch] for r in groups[g]]
        for k in range(0, len(order), per_batch)
    ]
