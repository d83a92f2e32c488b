"""Append-only on-disk kNN-LM datastore: float16 keys, int32 values and provenance.

Layout of a datastore directory::

    manifest.json            the only source of truth (see ``_Manifest``)
    LOCK                     flock held by the single writer process
    seg-000000.keys          float16 (count, dim), raw C order
    seg-000000.values        int32 (count,)     next-token ids
    seg-000000.doc_ids       int64 (count,)     provenance: document id
    seg-000000.positions     int32 (count,)     provenance: token position in the document
    seg-000000.days          int32 (count,)     provenance: day (e.g. days since 1970-01-01)
    seg-000001.*             ...

Every segment but the last covers exactly ``max_segment_entries`` ids, so a global
entry id maps to ``(id // max_segment_entries, id % max_segment_entries)``. Ids are
stable for the life of the store: compaction removes rows but never renumbers.

Deletion and compaction (forget)::

    tombstones               int64 (n,)  deleted document ids, an append-only log
    seg-000003-c000042.*     a compacted segment (written at generation 42) ...
    seg-000003-c000042.ids   int32 (rows,) ... with the in-segment offsets of its rows

``delete_document`` appends one id to the tombstone log and commits the new log length
in the manifest: a commit costs the same whatever the number of deleted documents, and
the manifest keeps the count of live entries, updated by each change from the rows it
touched only (an append's batch, a truncation's cut, a deleted document's entries).
``compact`` rewrites every segment holding rows of deleted documents without them, under
new file names, then commits the manifest that names the new files, then unlinks the old
ones (see :meth:`Datastore.compact` for why ids stay stable and how a crash is safe).
A compacted segment keeps its ids: its ``.ids`` column says which ids it still holds,
and an id it no longer holds reads as absent (``live_mask`` False; reading its key or
value is an error). New entries may still be appended to a compacted last segment.

Crash safety (single writer): an append writes the data files at the committed offsets,
fsyncs them, and only then replaces ``manifest.json`` (temp file + fsync + ``os.replace``
+ fsync of the directory). Whatever the manifest does not cover is uncommitted: the
writer's ``open`` cuts file tails beyond the committed counts and removes segment files
it does not list.

Reads go through ``np.memmap`` views of the committed prefix of each segment and always
return copies. Other processes open the store ``readonly=True`` and ``reload()`` the
manifest to see new commits; so that their maps stay valid, an open store never shrinks
a file (``truncate`` leaves the tail for the next writer ``open`` to cut).

Several writer processes (ingest workers sharing a data directory) open the store
``shared=True``: such a handle takes the ``LOCK`` only inside ``exclusive()``, where it
first reloads the manifest, so appends from different processes follow one another and
each starts at the committed end. A shared writer leaves file tails alone, as readers
do, and an exclusive writer (the default) keeps the others out for its whole life.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

MANIFEST = "manifest.json"
LOCK = "LOCK"  # flock of the writer (for its life, or a shared writer's exclusive())
TOMBSTONES = "tombstones"  # int64 log of deleted document ids; the manifest commits its length
FORMAT = "memlm-datastore"
# 2: tombstone log, live count, compacted segments. A v1 manifest (deleted documents
# listed inline) is read, and the first writer open rewrites it as v2.
FORMAT_VERSION = 2
# 1M entries per segment: 1.1 GB of keys at d=576, small enough to copy or rsync one file
# at a time, large enough that a 10M-entry store has only 10 segments (50 files).
DEFAULT_MAX_SEGMENT_ENTRIES = 1_000_000

# Names of the points where ``append(crash_at=...)`` raises ``SimulatedCrash``, in order.
CRASH_POINTS = (
    "before_data",  # nothing written yet
    "mid_data",  # keys and values written, provenance not yet
    "after_data",  # all data files written and fsynced, manifest untouched
    "before_manifest",  # new manifest in its temp file, not yet renamed
    "after_manifest",  # manifest renamed: the append is committed, directory not fsynced
)
# Where ``compact(crash_at=...)`` raises ``SimulatedCrash``, in order.
COMPACT_CRASH_POINTS = (
    "mid_files",  # the first rewritten segment's files written, the others not yet
    "after_files",  # every new file written and fsynced, manifest untouched
    "before_manifest",  # new manifest in its temp file, not yet renamed
    "after_manifest",  # committed: the new files are served, the old ones not yet unlinked
)
# Where ``delete_document(crash_at=...)`` raises ``SimulatedCrash``.
DELETE_CRASH_POINTS = (
    "after_log",  # the id written to the tombstone log, manifest untouched
    "before_manifest",
    "after_manifest",
)
# Rows copied per step of a compaction: 64k keys at d=576 is 72 MB of float16.
_COMPACT_CHUNK = 65536

# (suffix, dtype) of the per-entry columns; keys are handled apart because of their width.
_COLUMNS: tuple[tuple[str, np.dtype[Any]], ...] = (
    ("values", np.dtype(np.int32)),
    ("doc_ids", np.dtype(np.int64)),
    ("positions", np.dtype(np.int32)),
    ("days", np.dtype(np.int32)),
)
_KEYS_DTYPE = np.dtype(np.float16)
_IDS_DTYPE = np.dtype(np.int32)  # a compacted segment's in-segment offsets (< 2**31)


class DatastoreError(ValueError):
    """Bad input to the datastore, or a datastore directory that is not valid."""


class SimulatedCrash(RuntimeError):
    """Raised at a ``crash_at`` point to simulate the process dying there."""


def _check_crash(crash_at: str | None, point: str) -> None:
    if crash_at == point:
        raise SimulatedCrash(point)


def fsync_dir(path: Path) -> None:
    """Make the directory entries of ``path`` (renames, new files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str, *, crash_at: str | None = None) -> None:
    """Write ``text`` to ``path`` via temp file + fsync + os.replace + directory fsync.

    With ``crash_at`` set (tests only), raise ``SimulatedCrash(crash_at)`` once the temp
    file is durable, before the rename.
    """
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    if crash_at is not None:
        raise SimulatedCrash(crash_at)
    os.replace(tmp, path)
    fsync_dir(path.parent)


