"""Forgetting: deleting a document (its tombstone) and compacting its rows away."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from memlm.datastore.durable import fsync_dir
from memlm.datastore.layout import (
    _COMPACT_CHUNK,
    _IDS_DTYPE,
    COMPACT_CRASH_POINTS,
    DELETE_CRASH_POINTS,
    RETIRE_CRASH_POINTS,
    SimulatedCrash,
    _check_crash,
    _segment_name,
)
from memlm.datastore.writing import _Writing


@dataclass(frozen=True)
class Compaction:
    """What one :meth:`Datastore.compact` did."""

    segments: int  # segments rewritten
    rows_removed: int  # rows of deleted documents that left the disk
    bytes_reclaimed: int  # data-file bytes freed (old files minus their rewrites)


class _Forget(_Writing):
    """Deletion (tombstones) and compaction of a writer handle."""

    def delete_document(
        self, doc_id: int, *, entries: range | None = None, crash_at: str | None = None
    ) -> int:
        """Hide every entry of ``doc_id`` (also ones appended later); returns how many
        committed entries this newly hid (0 when already deleted).

        The document's id joins the tombstone log (one 8-byte write) and the manifest's
        live count drops by its entries. ``entries``: the id range that holds all of its
        entries (the database records it), so that only that range is read; without it
        every segment's document ids are scanned.
        """
        doc_id = int(doc_id)
        if crash_at is not None and crash_at not in DELETE_CRASH_POINTS:
            raise ValueError(f"crash_at must be one of {DELETE_CRASH_POINTS}, got {crash_at!r}")
        with self.exclusive(), self._write_lock:
            self._check_usable()
            m = self._m
            if doc_id in self._deleted:
                return 0
            if entries is None:
                ids = self.entries_of_document(doc_id)
            else:
                ids = np.arange(max(0, entries.start), min(entries.stop, m.total), dtype=np.int64)
                ids = ids[self._present(ids)]
                ids = ids[self._gather("doc_ids", ids) == doc_id]
            # entries consolidation retired already left the live count
            hidden = int((~np.isin(ids, self._retired_arr)).sum())
            try:
                self._write_tombstones(m.tombstones, np.array([doc_id], dtype=np.int64))
                _check_crash(crash_at, "after_log")
                self._commit(m.changed(tombstones=m.tombstones + 1, live=m.live - hidden), crash_at)
            except SimulatedCrash:
                self._crashed()
                raise
            return hidden

    def retire_entries(self, ids: npt.ArrayLike, *, crash_at: str | None = None) -> int:
        """Hide single entries from every later read, search and build (consolidation's
        retirement); the next ``compact`` removes their rows. Returns how many of ``ids``
        this newly retired: ids already retired, of a deleted document, compacted away or
        out of range count 0, so a retry after a crash counts nothing twice.

        The same mechanism as a document's tombstone: (id, generation) pairs join the
        retired log (16 bytes each), then one manifest commit with the live count.
        """
        if crash_at is not None and crash_at not in RETIRE_CRASH_POINTS:
            raise ValueError(f"crash_at must be one of {RETIRE_CRASH_POINTS}, got {crash_at!r}")
        want = np.unique(np.asarray(ids, dtype=np.int64).reshape(-1))
        with self.exclusive(), self._write_lock:
            self._check_usable()
            m = self._m
            want = want[(want >= 0) & (want < m.total)]
            if want.size:
                want = want[self.live_mask(want)]
            if not want.size:
                return 0
            pairs = np.stack([want, np.full(want.shape, m.generation + 1, np.int64)], axis=1)
            try:
                self._write_retired(m.retired, pairs)
                _check_crash(crash_at, "after_log")
                new = m.changed(retired=m.retired + len(want), live=m.live - len(want))
                self._commit(new, crash_at)
            except SimulatedCrash:
                self._crashed()
                raise
            return int(want.size)

    def compact(self, *, crash_at: str | None = None) -> Compaction:
        """Rewrite every segment that holds rows of deleted documents without them.

        Ids stay stable: a compacted segment records which ids its rows hold, so the
        documents' ``entry_start``/``entry_end`` in the database, the ids inside built
        index versions and the worker's cut of an uncommitted tail (by id) all stay
        valid, and the whole change is one manifest commit. Renumbering would have to
        update the database and every index version in the same crash-safe step, which a
        file rename cannot do. Ids of removed rows read as absent (``live_mask`` False).

        Crash safety: new files get new names (``seg-000003-c<generation>``), so nothing
        served changes until the manifest names them; a crash before the commit leaves
        unlisted new files, one after it unlisted old files, and the next writer open (or
        compaction) removes either. Deleted rows are hidden from every read throughout.
        Holds the write lock for the whole rewrite: appends wait (at night, once).
        """
        if crash_at is not None and crash_at not in COMPACT_CRASH_POINTS:
            raise ValueError(f"crash_at must be one of {COMPACT_CRASH_POINTS}, got {crash_at!r}")
        with self.exclusive(), self._write_lock:
            self._check_usable()
            try:
                return self._compact_locked(crash_at)
            except SimulatedCrash:
                self._crashed()
                raise

    def _compact_locked(self, crash_at: str | None) -> Compaction:
        m = self._m
        self._recover(cut_tails=False)  # leftovers of a compaction that crashed
        if not self._deleted and not self._retired_arr.size:
            return Compaction(0, 0, 0)
        plan: list[tuple[int, npt.NDArray[np.int64]]] = []  # (segment, rows it keeps)
        cap = m.max_segment_entries
        for seg, nrows in enumerate(m.rows):
            if nrows:
                maps = self._segment_maps(seg)
                dead = np.isin(maps["doc_ids"], self._deleted_arr)
                if self._retired_arr.size:  # rows of retired entries, by id
                    offs = maps["ids"] if m.sparse(seg) else np.arange(nrows)
                    dead |= np.isin(seg * cap + np.asarray(offs, np.int64), self._retired_arr)
                if dead.any():
                    plan.append((seg, np.flatnonzero(~dead)))
        if not plan:
            return Compaction(0, 0, 0)
        gen = m.generation + 1
        written: list[Path] = []
        try:
            return self._rewrite(plan, gen, written, crash_at)
        except OSError:
            # a full disk: the new files are not served yet; they would hold space until
            # the next compaction or writer open removed them
            if self._m.generation < gen:
                for f in written:
                    f.unlink(missing_ok=True)
            raise

    def _rewrite(
        self,
        plan: list[tuple[int, npt.NDArray[np.int64]]],
        gen: int,
        written: list[Path],
        crash_at: str | None,
    ) -> Compaction:
        """Write the kept rows of the planned segments under new names, commit, unlink the
        old files; ``written`` collects the new files as they are created."""
        m = self._m
        rows, names = list(m.rows), list(m.names)
        old_files: list[Path] = []
        freed = removed = 0
        for j, (seg, keep) in enumerate(plan):
            maps = self._segment_maps(seg)
            name = f"{_segment_name(seg)}-c{gen:06d}"
            new_files = self._files(seg, name)
            offs = maps["ids"] if m.sparse(seg) else None
            for column, f in new_files.items():
                written.append(f)
                with open(f, "wb") as fh:
                    for lo in range(0, len(keep), _COMPACT_CHUNK):
                        sel = keep[lo : lo + _COMPACT_CHUNK]
                        if column == "ids":
                            part = sel if offs is None else offs[sel]
                            fh.write(np.ascontiguousarray(part, dtype=_IDS_DTYPE).tobytes())
                        else:
                            fh.write(np.ascontiguousarray(maps[column][sel]).tobytes())
                    fh.flush()
                    os.fsync(fh.fileno())
                freed -= f.stat().st_size
            olds = list(self._files(seg).values())
            old_files += olds
            freed += sum(f.stat().st_size for f in olds)
            removed += m.rows[seg] - len(keep)
            rows[seg], names[seg] = len(keep), name
            if j == 0:
                _check_crash(crash_at, "mid_files")
        fsync_dir(self.path)
        _check_crash(crash_at, "after_files")
        new = m.changed(rows=rows, names=names, reclaimed_bytes=m.reclaimed_bytes + freed)
        self._commit(new, crash_at)
        for f in old_files:  # readers that still map them keep their pages until reload
            f.unlink()
        fsync_dir(self.path)
        return Compaction(len(plan), removed, freed)
