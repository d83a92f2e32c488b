"""A datastore handle's state and its reads over the committed segments."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from memlm.datastore.layout import (
    _COLUMNS,
    _IDS_DTYPE,
    _KEYS_DTYPE,
    RETIRED,
    TOMBSTONES,
    DatastoreError,
    _dtype,
    _segment_name,
)
from memlm.datastore.manifest import _Manifest


class _Segments:
    """Reads of a datastore handle (``Datastore`` adds the writes); see ``memlm.datastore``."""

    def __init__(self, path: Path, manifest: _Manifest, *, shared: bool = False) -> None:
        self.path = path
        self._m = manifest
        self._shared = shared  # a writer that locks only inside exclusive()
        self._excl = threading.RLock()  # this handle's exclusive() sections, reentrant
        self._excl_depth = 0
        self._excl_fd: int | None = None
        self._write_lock = threading.Lock()  # one writer at a time
        self._lock = threading.RLock()  # guards the manifest snapshot and the maps
        # segment -> ((file name, rows) the maps were made for, the maps)
        self._maps: dict[int, tuple[tuple[str, int], dict[str, np.memmap[Any, Any]]]] = {}
        self._deleted: set[int] = set()  # the tombstones read so far ...
        self._deleted_arr = np.empty(0, dtype=np.int64)  # ... sorted, for np.isin
        self._tombstones_read = 0  # ... which are the log's first this many
        # entry ids consolidation retired (sorted; those a later truncate cut are left
        # out), and how many pairs of the retired log were read
        self._retired_arr = np.empty(0, dtype=np.int64)
        self._retired_pairs = np.empty((0, 2), dtype=np.int64)
        self._retired_read = 0
        self._retired_cuts = 0  # truncations the retired ids were checked against
        self._broken = False
        self._lock_fd: int | None = None  # the writer's flock; None when read-only
        self._closed = False
        self._manifest_stat: tuple[int, int, int] = (0, 0, 0)

    @property
    def readonly(self) -> bool:
        return self._lock_fd is None and not self._shared

    @property
    def shared(self) -> bool:
        return self._shared

    def _files(self, seg: int, name: str | None = None) -> dict[str, Path]:
        """Files of segment ``seg``: its committed ones, a new segment's, or ``name``'s."""
        m = self._m
        if name is None:
            name = m.names[seg] if seg < len(m.names) else _segment_name(seg)
        base = str(self.path / name)
        out = {"keys": Path(base + ".keys")}
        out.update({col: Path(f"{base}.{col}") for col, _ in _COLUMNS})
        if name != _segment_name(seg):  # compacted: which ids the rows hold
            out["ids"] = Path(base + ".ids")
        return out

    def committed_files(self) -> list[tuple[Path, int]]:
        """Each file the manifest commits and its committed length in bytes (segment
        columns, the tombstone log): what a copy of the store must hold. Bytes beyond a
        length are uncommitted."""
        m = self._m
        out = [
            (f, self._nbytes(column, rows))
            for seg, rows in enumerate(m.rows)
            for column, f in self._files(seg).items()
        ]
        if m.tombstones or (self.path / TOMBSTONES).exists():
            out.append((self.path / TOMBSTONES, m.tombstones * 8))
        if m.retired or (self.path / RETIRED).exists():
            out.append((self.path / RETIRED, m.retired * 16))
        return out

    def _nbytes(self, column: str, count: int) -> int:
        if column == "keys":
            return count * self._m.dim * _KEYS_DTYPE.itemsize
        if column == "ids":
            return count * _IDS_DTYPE.itemsize
        return count * dict(_COLUMNS)[column].itemsize

    def _check_usable(self) -> None:
        if self._shared and self._closed:
            raise DatastoreError(f"{self.path}: this handle is closed; reopen the path")
        if self.readonly:
            raise DatastoreError(f"{self.path}: opened read-only")
        if self._broken or self._closed:
            raise DatastoreError(
                f"{self.path}: this handle is closed (or crashed); reopen the path"
            )

    # --- reading ----------------------------------------------------------------------

    @property
    def dim(self) -> int:
        return self._m.dim

    @property
    def max_segment_entries(self) -> int:
        return self._m.max_segment_entries

    @property
    def generation(self) -> int:
        """Counter of committed changes (appends, truncations, deletions)."""
        return self._m.generation

    @property
    def deleted_documents(self) -> frozenset[int]:
        return frozenset(self._deleted)

    @property
    def num_retired(self) -> int:
        """Entries consolidation retired that the store still counts (not cut since)."""
        return int(self._retired_arr.size)

    @property
    def num_deleted_documents(self) -> int:
        return len(self._deleted)

    def is_deleted(self, doc_id: int) -> bool:
        return int(doc_id) in self._deleted

    def snapshot(self) -> tuple[int, int]:
        """(len, generation), read together."""
        with self._lock:
            return self._m.total, self._m.generation

    def unchanged_below(self, generation: int) -> int:
        """Ids below the returned bound name the same entries as at ``generation``.

        Truncations after ``generation`` may have cut entries that later appends replaced
        under the same ids; anything built from an older snapshot must not trust ids at or
        above the smallest such cut. ``sys.maxsize`` when nothing was cut since.
        """
        m = self._m
        return min((n for g, n in m.truncations if g > generation), default=sys.maxsize)

    def __len__(self) -> int:
        """Committed entries, deleted ones included; ids are ``range(len(ds))``."""
        return self._m.total

    def _segment_maps(self, seg: int) -> dict[str, np.memmap[Any, Any]]:
        """Memmaps of segment ``seg``'s committed rows (re-mapped when it changed)."""
        m = self._m
        key = (m.names[seg], m.rows[seg])
        cached = self._maps.get(seg)
        if cached is not None and cached[0] == key:
            return cached[1]
        files = self._files(seg)
        nrows = m.rows[seg]
        maps: dict[str, np.memmap[Any, Any]] = {}
        for column, f in files.items():
            if nrows == 0:  # numpy cannot map an empty file
                maps[column] = np.empty((0, m.dim) if column == "keys" else (0,), _dtype(column))  # type: ignore[assignment]
                continue
            shape = (nrows, m.dim) if column == "keys" else (nrows,)
            maps[column] = np.memmap(f, _dtype(column), "r", shape=shape)
        self._maps[seg] = (key, maps)
        return maps

    def _rows_of(self, seg: int, offs: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Row of each in-segment id offset; -1 where a compaction removed it."""
        if not self._m.sparse(seg):
            return offs
        ids = self._segment_maps(seg)["ids"]
        if len(ids) == 0:
            return np.full(offs.shape, -1, dtype=np.int64)
        r = np.searchsorted(ids, offs)
        hit = r < len(ids)
        hit[hit] = ids[r[hit]] == offs[hit]
        return np.where(hit, r, -1)

    def _locate(
        self, ids: npt.ArrayLike
    ) -> tuple[
        npt.NDArray[np.int64], list[tuple[int, npt.NDArray[np.intp], npt.NDArray[np.int64]]]
    ]:
        """Checked ids and, per segment, (segment, where in ids, rows; -1 = removed).
        Caller holds ``_lock``."""
        idx = np.asarray(ids)
        if idx.dtype.kind not in "iu" and idx.size:
            raise DatastoreError(f"ids: expected integers, got dtype {idx.dtype}")
        idx = idx.astype(np.int64, copy=False).reshape(-1)
        if idx.size == 0:
            return idx, []
        total, cap = self._m.total, self._m.max_segment_entries
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= total:
            raise DatastoreError(f"ids out of range [0, {total})")
        if lo // cap == hi // cap:  # one segment (the usual case): no grouping
            seg = lo // cap
            return idx, [(seg, np.arange(idx.size), self._rows_of(seg, idx - seg * cap))]
        seg_of = idx // cap
        out = []
        for seg in np.unique(seg_of):
            sel = np.flatnonzero(seg_of == seg)
            out.append((int(seg), sel, self._rows_of(int(seg), idx[sel] - seg * cap)))
        return idx, out

    def _present(self, ids: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """True where the entry still has its row (no compaction removed it)."""
        with self._lock:
            idx, parts = self._locate(ids)
            out = np.ones(idx.shape, dtype=bool)
            for _, sel, rows in parts:
                out[sel] = rows >= 0
            return out

    def _gather(self, column: str, ids: npt.ArrayLike) -> npt.NDArray[Any]:
        with self._lock:
            idx, parts = self._locate(ids)
            shape = (idx.size, self._m.dim) if column == "keys" else (idx.size,)
            out = np.empty(shape, dtype=_dtype(column))
            for seg, sel, rows in parts:
                if (rows < 0).any():
                    gone = int(idx[sel][rows < 0][0])
                    raise DatastoreError(
                        f"entry {gone} was compacted away (its document was forgotten)"
                    )
                # np.take: 1.48x faster than a memmap's fancy indexing (167 against 247 ns
                # per random 576-dim float16 row; bench_index.py --gather)
                src = np.asarray(self._segment_maps(seg)[column])
                if len(parts) == 1:  # one segment, the usual case: no second copy
                    return np.take(src, rows, axis=0)
                out[sel] = np.take(src, rows, axis=0)
            return out

    def keys(self, ids: npt.ArrayLike) -> npt.NDArray[np.float16]:
        """float16 keys of shape (len(ids), dim)."""
        return self._gather("keys", ids)

    def values(self, ids: npt.ArrayLike) -> npt.NDArray[np.int32]:
        """int32 next-token ids."""
        return self._gather("values", ids)

    def provenance(
        self, ids: npt.ArrayLike
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """(doc_ids int64, positions int32, days int32) of the entries."""
        return (
            self._gather("doc_ids", ids),
            self._gather("positions", ids),
            self._gather("days", ids),
        )

    def live_mask(
        self, ids: npt.ArrayLike, hidden: npt.NDArray[np.int64] | None = None
    ) -> npt.NDArray[np.bool_]:
        """True where the entry is present, not retired, and its document is neither
        deleted nor in ``hidden`` (sorted document ids the caller hides too, e.g. forgets
        requested but not yet applied)."""
        with self._lock:
            idx, parts = self._locate(ids)
            doc_ids = np.zeros(idx.shape, dtype=np.int64)
            present = np.ones(idx.shape, dtype=bool)
            for seg, sel, rows in parts:
                ok = rows >= 0
                present[sel] = ok
                doc_ids[sel[ok]] = self._segment_maps(seg)["doc_ids"][rows[ok]]
            deleted = self._deleted_arr
            retired = self._retired_arr
        if retired.size:
            present &= ~np.isin(idx, retired)
        if hidden is not None and len(hidden):
            deleted = np.union1d(deleted, hidden)
        if deleted.size == 0:
            return present
        return present & ~np.isin(doc_ids, deleted)

    def _runs(self, seg: int, a: int, b: int) -> list[tuple[int, int, int]]:
        """(first id offset, first row, length) of the runs of consecutive ids that segment
        ``seg`` holds in offsets [a, b) (caller holds ``_lock``)."""
        if not self._m.sparse(seg):
            return [(a, a, b - a)] if b > a else []
        ids = self._segment_maps(seg)["ids"]
        r0, r1 = (int(x) for x in np.searchsorted(ids, [a, b]))
        if r1 == r0:
            return []
        offs = np.asarray(ids[r0:r1], dtype=np.int64)
        cuts = [0, *(np.flatnonzero(np.diff(offs) != 1) + 1).tolist(), len(offs)]
        return [(int(offs[i]), r0 + i, j - i) for i, j in zip(cuts[:-1], cuts[1:], strict=True)]

    def iter_chunks(
        self, start: int = 0, stop: int | None = None, chunk: int = 65536
    ) -> Iterator[tuple[int, npt.NDArray[np.float16], npt.NDArray[np.int32]]]:
        """Yield (first_id, keys float16 (c, dim), values int32 (c,)) over [start, stop).

        ``stop`` defaults to the length when called; deleted entries are included (use
        ``live_mask``) unless a compaction removed them. Chunks hold consecutive ids and
        never cross a segment boundary or a removed id, so they may be shorter.
        """
        end = len(self) if stop is None else stop
        if not 0 <= start <= end <= len(self) or chunk <= 0:
            raise DatastoreError(f"iter_chunks({start}, {stop}): store has {len(self)} entries")
        cap = self._m.max_segment_entries
        pos = start
        while pos < end:
            seg = pos // cap
            seg_end = min(end, (seg + 1) * cap)
            with self._lock:
                if seg_end > self._m.total:
                    raise DatastoreError(f"truncated to {self._m.total} while iterating")
                runs = self._runs(seg, pos - seg * cap, seg_end - seg * cap)
                name = self._m.names[seg]
            for off, row, length in runs:
                for lo in range(0, length, chunk):
                    take = min(chunk, length - lo)
                    with self._lock:
                        if self._m.total < seg_end:
                            raise DatastoreError(f"truncated to {self._m.total} while iterating")
                        if self._m.names[seg] != name:
                            raise DatastoreError("compacted while iterating")
                        maps = self._segment_maps(seg)
                        keys = np.array(maps["keys"][row + lo : row + lo + take])
                        values = np.array(maps["values"][row + lo : row + lo + take])
                    yield seg * cap + off + lo, keys, values
            pos = seg_end

    def _all_doc_ids(self) -> Iterator[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]]:
        """(ids, document ids) of the rows of each segment."""
        cap = self._m.max_segment_entries
        for seg in range(len(self._m.counts)):
            with self._lock:
                if seg >= len(self._m.counts):
                    return
                maps = self._segment_maps(seg)
                if self._m.sparse(seg):
                    ids = seg * cap + np.asarray(maps["ids"], dtype=np.int64)
                else:
                    ids = seg * cap + np.arange(self._m.rows[seg], dtype=np.int64)
                yield ids, np.array(maps["doc_ids"])

    def entries_of_document(self, doc_id: int) -> npt.NDArray[np.int64]:
        """Global ids (ascending) of the committed entries of ``doc_id``, deleted or not
        (not those a compaction removed)."""
        found = [ids[d == doc_id] for ids, d in self._all_doc_ids()]
        return np.concatenate(found) if found else np.empty(0, dtype=np.int64)

    @property
    def num_live(self) -> int:
        """Committed entries whose document is not deleted (kept in the manifest)."""
        return self._m.live

    @property
    def bytes_reclaimed(self) -> int:
        """Data-file bytes that compactions removed, over the store's life."""
        return self._m.reclaimed_bytes

    def stats(self) -> dict[str, int]:
        """entries, live_entries, deleted_documents, bytes_on_disk, bytes_reclaimed, dim,
        segments, rows (entries still on disk: compactions remove deleted ones)."""
        size = sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())
        with self._lock:
            m = self._m
            return {
                "entries": m.total,
                "live_entries": m.live,
                "deleted_documents": len(self._deleted),
                "retired_entries": int(self._retired_arr.size),
                "bytes_on_disk": size,
                "bytes_reclaimed": m.reclaimed_bytes,
                "dim": m.dim,
                "segments": len(m.counts),
                "rows": sum(m.rows),
            }

    def close(self) -> None:
        """Drop the memory maps and release the writer lock (writes then raise)."""
        with self._lock:
            self._maps.clear()
        if self._shared:
            self._closed = True
        if self._lock_fd is not None and not self._closed:
            self._closed = True
            os.close(self._lock_fd)

    def __del__(self) -> None:
        # Release the writer lock when the handle is dropped without close().
        if getattr(self, "_lock_fd", None) is not None:
            self.close()