@dataclass
class _Manifest:
    dim: int
    max_segment_entries: int
    counts: list[int] = field(default_factory=list)  # committed ids per segment
    # rows on disk per segment (== counts[i] until a compaction removes some) and the base
    # name of its files: _segment_name(i) while dense, with a "-c<generation>" suffix (and
    # an ids column) once compacted
    rows: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    tombstones: int = 0  # committed length of the tombstone log
    live: int = 0  # committed entries whose document is not deleted
    reclaimed_bytes: int = 0  # data-file bytes removed by compactions, cumulative
    generation: int = 0  # +1 for every committed change
    # (generation, n) for every truncate: lets an index built at an older generation
    # know which of its ids now name different entries (see ``unchanged_below``).
    truncations: list[tuple[int, int]] = field(default_factory=list)
    legacy_deleted: list[int] | None = None  # a v1 manifest's inline deleted documents

    @property
    def total(self) -> int:
        return sum(self.counts)

    def sparse(self, seg: int) -> bool:
        return self.names[seg] != _segment_name(seg)

    def changed(self, **kw: Any) -> _Manifest:
        """A copy with ``kw`` replaced and the generation advanced (lists copied)."""
        out = _Manifest(
            dim=self.dim,
            max_segment_entries=self.max_segment_entries,
            counts=list(self.counts),
            rows=list(self.rows),
            names=list(self.names),
            tombstones=self.tombstones,
            live=self.live,
            reclaimed_bytes=self.reclaimed_bytes,
            generation=self.generation + 1,
            truncations=list(self.truncations),
        )
        for k, v in kw.items():
            setattr(out, k, v)
        return out

    def to_json(self) -> str:
        assert self.legacy_deleted is None, "a v1 manifest is rewritten before any commit"
        return json.dumps(
            {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "dim": self.dim,
                "max_segment_entries": self.max_segment_entries,
                "generation": self.generation,
                "segments": [
                    {"name": _segment_name(i), "entries": c, "rows": r, "files": f}
                    for i, (c, r, f) in enumerate(
                        zip(self.counts, self.rows, self.names, strict=True)
                    )
                ],
                "tombstones": self.tombstones,
                "live_entries": self.live,
                "reclaimed_bytes": self.reclaimed_bytes,
                "truncations": [list(t) for t in self.truncations],
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str, where: Path) -> _Manifest:
        try:
            raw = json.loads(text)
            version = raw.get("format_version")
            if raw.get("format") != FORMAT or version not in (1, FORMAT_VERSION):
                raise DatastoreError(f"{where}: not a {FORMAT} v1/v{FORMAT_VERSION} manifest")
            segs = raw["segments"]
            counts = [int(s["entries"]) for s in segs]
            m = cls(
                dim=int(raw["dim"]),
                max_segment_entries=int(raw["max_segment_entries"]),
                counts=counts,
                rows=[int(s.get("rows", c)) for s, c in zip(segs, counts, strict=True)],
                names=[str(s.get("files", s["name"])) for s in segs],
                generation=int(raw["generation"]),
                truncations=[(int(g), int(n)) for g, n in raw["truncations"]],
            )
            if version == 1:
                m.legacy_deleted = sorted({int(d) for d in raw["deleted_documents"]})
            else:
                m.tombstones = int(raw["tombstones"])
                m.live = int(raw["live_entries"])
                m.reclaimed_bytes = int(raw["reclaimed_bytes"])
            names = [s["name"] for s in segs]
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, DatastoreError):
                raise
            raise DatastoreError(f"{where}: malformed manifest: {exc}") from exc
        if names != [_segment_name(i) for i in range(len(names))]:
            raise DatastoreError(f"{where}: segment names out of order: {names}")
        cap = m.max_segment_entries
        if any(c != cap for c in m.counts[:-1]) or any(not 0 <= c <= cap for c in m.counts):
            raise DatastoreError(f"{where}: segment counts {m.counts} break the layout")
        bad_rows = any(
            not 0 <= r <= c or (r != c and not m.sparse(i))
            for i, (c, r) in enumerate(zip(m.counts, m.rows, strict=True))
        )
        if bad_rows or any(not f.startswith(_segment_name(i)) for i, f in enumerate(m.names)):
            raise DatastoreError(f"{where}: segment rows {m.rows} or files {m.names} are invalid")
        return m


