"""log p_LM of each stored entry's value, by entry id: what the spread budget ranks a day's
entries by (the best predicted by the LM go first) and what makes the consolidation's
re-test exact (``memlm.memory.consolidation``).

The encoder computes log p_LM(x_t) of every token anyway (MoNIM decides with it), so
keeping it costs a merge into two sorted arrays per stored document, no model work, and
10 B an entry (int64 id, float16 log-probability). Where an entry's id is used again (a
rolled back document's ids on faiss), the new entry's value replaces the old one.

The values live in the memory's root (``entry_lm.npz``), saved at every build beside the
usage counts (temp + fsync + ``os.replace``): a crash loses the values added since the
last build, and those entries are then unknown (NaN), which the budget keeps last and the
re-test never retires. A build that retired entries prunes the values of every entry
no longer live (``prune``, one read of the live ids); a forgotten document's values
linger until then, and no search ever reads them.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import numpy.typing as npt

from memlm.datastore.durable import atomic_savez

ENTRY_LM_FILE = "entry_lm.npz"


class EntryLM:
    """Per-entry log p_LM(value), by entry id (thread-safe)."""

    def __init__(self) -> None:
        self._ids = np.empty(0, np.int64)  # sorted, unique (merged)
        self._lp = np.empty(0, np.float16)
        self._pending: list[tuple[npt.NDArray[np.int64], npt.NDArray[np.float16]]] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            self._merge()
            return len(self._ids)

    def _merge(self) -> None:
        """Fold the documents added since the last read in (the caller holds the lock):
        adding stays O(document), a read pays one sort of what was added."""
        if not self._pending:
            return
        new = np.concatenate([p[0] for p in self._pending])
        if (np.diff(new) > 0).all() and (not len(self._ids) or new[0] > self._ids[-1]):
            # appended after everything known, in order (documents stored one after
            # another): nothing to sort
            self._ids = np.concatenate([self._ids, new])
            self._lp = np.concatenate([self._lp] + [p[1] for p in self._pending])
            self._pending = []
            return
        parts = self._pending[::-1]  # the newest first: unique keeps the first seen
        ids = np.concatenate([p[0] for p in parts] + [self._ids])
        lp = np.concatenate([p[1] for p in parts] + [self._lp])
        self._ids, first = np.unique(ids, return_index=True)
        self._lp = lp[first]
        self._pending = []

    def add(self, ids: npt.ArrayLike, lp: npt.ArrayLike) -> None:
        """Record the entries just stored; an id already known takes the new value."""
        new_ids = np.array(ids, np.int64).reshape(-1)
        new_lp = np.array(lp, np.float16).reshape(-1)
        if new_ids.shape != new_lp.shape:
            raise ValueError(f"{new_ids.size} ids and {new_lp.size} log-probabilities")
        if len(new_ids):
            with self._lock:
                self._pending.append((new_ids, new_lp))

    def of(self, ids: npt.ArrayLike) -> npt.NDArray[np.float64]:
        """log p_LM of each id's value; NaN where it is not known."""
        want = np.asarray(ids, np.int64)
        with self._lock:
            self._merge()
            known, lp = self._ids, self._lp
        out = np.full(want.shape, np.nan)
        if not len(known):
            return out
        at = np.minimum(np.searchsorted(known, want), len(known) - 1)
        hit = known[at] == want
        out[hit] = lp[at[hit]]
        return out

    def keep_below(self, end: int) -> None:
        """Forget the values of ids >= ``end`` (a run cut back to its checkpoint)."""
        with self._lock:
            self._merge()
            keep = self._ids < end
            self._ids, self._lp = self._ids[keep], self._lp[keep]

    def prune(self, live: npt.ArrayLike) -> int:
        """Forget the values of entries not in ``live`` (sorted ids); returns how many."""
        keep_ids = np.asarray(live, np.int64)
        with self._lock:
            self._merge()
            keep = np.isin(self._ids, keep_ids, assume_unique=True)
            gone = int((~keep).sum())
            self._ids, self._lp = self._ids[keep], self._lp[keep]
        return gone

    def nbytes(self) -> int:
        with self._lock:
            self._merge()
            return int(self._ids.nbytes + self._lp.nbytes)

    def save(self, root: Path) -> None:
        """Write the values under ``root`` durably (temp + fsync + replace)."""
        with self._lock:
            self._merge()
            ids, lp = self._ids, self._lp
        root.mkdir(parents=True, exist_ok=True)
        path = root / ENTRY_LM_FILE
        atomic_savez(path, path.with_name(path.name + ".tmp"), {"ids": ids, "lp": lp})

    @classmethod
    def load(cls, root: Path) -> EntryLM:
        """The values saved under ``root`` (none before the first save)."""
        out = cls()
        path = root / ENTRY_LM_FILE
        if path.exists():
            with np.load(path) as z:
                out._ids, out._lp = z["ids"].astype(np.int64), z["lp"].astype(np.float16)
        return out
