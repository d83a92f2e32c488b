"""Lexical statistics of everything ingested so far (features of the NN calibrator).

For every token id v: how often it occurred as a context token, and how many distinct
tokens followed it.  Kept incrementally as documents are ingested and saved beside the
datastore (temp + os.replace), so the calibrator sees the stream as it was at that time.
The ids of the counted documents are saved in the same file, so a document processed again
(after a crash between the datastore append and the database commit) is counted once.
Each (token, next token) pair keeps its count, so a forgotten document's tokens can be
taken out again (:meth:`LexicalStats.remove`); a forgotten id is never counted again.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from memlm.datastore.durable import fsync_dir


class LexicalStats:
    """Unigram counts of context tokens and their distinct successors."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.count = np.zeros(vocab_size, np.int64)  # occurrences as a context token
        self.successors = np.zeros(vocab_size, np.int64)  # distinct next tokens
        self._pairs: dict[int, int] = {}  # prev * vocab + next -> occurrences
        self.docs: set[int] = set()  # documents counted now
        self.forgotten: set[int] = set()  # documents taken out again; never counted anew

    def counted(self, doc_id: int) -> bool:
        """Whether the document's tokens are in the statistics (or were, and were removed)."""
        return doc_id in self.docs or doc_id in self.forgotten

    def _pairs_of(self, t: np.ndarray) -> tuple[list[int], list[int]]:
        u, c = np.unique(t[:-1] * self.vocab_size + t[1:], return_counts=True)
        return u.tolist(), c.tolist()

    def update(self, tokens: np.ndarray, doc_id: int | None = None) -> bool:
        """Add one document's token ids (in order); False if ``doc_id`` was counted before."""
        if doc_id is not None:
            if self.counted(doc_id):
                return False
            self.docs.add(doc_id)
        t = np.asarray(tokens, dtype=np.int64)
        if len(t) < 2:
            return True
        np.add.at(self.count, t[:-1], 1)
        for p, c in zip(*self._pairs_of(t), strict=True):
            old = self._pairs.get(p, 0)
            if old == 0:
                self.successors[p // self.vocab_size] += 1
            self._pairs[p] = old + c
        return True

    def remove(self, tokens: np.ndarray, doc_id: int) -> bool:
        """Take a counted document's token ids out again; False if it is not counted now.

        ``tokens`` must be the ids that were counted for it (the same text, same tokenizer).
        """
        if doc_id not in self.docs:
            return False
        t = np.asarray(tokens, dtype=np.int64)
        if len(t) >= 2:
            if (np.bincount(t[:-1], minlength=self.vocab_size) > self.count).any():
                raise ValueError(f"document {doc_id}: these tokens were not counted for it")
            np.subtract.at(self.count, t[:-1], 1)
            for p, c in zip(*self._pairs_of(t), strict=True):
                left = self._pairs.get(p, 0) - c
                if left > 0:
                    self._pairs[p] = left
                elif p in self._pairs:  # (< 0 only for a file saved without pair counts)
                    del self._pairs[p]
                    self.successors[p // self.vocab_size] -= 1
        self.docs.discard(doc_id)
        self.forgotten.add(doc_id)
        return True

    def features(self, prev_tokens: np.ndarray) -> np.ndarray:
        """(n, 2) float32: log(1 + frequency), log(1 + distinct successors) of each token."""
        p = np.asarray(prev_tokens, dtype=np.int64)
        return np.stack([np.log1p(self.count[p]), np.log1p(self.successors[p])], 1).astype(
            np.float32
        )

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp.npz")
        pairs = np.fromiter(self._pairs.keys(), np.int64, len(self._pairs))
        pair_counts = np.fromiter(self._pairs.values(), np.int64, len(self._pairs))
        docs = np.fromiter(self.docs, np.int64, len(self.docs))
        forgotten = np.fromiter(self.forgotten, np.int64, len(self.forgotten))
        # everything in one file: one os.replace makes counts and document ids visible;
        # the file is on disk before the replace and the replace before the return (a
        # power cut must not leave an empty file under the old name)
        try:
            with open(tmp, "wb") as fh:
                np.savez(
                    fh,
                    count=self.count,
                    pairs=pairs,
                    pair_counts=pair_counts,
                    docs=docs,
                    forgotten=forgotten,
                )
                fh.flush()
                os.fsync(fh.fileno())
        except OSError:  # a full disk: the partial temp file (~0.6 MB) must not stay
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, path)
        fsync_dir(path.parent)

    @classmethod
    def load(cls, path: Path, vocab_size: int) -> LexicalStats:
        s = cls(vocab_size)
        if path.exists():
            with np.load(path) as z:
                s.count = z["count"].astype(np.int64)
                pairs = z["pairs"].astype(np.int64)
                # files written before pair counts were kept: each pair counted once, so a
                # removal may drop a pair another document still has (features only)
                counts = (
                    z["pair_counts"].astype(np.int64)
                    if "pair_counts" in z.files
                    else np.ones(len(pairs), np.int64)
                )
                s._pairs = dict(zip(pairs.tolist(), counts.tolist(), strict=True))
                s.docs = set(z["docs"].tolist()) if "docs" in z.files else set()
                s.forgotten = set(z["forgotten"].tolist()) if "forgotten" in z.files else set()
            np.add.at(s.successors, pairs // vocab_size, 1)
        return s
