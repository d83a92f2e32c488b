"""How the memory is used: per block of entry ids, how often an entry of the block was
among the neighbours of an ingested token (retrievals) and how often its value was that
token (hits, "the retrieval helped").

MoNIM already searches the memory for every ingested token, so counting costs one
``np.unique`` over the neighbour ids of a document and a merge into sorted arrays: no
search of its own. Blocks of ``block`` consecutive ids (faiss ids are datastore
positions; Milvus ids are ``doc_id * 2**24 + position``, so a block never spans two
documents there) keep the state small: 3 int64 per block that was ever retrieved.
``block=1`` counts per entry.

The counts live in the memory's root (``usage.npz``), saved at every build (temp +
``os.replace``): a crash loses the counts since the last build, never doubles them. The
engine counts a document's search when it stores the document, once, with its lexical
statistics (``Engine.store_document``): a retried or reprocessed document counts no more.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import numpy.typing as npt

from memlm.datastore.durable import atomic_savez

USAGE_FILE = "usage.npz"
# 64 entries a block: one document's stored tokens span ~5-15 blocks, and the state is
# 24 B per 64 entries (0.4 B/entry) against 1,172 B/entry of datastore
DEFAULT_BLOCK = 64


class Usage:
    """Retrieval and hit counts per block of entry ids (thread-safe)."""

    def __init__(self, block: int = DEFAULT_BLOCK) -> None:
        assert block >= 1
        self.block = block
        self.blocks = np.empty(0, np.int64)  # sorted block numbers ever retrieved
        self.retrievals = np.empty(0, np.int64)
        self.hits = np.empty(0, np.int64)
        self._lock = threading.Lock()

    def add(
        self, ids: npt.NDArray[np.int64], vals: npt.NDArray[np.int32], gold: np.ndarray
    ) -> None:
        """Count one search: ids, vals (n, k) neighbours of n tokens, gold (n,) tokens."""
        ok = ids >= 0
        if not ok.any():
            return
        b = ids[ok] // self.block
        hit = (vals == np.asarray(gold).reshape(-1, 1))[ok]
        ub, inv = np.unique(b, return_inverse=True)
        r = np.bincount(inv, minlength=len(ub)).astype(np.int64)
        h = np.bincount(inv, weights=hit, minlength=len(ub)).astype(np.int64)
        with self._lock:
            allb = np.union1d(self.blocks, ub)
            if len(allb) != len(self.blocks):
                at = np.searchsorted(allb, self.blocks)
                ret, hits = np.zeros(len(allb), np.int64), np.zeros(len(allb), np.int64)
                ret[at], hits[at] = self.retrievals, self.hits
                self.blocks, self.retrievals, self.hits = allb, ret, hits
            at = np.searchsorted(self.blocks, ub)
            self.retrievals[at] += r
            self.hits[at] += h

    def of(self, ids: npt.ArrayLike) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """(hits, retrievals) of each entry's block (0 for a block never retrieved)."""
        b = np.asarray(ids, np.int64) // self.block
        with self._lock:
            at = np.searchsorted(self.blocks, b)
            at = np.minimum(at, max(0, len(self.blocks) - 1))
            found = self.blocks[at] == b if len(self.blocks) else np.zeros(b.shape, dtype=bool)
            hits = np.where(found, self.hits[at] if len(self.blocks) else 0, 0)
            ret = np.where(found, self.retrievals[at] if len(self.blocks) else 0, 0)
        return hits.astype(np.int64), ret.astype(np.int64)

    def nbytes(self) -> int:
        """Bytes the counts hold in RAM."""
        return int(self.blocks.nbytes + self.retrievals.nbytes + self.hits.nbytes)

    def totals(self) -> dict[str, int]:
        with self._lock:
            return {
                "block": self.block,
                "blocks": len(self.blocks),
                "retrievals": int(self.retrievals.sum()),
                "hits": int(self.hits.sum()),
                "bytes": self.nbytes(),
            }

    def save(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        with self._lock:  # add edits the counts in place: write them under the lock
            arrays = {
                "block": np.int64(self.block),
                "blocks": self.blocks,
                "retrievals": self.retrievals,
                "hits": self.hits,
            }
            atomic_savez(root / USAGE_FILE, root / (USAGE_FILE + ".tmp"), arrays)

    @classmethod
    def load(cls, root: Path, block: int = DEFAULT_BLOCK) -> Usage:
        """The counts saved in ``root`` (empty when none, or saved with another block)."""
        out = cls(block)
        path = root / USAGE_FILE
        if not path.exists():
            return out
        with np.load(path) as z:
            if int(z["block"]) != block:
                return out
            out.blocks = z["blocks"].astype(np.int64)
            out.retrievals = z["retrievals"].astype(np.int64)
            out.hits = z["hits"].astype(np.int64)
        return out
