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

Every segment but the last holds exactly ``max_segment_entries`` entries, so a global
entry id maps to ``(id // max_segment_entries, id % max_segment_entries)``.

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
FORMAT = "memlm-datastore"
FORMAT_VERSION = 1
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

# (suffix, dtype) of the per-entry columns; keys are handled apart because of their width.
_COLUMNS: tuple[tuple[str, np.dtype[Any]], ...] = (
    ("values", np.dtype(np.int32)),
    ("doc_ids", np.dtype(np.int64)),
    ("positions", np.dtype(np.int32)),
    ("days", np.dtype(np.int32)),
)
_KEYS_DTYPE = np.dtype(np.float16)


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
    counts: list[int] = field(default_factory=list)  # committed entries per segment
    deleted: set[int] = field(default_factory=set)  # deleted document ids
    generation: int = 0  # +1 for every committed change
    # (generation, n) for every truncate: lets an index built at an older generation
    # know which of its ids now name different entries (see ``unchanged_below``).
    truncations: list[tuple[int, int]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.counts)

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "dim": self.dim,
                "max_segment_entries": self.max_segment_entries,
                "generation": self.generation,
                "segments": [
                    {"name": _segment_name(i), "entries": c} for i, c in enumerate(self.counts)
                ],
                "deleted_documents": sorted(self.deleted),
                "truncations": [list(t) for t in self.truncations],
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str, where: Path) -> _Manifest:
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT or raw.get("format_version") != FORMAT_VERSION:
                raise DatastoreError(f"{where}: not a {FORMAT} v{FORMAT_VERSION} manifest")
            m = cls(
                dim=int(raw["dim"]),
                max_segment_entries=int(raw["max_segment_entries"]),
                counts=[int(s["entries"]) for s in raw["segments"]],
                deleted={int(d) for d in raw["deleted_documents"]},
                generation=int(raw["generation"]),
                truncations=[(int(g), int(n)) for g, n in raw["truncations"]],
            )
            names = [s["name"] for s in raw["segments"]]
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, DatastoreError):
                raise
            raise DatastoreError(f"{where}: malformed manifest: {exc}") from exc
        if names != [_segment_name(i) for i in range(len(names))]:
            raise DatastoreError(f"{where}: segment names out of order: {names}")
        cap = m.max_segment_entries
        if any(c != cap for c in m.counts[:-1]) or any(not 0 <= c <= cap for c in m.counts):
            raise DatastoreError(f"{where}: segment counts {m.counts} break the layout")
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


