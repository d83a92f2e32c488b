"""Committing the manifest, following other processes' commits, recovering a crash."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt

from memlm.datastore.durable import _give_back, _stat_key, _take_writer_lock, fsync_dir
from memlm.datastore.layout import MANIFEST, RETIRED, TOMBSTONES, DatastoreError, _check_crash
from memlm.datastore.manifest import _Manifest
from memlm.datastore.segments import _Segments


class _Recovery(_Segments):
    """The manifest's commits, the shared writers' turns, and recovery at open."""

    def _upgrade_v1(self) -> None:
        """Rewrite a v1 manifest (deleted documents inline) as v2: the tombstone log and
        the live count. Writers only, under the lock, before any other commit."""
        m = self._m
        if m.legacy_deleted is None:
            return
        self._write_tombstones(0, np.array(m.legacy_deleted, dtype=np.int64))
        new = m.changed(tombstones=len(m.legacy_deleted), live=m.live)
        self._commit(new)

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
        # Under the handle's lock from the stat to the swap, as ``_commit`` is: a thread
        # that read an older manifest (the API's poll, a reader's refresh) and swapped it
        # in after another thread of this handle committed a newer one would turn the
        # handle back in time, and a shared writer then appended over committed entries.
        with self._lock:
            key = _stat_key(mpath)
            if key == self._manifest_stat:
                return False
            new = _Manifest.from_json(mpath.read_text(encoding="utf-8"), mpath)
            if new.truncations != self._m.truncations or new.names != self._m.names:
                # A truncate may have dropped and re-created segment files, a compaction
                # replaced some: map them anew.
                self._maps.clear()
            self._m = new
            self._read_tombstones()
            self._manifest_stat = key
        return True

    def _read_tombstones(self) -> None:
        """Bring the deleted set (and the retired entries) up to the committed logs,
        reading only the new ids."""
        self._read_retired()
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

    def _read_retired(self) -> None:
        """Bring the retired entries up to the committed retired log. A pair (id,
        generation) no longer counts once a later truncate cut at or below ``id``: the id
        then names another entry (or none)."""
        m = self._m
        start, stop = self._retired_read, m.retired
        if stop < start:
            raise DatastoreError(f"{self.path}: the retired log shrank ({start} -> {stop})")
        if stop == start and self._retired_cuts == len(m.truncations):
            return
        if stop > start:
            with open(self.path / RETIRED, "rb") as f:
                f.seek(start * 16)
                raw = np.frombuffer(f.read((stop - start) * 16), dtype=np.int64)
            if len(raw) != 2 * (stop - start):
                raise DatastoreError(f"{self.path / RETIRED}: shorter than the manifest commits")
            self._retired_pairs = np.concatenate([self._retired_pairs, raw.reshape(-1, 2)])
            self._retired_read = stop
        ids, gens = self._retired_pairs[:, 0], self._retired_pairs[:, 1]
        valid = np.ones(len(ids), dtype=bool)
        for g, n in m.truncations:
            valid &= ~((gens < g) & (ids >= n))
        self._retired_arr = np.unique(ids[valid])
        self._retired_cuts = len(m.truncations)

    def _write_retired(self, start: int, pairs: npt.NDArray[np.int64]) -> None:
        """Write (id, generation) pairs at pair ``start`` of the retired log, durably
        (uncommitted until the manifest says so)."""
        self._write_log(self.path / RETIRED, start * 16, pairs)

    def _write_tombstones(self, start: int, ids: npt.NDArray[np.int64]) -> None:
        """Write ``ids`` at position ``start`` of the log, durably (uncommitted until the
        manifest says so: bytes beyond its count are cut by the next writer open)."""
        self._write_log(self.path / TOMBSTONES, start * 8, ids)

    def _write_log(self, f: Path, offset: int, ids: npt.NDArray[np.int64]) -> None:
        """Write int64s at byte ``offset`` of an append-only log, fsynced."""
        new_file = not f.exists()
        size = 0 if new_file else f.stat().st_size
        try:
            with open(f, "r+b" if not new_file else "w+b") as fh:
                fh.seek(offset)
                fh.write(np.ascontiguousarray(ids, dtype=np.int64).tobytes())
                fh.flush()
                os.fsync(fh.fileno())
        except OSError:
            _give_back(f, size, new_file)
            raise
        if new_file:
            fsync_dir(self.path)

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
        for f, want in self.committed_files():
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

    def _commit(self, new: _Manifest, crash_at: str | None = None) -> None:
        mpath = self.path / MANIFEST
        tmp = mpath.with_name(MANIFEST + ".tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(new.to_json())
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            # a full disk: the half-written temp file must not hold space the caller's
            # rollback (a truncate, itself a commit) needs
            tmp.unlink(missing_ok=True)
            raise
        _check_crash(crash_at, "before_manifest")
        with self._lock:  # the rename and the state swap together (see _reload_manifest)
            os.replace(tmp, mpath)
            _check_crash(crash_at, "after_manifest")
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
