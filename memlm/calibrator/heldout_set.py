"""The calibrator's training set on disk: every held-out token merged so far.

One ``.npz`` file in the engine's data directory (``calibrator-train.npz``), with a column
``merged_for`` naming the index version each row was merged for; rewritten whole as temp
+ fsync + ``os.replace``.  Writes run under the engine's build lock.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from memlm.datastore.durable import atomic_savez

TRAIN_FILE = "calibrator-train.npz"  # the held-out tokens merged so far (data directory)


def file_stamp(path: Path) -> tuple[int, int, int] | None:
    """(inode, mtime, size) of a file, None when missing: whether someone replaced it."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


class HeldoutSet:
    """The training-set file and a cached index of its documents and days."""

    def __init__(self, path: Path):
        self.path = Path(path)
        # documents in the training set and its tokens per day, and the file it was read from
        self._index: tuple[set[int], dict[int, int]] | None = None
        self._index_stat: tuple[int, int, int] | None = None

    def rows(self) -> dict[str, np.ndarray]:
        """Every held-out token merged so far (empty dict when none)."""
        if not self.path.exists():
            return {}
        with np.load(self.path) as z:
            rows = {k: z[k] for k in z.files}
        if "merged_for" not in rows:  # written before the column existed: all of it is old
            rows["merged_for"] = np.full(len(rows["day"]), -1, np.int32)
        return rows

    def index(self) -> tuple[set[int], dict[int, int]]:
        """The stream documents in the training set and its tokens per day."""
        stat = file_stamp(self.path)
        index = self._index  # one read: the builder thread may reset it meanwhile
        if index is None or stat != self._index_stat:
            self._index_stat = stat
            docs: set[int] = set()
            days: dict[int, int] = {}
            if self.path.exists():
                with np.load(self.path) as z:
                    doc, day = z["doc"], z["day"]
                docs = set(np.unique(doc[doc >= 0]).tolist())
                u, c = np.unique(day, return_counts=True)
                days = dict(zip(u.tolist(), c.tolist(), strict=True))
            index = self._index = (docs, days)
        return index

    def write(self, rows: dict[str, np.ndarray]) -> None:
        atomic_savez(self.path, self.path.with_suffix(".tmp.npz"), dict(rows))
        self._index = None

    def add(
        self, split: dict[str, np.ndarray], version: int, *, max_tokens: int | None = None
    ) -> int:
        """Merge held-out tokens into the training set for ``version``; returns rows added.

        ``doc`` >= 0 names a stream document: rows of a document already in the set are
        dropped, so merging the same record twice (a crash before its file was deleted)
        adds it once.  Negative ``doc`` values are texts given to ``Engine.train_calibrator``.
        With ``max_tokens`` the set keeps its newest that many rows (by stream day, then
        merge order): the oldest days leave first, so the set and each retrain stay bounded
        however long the stream runs.
        """
        from memlm.calibrator.heldout import stack

        new = {k: np.asarray(v) for k, v in split.items()}
        if not new or not len(new["day"]):
            return 0
        docs, _ = self.index()
        keep = (new["doc"] < 0) | ~np.isin(new["doc"], np.fromiter(docs, np.int64, len(docs)))
        new = {k: v[keep] for k, v in new.items()}
        if not len(new["day"]):
            return 0
        new["merged_for"] = np.full(len(new["day"]), version, np.int32)
        old = self.rows()
        rows = stack([old, new]) if old else new
        if max_tokens is not None and len(rows["day"]) > max_tokens:
            newest = np.sort(np.argsort(rows["day"], kind="stable")[-max_tokens:])
            rows = {k: v[newest] for k, v in rows.items()}
        self.write(rows)
        return len(new["day"])

    def drop_document(self, doc_id: int) -> int:
        """Remove a forgotten document's rows from the training set; returns how many."""
        if doc_id not in self.index()[0]:
            return 0
        rows = self.rows()
        keep = rows["doc"] != doc_id
        self.write({k: v[keep] for k, v in rows.items()})
        return int((~keep).sum())
