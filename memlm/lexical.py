"""Lexical statistics of everything ingested so far (features of the NN calibrator).

For every token id v: how often it occurred as a context token, and how many distinct
tokens followed it.  Kept incrementally as documents are ingested and saved beside the
datastore (temp + os.replace), so the calibrator sees the stream as it was at that time.
The ids of the counted documents are saved in the same file, so a document processed again
(after a crash between the datastore append and the database commit) is counted once.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


class LexicalStats:
    """Unigram counts of context tokens and their distinct successors."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.count = np.zeros(vocab_size, np.int64)  # occurrences as a context token
        self.successors = np.zeros(vocab_size, np.int64)  # distinct next tokens
        self._pairs: set[int] = set()  # prev * vocab + next, to count distinct successors
        self.docs: set[int] = set()  # documents already counted

    def counted(self, doc_id: int) -> bool:
        """Whether the document's tokens are in the statistics already."""
        return doc_id in self.docs

    def update(self, tokens: np.ndarray, doc_id: int | None = None) -> bool:
        """Add one document's token ids (in order); False if ``doc_id`` was counted before."""
        if doc_id is not None:
            if doc_id in self.docs:
                return False
            self.docs.add(doc_id)
        t = np.asarray(tokens, dtype=np.int64)
        if len(t) < 2:
            return True
        prev, nxt = t[:-1], t[1:]
        np.add.at(self.count, prev, 1)
        for p in np.unique(prev * self.vocab_size + nxt).tolist():
            if p not in self._pairs:
                self._pairs.add(p)
                self.successors[p // self.vocab_size] += 1
        return True

    def features(self, prev_tokens: np.ndarray) -> np.ndarray:
        """(n, 2) float32: log(1 + frequency), log(1 + distinct successors) of each token."""
        p = np.asarray(prev_tokens, dtype=np.int64)
        return np.stack([np.log1p(self.count[p]), np.log1p(self.successors[p])], 1).astype(
            np.float32
        )

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp.npz")
        pairs = np.fromiter(self._pairs, np.int64, len(self._pairs))
        docs = np.fromiter(self.docs, np.int64, len(self.docs))
        # counts and counted documents in one file: one os.replace makes both visible
        np.savez(tmp, count=self.count, pairs=pairs, docs=docs)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path, vocab_size: int) -> LexicalStats:
        s = cls(vocab_size)
        if path.exists():
            with np.load(path) as z:
                s.count = z["count"].astype(np.int64)
                s._pairs = set(z["pairs"].tolist())
                s.docs = set(z["docs"].tolist()) if "docs" in z.files else set()
            np.add.at(s.successors, np.array(sorted(s._pairs), np.int64) // vocab_size, 1)
        return s