def _take_writer_lock(path: Path, *, wait: bool = False) -> int:
    """Exclusive flock on ``path/LOCK``; returns the fd (a raw fd: a file object that a
    dropped handle leaves to the garbage collector would raise a ResourceWarning).

    ``wait``: block until the holder releases it (shared writers take turns)."""
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DatastoreError(
            f"{path}: another writer holds {LOCK}; open with readonly=True to read"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _stat_key(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_ino, st.st_mtime_ns, st.st_size


def _segment_name(i: int) -> str:
    return f"seg-{i:06d}"


def _dtype(column: str) -> np.dtype[Any]:
    if column == "keys":
        return _KEYS_DTYPE
    return _IDS_DTYPE if column == "ids" else dict(_COLUMNS)[column]


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


@dataclass(frozen=True)
class Compaction:
    """What one :meth:`Datastore.compact` did."""

    segments: int  # segments rewritten
    rows_removed: int  # rows of deleted documents that left the disk
    bytes_reclaimed: int  # data-file bytes freed (old files minus their rewrites)


class Datastore:
    """An append-only kNN-LM datastore in a directory; see the module docstring.

    One process writes (``append``, ``truncate``, ``delete_document``, ``compact``); reads
    may run from other threads at the same time. Open a datastore with :meth:`open`.
    """

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
        self._broken = False
        self._lock_fd: int | None = None  # the writer's flock; None when read-only
        self._closed = False
        self._manifest_stat: tuple[int, int, int] = (0, 0, 0)

    # --- opening and recovery ----------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        dim: int | None = None,
        *,
        max_segment_entries: int = DEFAULT_MAX_SEGMENT_ENTRIES,
        readonly: bool = False,
        shared: bool = False,
    ) -> Datastore:
        """Open the datastore at ``path``, creating it when missing (``dim`` required then).

        The writer (default) takes an exclusive lock on ``path/LOCK`` for the object's
        lifetime (``close()`` releases it), checks ``dim`` and removes uncommitted work
        left by a crash. ``readonly=True`` (for another process, e.g. the API server)
        takes no lock, changes nothing, and sees the writer's commits after ``reload()``.
        ``shared=True`` opens a writer that holds the lock only inside ``exclusive()``
        (and while opening), so several processes can write in turn.
        ``max_segment_entries`` only applies at creation; an existing store keeps its own.
        """
        if readonly and shared:
            raise ValueError("a datastore handle is read-only or a shared writer, not both")
        p = Path(path)
        mpath = p / MANIFEST
        lock = None
        if not readonly:
            p.mkdir(parents=True, exist_ok=True)
            lock = _take_writer_lock(p, wait=shared)
        try:
            if not mpath.exists():
                if readonly or dim is None:
                    why = "read-only open" if readonly else "no dim given to create one"
                    raise DatastoreError(f"{p}: no datastore there and {why}")
                if dim <= 0 or max_segment_entries <= 0:
                    raise DatastoreError("dim and max_segment_entries must be positive")
                m = _Manifest(dim=int(dim), max_segment_entries=int(max_segment_entries))
                atomic_write_text(mpath, m.to_json())
            else:
                m = _Manifest.from_json(mpath.read_text(encoding="utf-8"), mpath)
                if dim is not None and dim != m.dim:
                    raise DatastoreError(f"{p}: datastore has dim {m.dim}, caller expects {dim}")
        except BaseException:
            if lock is not None:
                os.close(lock)
            raise
        ds = cls(p, m, shared=shared)
        ds._manifest_stat = _stat_key(mpath)
        if shared:
            assert lock is not None
            try:  # under the lock: no other writer is half-way through an append
                ds._recover(cut_tails=False)
                ds._read_tombstones()
                ds._upgrade_v1()
            finally:
                os.close(lock)
            return ds
        ds._lock_fd = lock  # from here on, ds.close() releases the lock
        try:
            if not readonly:
                ds._recover(cut_tails=True)
            ds._read_tombstones()
            if not readonly:
                ds._upgrade_v1()
        except BaseException:
            ds.close()
            raise
        return ds

    def _upgrade_v1(self) -> None:
        """Rewrite a v1 manifest (deleted documents inline) as v2: the tombstone log and
        the live count. Writers only, under the lock, before any other commit."""
        m = self._m
        if m.legacy_deleted is None:
            return
        self._write_tombstones(0, np.array(m.legacy_deleted, dtype=np.int64))
        new = m.changed(tombstones=len(m.legacy_deleted), live=m.live)
        self._commit(new)

    @property
    def readonly(self) -> bool:
        return self._lock_fd is None and not self._shared

    @property
    def shared(self) -> bool:
        return self._shared

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the store's write lock for the block (reentrant; threads take turns).

        A shared writer reloads the manifest on entry, so its writes follow every commit
        other processes made; a caller that commits its own bookkeeping inside the block
        (the ingest worker's database transaction) makes it atomic with the append for
        every other writer. The exclusive writer holds the lock anyway: a no-op.
        """
        if not self._shared:
            self._check_usable()
            yield
            return
        with self._excl:
            if self._excl_depth == 0:
                self._check_usable()
                self._excl_fd = _take_writer_lock(self.path, wait=True)
                try:
                    self._reload_manifest()
                except BaseException:
                    self._release_exclusive()
                    raise
            self._excl_depth += 1
            try:
                yield
            finally:
                self._excl_depth -= 1
                if self._excl_depth == 0:
                    self._release_exclusive()

    def _release_exclusive(self) -> None:
        if self._excl_fd is not None:
            os.close(self._excl_fd)  # closing the only fd of the description drops the flock
            self._excl_fd = None

    def reload(self) -> bool:
        """Pick up the latest commit of other processes; returns whether it changed.

        Read-only and shared handles; a no-op on the exclusive writer's handle, whose
        state is always current.
        """
        if not (self.readonly or self._shared):
            return False
        return self._reload_manifest()

    def _reload_manifest(self) -> bool:
        mpath = self.path / MANIFEST
        key = _stat_key(mpath)
        if key == self._manifest_stat:
            return False
        new = _Manifest.from_json(mpath.read_text(encoding="utf-8"), mpath)
        with self._lock:
            if new.truncations != self._m.truncations or new.names != self._m.names:
                # A truncate may have dropped and re-created segment files, a compaction
                # replaced some: map them anew.
                self._maps.clear()
            self._m = new
            self._read_tombstones()
            self._manifest_stat = key
        return True

    def _read_tombstones(self) -> None:
        """Bring the deleted set up to the committed log, reading only the new ids."""
        m = self._m
        if m.legacy_deleted is not None:  # v1: inline, and no live count on disk
            self._deleted = set(m.legacy_deleted)
            self._deleted_arr = np.array(m.legacy_deleted, dtype=np.int64)
            dead = sum(int(np.isin(d, self._deleted_arr).sum()) for _, d in self._all_doc_ids())
            m.live = m.total - dead
            return
        start, stop = self._tombstones_read, m.tombstones
        if stop == start:
            return
        if stop < start:
            raise DatastoreError(f"{self.path}: the tombstone log shrank ({start} -> {stop})")
        with open(self.path / TOMBSTONES, "rb") as f:
            f.seek(start * 8)
            new = np.frombuffer(f.read((stop - start) * 8), dtype=np.int64)
        if len(new) != stop - start:
            raise DatastoreError(f"{self.path / TOMBSTONES}: shorter than the manifest commits")
        self._deleted.update(new.tolist())
        self._deleted_arr = np.union1d(self._deleted_arr, new)
        self._tombstones_read = stop

    def _write_tombstones(self, start: int, ids: npt.NDArray[np.int64]) -> None:
        """Write ``ids`` at position ``start`` of the log, durably (uncommitted until the
        manifest says so: bytes beyond its count are cut by the next writer open)."""
        f = self.path / TOMBSTONES
        new_file = not f.exists()
        with open(f, "r+b" if not new_file else "w+b") as fh:
            fh.seek(start * 8)
            fh.write(np.ascontiguousarray(ids, dtype=np.int64).tobytes())
            fh.flush()
            os.fsync(fh.fileno())
        if new_file:
            fsync_dir(self.path)

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

    def _nbytes(self, column: str, count: int) -> int:
        if column == "keys":
            return count * self._m.dim * _KEYS_DTYPE.itemsize
        if column == "ids":
            return count * _IDS_DTYPE.itemsize
        return count * dict(_COLUMNS)[column].itemsize

    def _recover(self, *, cut_tails: bool) -> None:
        """Check sizes, drop files the manifest does not list and (``cut_tails``) cut file
        tails beyond it.

        Only the opening writer cuts tails: a reader in another process may still map
        the tail of a segment that ``truncate`` shortened, and shrinking a mapped file
        kills that reader with SIGBUS. Unlinking a mapped file is safe. Unlisted files
        include a crashed compaction's new files and a finished one's old files.
        """
        listed: set[str] = set()
        changed = False
        wanted = [
            (f, self._nbytes(column, rows))
            for seg, rows in enumerate(self._m.rows)
            for column, f in self._files(seg).items()
        ]
        if self._m.tombstones or (self.path / TOMBSTONES).exists():
            wanted.append((self.path / TOMBSTONES, self._m.tombstones * 8))
        for f, want in wanted:
            listed.add(f.name)
            have = f.stat().st_size if f.exists() else -1
            if have < want:
                raise DatastoreError(
                    f"{f}: {have} bytes on disk, manifest commits {want}: data lost"
                )
            if have > want and cut_tails:
                os.truncate(f, want)
                changed = True
        for f in self.path.iterdir():
            uncommitted = f.name.startswith("seg-") and f.name not in listed
            if uncommitted or f.name == MANIFEST + ".tmp":
                f.unlink()
                changed = True
        if changed:
            fsync_dir(self.path)

    # --- writing ----------------------------------------------------------------------

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
        _check_crash(crash_at, "after_data")
        names_now = list(m.names) + [_segment_name(i) for i in range(len(m.names), len(counts))]
        dead = int(np.isin(cols[1], self._deleted_arr).sum()) if self._deleted else 0
        new = m.changed(counts=counts, rows=rows, names=names_now, live=m.live + n - dead)
        self._commit(new, crash_at)
        return range(start, start + n)

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

    def _commit(self, new: _Manifest, crash_at: str | None = None) -> None:
        mpath = self.path / MANIFEST
        tmp = mpath.with_name(MANIFEST + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(new.to_json())
            f.flush()
            os.fsync(f.fileno())
        _check_crash(crash_at, "before_manifest")
        os.replace(tmp, mpath)
        _check_crash(crash_at, "after_manifest")
        with self._lock:
            if new.names != self._m.names:
                self._maps.clear()
            self._m = new
            self._read_tombstones()
            self._manifest_stat = _stat_key(mpath)  # our own commit: nothing to reload
        fsync_dir(self.path)

    def _crashed(self) -> None:
        """A ``crash_at`` point was hit: the "process" died; let a new writer open the path."""
        self._broken = True
        self.close()

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
                hidden = len(self.entries_of_document(doc_id))
            else:
                ids = np.arange(max(0, entries.start), min(entries.stop, m.total), dtype=np.int64)
                present = self._present(ids)
                hidden = int((self._gather("doc_ids", ids[present]) == doc_id).sum())
            try:
                self._write_tombstones(m.tombstones, np.array([doc_id], dtype=np.int64))
                _check_crash(crash_at, "after_log")
                self._commit(m.changed(tombstones=m.tombstones + 1, live=m.live - hidden), crash_at)
            except SimulatedCrash:
                self._crashed()
                raise
            return hidden

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
        if not self._deleted:
            return Compaction(0, 0, 0)
        plan: list[tuple[int, npt.NDArray[np.int64]]] = []  # (segment, rows it keeps)
        for seg, nrows in enumerate(m.rows):
            if nrows:
                doc_ids = self._segment_maps(seg)["doc_ids"]
                dead = np.isin(doc_ids, self._deleted_arr)
                if dead.any():
                    plan.append((seg, np.flatnonzero(~dead)))
        if not plan:
            return Compaction(0, 0, 0)
        gen = m.generation + 1
        rows, names = list(m.rows), list(m.names)
        old_files: list[Path] = []
        freed = removed = 0
        for j, (seg, keep) in enumerate(plan):
            maps = self._segment_maps(seg)
            name = f"{_segment_name(seg)}-c{gen:06d}"
            new_files = self._files(seg, name)
            offs = maps["ids"] if m.sparse(seg) else None
            for column, f in new_files.items():
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
        if idx.min() < 0 or idx.max() >= total:
            raise DatastoreError(f"ids out of range [0, {total})")
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
                out[sel] = self._segment_maps(seg)[column][rows]
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
        """True where the entry is present and its document is neither deleted nor in
        ``hidden`` (sorted document ids the caller hides too, e.g. forgets requested but
        not yet applied)."""
        with self._lock:
            idx, parts = self._locate(ids)
            doc_ids = np.zeros(idx.shape, dtype=np.int64)
            present = np.ones(idx.shape, dtype=bool)
            for seg, sel, rows in parts:
                ok = rows >= 0
                present[sel] = ok
                doc_ids[sel[ok]] = self._segment_maps(seg)["doc_ids"][rows[ok]]
            deleted = self._deleted_arr
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

    def __enter__(self) -> Datastore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Datastore({str(self.path)!r}, entries={len(self)}, dim={self.dim})"