class Datastore:
    """An append-only kNN-LM datastore in a directory; see the module docstring.

    One process writes (``append``, ``truncate``, ``delete_document``); reads may run
    from other threads at the same time. Open a datastore with :meth:`open`.
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
        self._maps: dict[int, tuple[int, dict[str, np.memmap[Any, Any]]]] = {}
        self._deleted_arr = np.array(sorted(manifest.deleted), dtype=np.int64)
        self._live_cache: tuple[int, int, int] | None = None  # (total, generation, live)
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
            finally:
                os.close(lock)
            return ds
        ds._lock_fd = lock  # from here on, ds.close() releases the lock
        if not readonly:
            try:
                ds._recover(cut_tails=True)
            except BaseException:
                ds.close()
                raise
        return ds

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
            if new.truncations != self._m.truncations:
                # A truncate may have dropped and re-created segment files: map them anew.
                self._maps.clear()
            self._m = new
            self._deleted_arr = np.array(sorted(new.deleted), dtype=np.int64)
            self._manifest_stat = key
        return True

    def _files(self, seg: int) -> dict[str, Path]:
        base = self.path / _segment_name(seg)
        out = {"keys": base.with_suffix(".keys")}
        out.update({name: base.with_suffix("." + name) for name, _ in _COLUMNS})
        return out

    def _nbytes(self, column: str, count: int) -> int:
        if column == "keys":
            return count * self._m.dim * _KEYS_DTYPE.itemsize
        return count * dict(_COLUMNS)[column].itemsize

    def _recover(self, *, cut_tails: bool) -> None:
        """Check sizes, drop files the manifest does not list and (``cut_tails``) cut file
        tails beyond it.

        Only the opening writer cuts tails: a reader in another process may still map
        the tail of a segment that ``truncate`` shortened, and shrinking a mapped file
        kills that reader with SIGBUS. Unlinking a mapped file is safe.
        """
        listed: set[str] = set()
        changed = False
        for seg, count in enumerate(self._m.counts):
            for column, f in self._files(seg).items():
                listed.add(f.name)
                want = self._nbytes(column, count)
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
                self._broken = True  # the "process" died: let a new writer open the path
                self.close()
                raise

    def _append_locked(
        self, k16: npt.NDArray[np.float16], cols: list[npt.NDArray[Any]], crash_at: str | None
    ) -> range:
        m = self._m
        start, n, cap = m.total, k16.shape[0], m.max_segment_entries
        counts = list(m.counts)
        # Plan (segment, offset in segment, slice of the batch) pieces.
        pieces: list[tuple[int, int, slice]] = []
        done = 0
        while done < n:
            if not counts or counts[-1] == cap:
                counts.append(0)
            seg, off = len(counts) - 1, counts[-1]
            take = min(cap - off, n - done)
            pieces.append((seg, off, slice(done, done + take)))
            counts[-1] += take
            done += take
        _check_crash(crash_at, "before_data")
        new_files = False
        names = ["keys"] + [name for name, _ in _COLUMNS]
        arrays = [k16, *cols]
        for i, (column, arr) in enumerate(zip(names, arrays, strict=True)):
            if i == 2:
                _check_crash(crash_at, "mid_data")
            for seg, off, sl in pieces:
                f = self._files(seg)[column]
                new_files |= not f.exists()
                # Positional write at the committed offset. Bytes beyond it (a failed
                # attempt, a truncated tail) are uncommitted and are not cut here: a
                # reader process may map them (see ``_recover``).
                with open(f, "r+b" if f.exists() else "w+b") as fh:
                    fh.seek(self._nbytes(column, off))
                    fh.write(arr[sl].tobytes())
                    fh.flush()
                    os.fsync(fh.fileno())
        if new_files:
            fsync_dir(self.path)
        _check_crash(crash_at, "after_data")
        new = _Manifest(
            dim=m.dim,
            max_segment_entries=cap,
            counts=counts,
            deleted=set(m.deleted),
            generation=m.generation + 1,
            truncations=list(m.truncations),
        )
        self._commit(new, crash_at)
        return range(start, start + n)

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
            self._m = new
            self._deleted_arr = np.array(sorted(new.deleted), dtype=np.int64)
            self._manifest_stat = _stat_key(mpath)  # our own commit: nothing to reload
        fsync_dir(self.path)

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
            counts = list(m.counts[:nseg])
            if counts:
                counts[-1] = n - (nseg - 1) * cap
            new = _Manifest(
                dim=m.dim,
                max_segment_entries=cap,
                counts=counts,
                deleted=set(m.deleted),
                generation=m.generation + 1,
                truncations=[*m.truncations, (m.generation + 1, n)],
            )
            self._commit(new)
            with self._lock:
                self._maps.clear()
                self._recover(cut_tails=False)  # the tail stays until the next writer open

    def delete_document(self, doc_id: int) -> int:
        """Hide every entry of ``doc_id`` (also ones appended later); returns how many
        committed entries this newly hid (0 when already deleted)."""
        doc_id = int(doc_id)
        with self.exclusive(), self._write_lock:
            self._check_usable()
            m = self._m
            if doc_id in m.deleted:
                return 0
            hidden = len(self.entries_of_document(doc_id))
            new = _Manifest(
                dim=m.dim,
                max_segment_entries=m.max_segment_entries,
                counts=list(m.counts),
                deleted=m.deleted | {doc_id},
                generation=m.generation + 1,
                truncations=list(m.truncations),
            )
            self._commit(new)
            return hidden

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
        return frozenset(self._m.deleted)

    @property
    def num_deleted_documents(self) -> int:
        return len(self._m.deleted)

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
        """Memmaps of segment ``seg``'s committed prefix (re-mapped when it grew)."""
        count = self._m.counts[seg]
        cached = self._maps.get(seg)
        if cached is not None and cached[0] == count:
            return cached[1]
        files = self._files(seg)
        maps: dict[str, np.memmap[Any, Any]] = {
            "keys": np.memmap(files["keys"], _KEYS_DTYPE, "r", shape=(count, self._m.dim))
        }
        for name, dtype in _COLUMNS:
            maps[name] = np.memmap(files[name], dtype, "r", shape=(count,))
        self._maps[seg] = (count, maps)
        return maps

    def _gather(self, column: str, ids: npt.ArrayLike) -> npt.NDArray[Any]:
        idx = np.asarray(ids)
        if idx.dtype.kind not in "iu" and idx.size:
            raise DatastoreError(f"ids: expected integers, got dtype {idx.dtype}")
        idx = idx.astype(np.int64, copy=False).reshape(-1)
        dtype = _KEYS_DTYPE if column == "keys" else dict(_COLUMNS)[column]
        with self._lock:
            total, dim, cap = self._m.total, self._m.dim, self._m.max_segment_entries
            shape = (idx.size, dim) if column == "keys" else (idx.size,)
            out = np.empty(shape, dtype=dtype)
            if idx.size == 0:
                return out
            if idx.min() < 0 or idx.max() >= total:
                raise DatastoreError(f"ids out of range [0, {total})")
            seg_of = idx // cap
            for seg in np.unique(seg_of):
                sel = np.flatnonzero(seg_of == seg)
                out[sel] = self._segment_maps(int(seg))[column][idx[sel] - seg * cap]
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

    def live_mask(self, ids: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """True where the entry's document is not deleted."""
        deleted = self._deleted_arr
        doc_ids = self._gather("doc_ids", ids)
        if deleted.size == 0:
            return np.ones(doc_ids.shape, dtype=bool)
        return ~np.isin(doc_ids, deleted)

    def _read_range(self, column: str, start: int, stop: int) -> npt.NDArray[Any]:
        """Copy of ``column`` for ids [start, stop) (caller holds ``_lock``)."""
        cap = self._m.max_segment_entries
        parts = []
        pos = start
        while pos < stop:
            seg, off = divmod(pos, cap)
            take = min(cap - off, stop - pos)
            parts.append(np.array(self._segment_maps(seg)[column][off : off + take]))
            pos += take
        if not parts:
            dtype = _KEYS_DTYPE if column == "keys" else dict(_COLUMNS)[column]
            return np.empty((0, self._m.dim) if column == "keys" else (0,), dtype=dtype)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def iter_chunks(
        self, start: int = 0, stop: int | None = None, chunk: int = 65536
    ) -> Iterator[tuple[int, npt.NDArray[np.float16], npt.NDArray[np.int32]]]:
        """Yield (first_id, keys float16 (c, dim), values int32 (c,)) over [start, stop).

        ``stop`` defaults to the length when called; deleted entries are included (use
        ``live_mask``). Chunks never cross a segment boundary, so they may be shorter.
        """
        end = len(self) if stop is None else stop
        if not 0 <= start <= end <= len(self) or chunk <= 0:
            raise DatastoreError(f"iter_chunks({start}, {stop}): store has {len(self)} entries")
        cap = self._m.max_segment_entries
        pos = start
        while pos < end:
            nxt = min(end, pos + chunk, (pos // cap + 1) * cap)
            with self._lock:
                if nxt > self._m.total:
                    raise DatastoreError(f"truncated to {self._m.total} while iterating")
                keys = self._read_range("keys", pos, nxt)
                values = self._read_range("values", pos, nxt)
            yield pos, keys, values
            pos = nxt

    def _all_doc_ids(self) -> Iterator[tuple[int, npt.NDArray[np.int64]]]:
        cap = self._m.max_segment_entries
        for seg in range(len(self._m.counts)):
            with self._lock:
                if seg >= len(self._m.counts):
                    return
                yield seg * cap, np.array(self._segment_maps(seg)["doc_ids"])

    def entries_of_document(self, doc_id: int) -> npt.NDArray[np.int64]:
        """Global ids (ascending) of the committed entries of ``doc_id``, deleted or not."""
        found = [first + np.flatnonzero(d == doc_id) for first, d in self._all_doc_ids()]
        return np.concatenate(found) if found else np.empty(0, dtype=np.int64)

    @property
    def num_live(self) -> int:
        """Committed entries whose document is not deleted."""
        total, gen = self.snapshot()
        if self._live_cache is not None and self._live_cache[:2] == (total, gen):
            return self._live_cache[2]
        deleted = self._deleted_arr
        dead = 0
        if deleted.size:
            dead = sum(int(np.isin(d, deleted).sum()) for _, d in self._all_doc_ids())
        self._live_cache = (total, gen, total - dead)
        return total - dead

    def stats(self) -> dict[str, int]:
        """entries, live_entries, deleted_documents, bytes_on_disk, dim, segments."""
        size = sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())
        return {
            "entries": len(self),
            "live_entries": self.num_live,
            "deleted_documents": len(self._m.deleted),
            "bytes_on_disk": size,
            "dim": self.dim,
            "segments": len(self._m.counts),
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
