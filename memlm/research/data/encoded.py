"""Encoded corpora: documents as one flat int32 array with offsets, cached as .npy.

Every document is encoded as ``[B, t_1, ..., t_n, B]`` (see :mod:`memlm.research.data`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from memlm.corpus import Document
from memlm.research.data.cache import atomic_save_npy, atomic_write_text
from memlm.research.data.tokenizers import Tokenizer


@dataclass(frozen=True)
class EncodedCorpus:
    """Documents as one flat array: doc ``i`` is ``ids[offsets[i]:offsets[i+1]]``.

    Each document is ``[B, t_1, ..., t_n, B]`` (see the module docstring).
    """

    ids: np.ndarray  # (N,) int32
    offsets: np.ndarray  # (D+1,) int64
    doc_ids: list[str]
    boundary_id: int

    def __post_init__(self) -> None:
        assert self.ids.ndim == 1 and self.offsets.ndim == 1
        assert len(self.offsets) == len(self.doc_ids) + 1
        assert self.offsets[0] == 0 and self.offsets[-1] == len(self.ids)
        assert np.all(np.diff(self.offsets) >= 2), "every document needs its two boundaries"

    def __len__(self) -> int:
        return len(self.doc_ids)

    def doc(self, i: int) -> np.ndarray:
        return self.ids[self.offsets[i] : self.offsets[i + 1]]

    @property
    def n_targets(self) -> int:
        """Number of (input, target) pairs: tokens plus one end-of-document per document."""
        return len(self.ids) - len(self.doc_ids)

    def subset(self, indices: Sequence[int]) -> EncodedCorpus:
        docs = [self.doc(i) for i in indices]
        return _from_sequences(docs, [self.doc_ids[i] for i in indices], self.boundary_id)

    def truncate_tokens(self, max_targets: int) -> EncodedCorpus:
        """The leading documents holding at most ``max_targets`` targets (at least one doc)."""
        per_doc = np.diff(self.offsets) - 1
        n = int(np.searchsorted(np.cumsum(per_doc), max_targets, side="right"))
        return self.subset(range(max(1, n)))


def _from_sequences(seqs: Sequence[np.ndarray], doc_ids: list[str], boundary: int) -> EncodedCorpus:
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = np.concatenate(seqs).astype(np.int32) if seqs else np.zeros(0, np.int32)
    return EncodedCorpus(ids=ids, offsets=offsets, doc_ids=doc_ids, boundary_id=boundary)


def _corpus_key(docs: Sequence[Document], tokenizer_name: str) -> str:
    h = hashlib.sha256(tokenizer_name.encode())
    for d in docs:
        h.update(d.id.encode() + b"\0" + hashlib.sha256(d.text.encode()).digest())
    return h.hexdigest()[:20]


def encode_corpus(
    docs: Sequence[Document], tokenizer: Tokenizer, cache_dir: Path | None = None
) -> EncodedCorpus:
    """Encode documents as ``[B, t_1..t_n, B]``; cached as .npy when ``cache_dir`` is given.

    The cache key hashes the tokenizer name and every (id, text), so a changed document or
    vocabulary never reuses stale ids.  Files are written via temp + ``os.replace``.
    """
    b = tokenizer.boundary_id
    key = _corpus_key(docs, tokenizer.name)
    folder = cache_dir / f"{tokenizer.name}-{key}" if cache_dir is not None else None
    if folder is not None and (folder / "done.json").exists():
        ids = np.load(folder / "ids.npy")
        offsets = np.load(folder / "offsets.npy")
        meta = json.loads((folder / "done.json").read_text(encoding="utf-8"))
        if meta["n_ids"] == len(ids) and meta["n_docs"] == len(docs) == len(offsets) - 1:
            return EncodedCorpus(ids, offsets, [d.id for d in docs], b)
    encode_many = getattr(tokenizer, "encode_many", None)
    texts = [d.text for d in docs]
    encoded = (
        encode_many(texts) if encode_many is not None else [tokenizer.encode(t) for t in texts]
    )
    seqs = [np.array([b, *e, b], dtype=np.int32) for e in encoded]
    corpus = _from_sequences(seqs, [d.id for d in docs], b)
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_save_npy(folder / "ids.npy", corpus.ids)
        atomic_save_npy(folder / "offsets.npy", corpus.offsets)
        meta = {"n_ids": len(corpus.ids), "n_docs": len(docs), "tokenizer": tokenizer.name}
        atomic_write_text(folder / "done.json", json.dumps(meta))
    return corpus
