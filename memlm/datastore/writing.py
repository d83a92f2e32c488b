"""Appending entries durably, and rolling back an uncommitted tail."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from memlm.datastore.durable import _give_back, fsync_dir
from memlm.datastore.layout import (
    _COLUMNS,
    _IDS_DTYPE,
    CRASH_POINTS,
    DatastoreError,
    SimulatedCrash,
    _check_crash,
    _segment_name,
)
from memlm.datastore.recovery import _Recovery


def _as_int_column(
    name: str, x: object, n: int, dtype: np.dtype[Any], *, allow_scalar: bool
) -> npt.NDArray[Any]:
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu":
        raise DatastoreError(f"{name}: expected integers, got dtype {arr.dtype}")
    if arr.ndim == 0 and allow_scalar:
        arr = np.full(n, arr, dtype=arr.dtype)
    if arr.shape != (n,):
        raise DatastoreError(f"{name}: expected shape ({n},), got {arr.shape}")
    info = np.iinfo(dtype)
    if n and (arr.min() < info.min or arr.max() > info.max):
        raise DatastoreError(f"{name}: values outside the {dtype} range")
    return np.ascontiguousarray(arr, dtype=dtype)


class _Writing(_Recovery):
    """Appends and truncation (one writer at a time; see ``exclusive``)."""

    def _validate(
        self,
        keys: object,
        values: object,
        doc_ids: object,
        positions: object,
        days: object,
    ) -> tuple[npt.NDArray[np.float16], list[npt.NDArray[Any]]]:
        k = np.asarray(keys)
        if k.ndim != 2 or k.shape[1] != self._m.dim:
            raise DatastoreError(f"keys: expected shape (n, {self._m.dim}), got {k.shape}")
        if k.dtype not in (np.float16, np.float32):
            raise DatastoreError(f"keys: expected float16 or float32, got dtype {k.dtype}")
        with np.errstate(over="ignore"):  # overflow becomes inf, refused just below
            k16 = np.ascontiguousarray(k, dtype=np.float16)
        if not np.isfinite(k16).all():
            raise DatastoreError("keys: NaN, inf, or beyond the float16 range (65504)")
        n = k16.shape[0]
        cols = [
            _as_int_column("values", values, n, np.dtype(np.int32), allow_scalar=False),
            _as_int_column("doc_ids", doc_ids, n, np.dtype(np.int64), allow_scalar=True),
            _as_int_column("positions", positions, n, np.dtype(np.int32), allow_scalar=False),
            _as_int_column("days", days, n, np.dtype(np.int32), allow_scalar=True),
        ]
        if n and cols[0].min() < 0:
            raise DatastoreError("values: token ids must be >= 0")
        return k16, cols

    def append(
        self,
        keys: npt.ArrayLike,
        values: npt.ArrayLike,
        doc_ids: npt.ArrayLike,
        positions: npt.ArrayLike,
        days: npt.ArrayLike,
        *,
        crash_at: str | None = None,
    ) -> range:
        """Append entries durably; returns their global ids once the manifest commits them.

        ``keys`` is float16 (or float32, converted) of shape (n, dim); the other columns
        have shape (n,) and integer dtype (``doc_ids`` and ``days`` may be scalars).
        ``crash_at`` (one of ``CRASH_POINTS``) raises ``SimulatedCrash`` there; the object
        must then be discarded and the directory reopened, as after a real crash.
        """
        if crash_at is not None and crash_at not in CRASH_POINTS:
            raise ValueError(f"crash_at must be one of {CRASH_POINTS}, got {crash_at!r}")
        k16, cols = self._validate(keys, values, doc_ids, positions, days)
        n = k16.shape[0]
        with self.exclusive(), self._write_lock:
            self._check_usable()
            if n == 0:
                return range(self._m.total, self._m.total)
            try:
                return self._append_locked(k16, cols, crash_at)
            except SimulatedCrash:
                self._crashed()
                raise

    def _append_locked(
        self, k16: npt.NDArray[np.float16], cols: list[npt.NDArray[Any]], crash_at: str | None
    ) -> range:
        m = self._m
        start, n, cap = m.total, k16.shape[0], m.max_segment_entries
        counts, rows = list(m.counts), list(m.rows)
        # Plan (segment, id offset in segment, row offset in its files, slice of the batch).
        pieces: list[tuple[int, int, int, slice]] = []
        done = 0
        while done < n:
            if not counts or counts[-1] == cap:
                counts.append(0)
                rows.append(0)
            seg, off = len(counts) - 1, counts[-1]
            take = min(cap - off, n - done)
            pieces.append((seg, off, rows[-1], slice(done, done + take)))
            counts[-1] += take
            rows[-1] += take
            done += take
        _check_crash(crash_at, "before_data")
        # each file's size before this append: a failure gives the bytes it added back
        sizes = {
            f: (f.stat().st_size if f.exists() else -1)
            for seg, *_ in pieces
            for f in self._files(seg).values()
        }
        names_now = list(m.names) + [_segment_name(i) for i in range(len(m.names), len(counts))]
        dead = int(np.isin(cols[1], self._deleted_arr).sum()) if self._deleted else 0
        new = m.changed(counts=counts, rows=rows, names=names_now, live=m.live + n - dead)
        try:
            self._write_pieces(pieces, k16, cols, crash_at)
            _check_crash(crash_at, "after_data")
            self._commit(new, crash_at)
        except OSError:
            # A full disk (ENOSPC) or a failed device. Unless the manifest took (a failure
            # after the rename), nothing was committed, and the bytes written so far
            # would hold space until the next exclusive open.
            if self._m is not new:
                for f, size in sizes.items():
                    _give_back(f, max(size, 0), size < 0)
            raise
        return range(start, start + n)

    def _write_pieces(
        self,
        pieces: list[tuple[int, int, int, slice]],
        k16: npt.NDArray[np.float16],
        cols: list[npt.NDArray[Any]],
        crash_at: str | None,
    ) -> None:
        """Write (and fsync) every column of the planned pieces at their rows."""
        new_files = False
        names = ["keys"] + [name for name, _ in _COLUMNS]
        arrays = [k16, *cols]
        for i, (column, arr) in enumerate(zip(names, arrays, strict=True)):
            if i == 2:
                _check_crash(crash_at, "mid_data")
            for seg, _, row, sl in pieces:
                new_files |= self._write_at(self._files(seg)[column], column, row, arr[sl])
        for seg, off, row, sl in pieces:  # a compacted last segment: which ids the rows hold
            ids_file = self._files(seg).get("ids")
            if ids_file is not None:
                offs = np.arange(off, off + sl.stop - sl.start, dtype=_IDS_DTYPE)
                new_files |= self._write_at(ids_file, "ids", row, offs)
        if new_files:
            fsync_dir(self.path)

    def _write_at(self, f: Path, column: str, row: int, arr: npt.NDArray[Any]) -> bool:
        """Positional write of ``arr`` at row ``row`` of a column file, fsynced; returns
        whether the file is new. Bytes beyond the committed rows (a failed attempt, a
        truncated tail) are uncommitted and are not cut here: a reader process may map
        them (see ``_recover``)."""
        new = not f.exists()
        with open(f, "w+b" if new else "r+b") as fh:
            fh.seek(self._nbytes(column, row))
            fh.write(np.ascontiguousarray(arr).tobytes())
            fh.flush()
            os.fsync(fh.fileno())
        return new

    def truncate(self, n: int) -> None:
        """Drop committed entries with ids >= ``n`` (rolls back an uncommitted batch)."""
        with self.exclusive(), self._write_lock:
            self._check_usable()
            m = self._m
            if not 0 <= n <= m.total:
                raise DatastoreError(f"truncate({n}): store has {m.total} entries")
            if n == m.total:
                return
            cap = m.max_segment_entries
            nseg = -(-n // cap)
            counts, rows = list(m.counts[:nseg]), list(m.rows[:nseg])
            if counts:
                counts[-1] = n - (nseg - 1) * cap
                rows[-1] = counts[-1]
                if m.sparse(nseg - 1):  # rows holding ids below the cut
                    ids = self._segment_maps(nseg - 1)["ids"]
                    rows[-1] = int(np.searchsorted(ids, counts[-1]))
            # live entries cut: only the rows beyond the cut are read
            cut_ids = np.arange(n, m.total, dtype=np.int64)
            cut_live = int(self.live_mask(cut_ids).sum()) if len(cut_ids) else 0
            new = m.changed(
                counts=counts,
                rows=rows,
                names=list(m.names[:nseg]),
                live=m.live - cut_live,
                truncations=[*m.truncations, (m.generation + 1, n)],
            )
            self._commit(new)
            with self._lock:
                self._maps.clear()
                self._recover(cut_tails=False)  # the tail stays until the next writer open
