"""The datastore handle: :class:`Datastore` and how a directory is opened."""

from __future__ import annotations

import os
from pathlib import Path

from memlm.datastore.durable import _stat_key, _take_writer_lock, atomic_write_text
from memlm.datastore.forget import _Forget
from memlm.datastore.layout import (
    DEFAULT_MAX_SEGMENT_ENTRIES,
    MANIFEST,
    DatastoreError,
    KeyPrecisionMismatch,
)
from memlm.datastore.manifest import _Manifest


class Datastore(_Forget):
    """An append-only kNN-LM datastore in a directory; see the package docstring.

    One process writes (``append``, ``truncate``, ``delete_document``, ``compact``); reads
    may run from other threads at the same time. Open a datastore with :meth:`open`.
    """

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
        key_precision: str | None = None,
    ) -> Datastore:
        """Open the datastore at ``path``, creating it when missing (``dim`` required then).

        The writer (default) takes an exclusive lock on ``path/LOCK`` for the object's
        lifetime (``close()`` releases it), checks ``dim`` and removes uncommitted work
        left by a crash. ``readonly=True`` (for another process, e.g. the API server)
        takes no lock, changes nothing, and sees the writer's commits after ``reload()``.
        ``shared=True`` opens a writer that holds the lock only inside ``exclusive()``
        (and while opening), so several processes can write in turn.
        ``max_segment_entries`` only applies at creation; an existing store keeps its own.
        ``key_precision`` (the encoder's MEMLM_PRECISION) is recorded at creation; opening
        a store whose keys were made in another precision raises KeyPrecisionMismatch:
        keys of two precisions are two key spaces, and one store never mixes them.
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
                m = _Manifest(
                    dim=int(dim),
                    max_segment_entries=int(max_segment_entries),
                    key_precision=key_precision or "float32",
                )
                atomic_write_text(mpath, m.to_json())
            else:
                m = _Manifest.from_json(mpath.read_text(encoding="utf-8"), mpath)
                if dim is not None and dim != m.dim:
                    raise DatastoreError(f"{p}: datastore has dim {m.dim}, caller expects {dim}")
                if key_precision is not None and key_precision != m.key_precision:
                    raise KeyPrecisionMismatch(p, m.key_precision, key_precision)
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

    @staticmethod
    def stored_key_precision(path: str | os.PathLike[str]) -> str | None:
        """The precision the keys of the store at ``path`` were made with; None: no store."""
        mpath = Path(path) / MANIFEST
        if not mpath.exists():
            return None
        return _Manifest.from_json(mpath.read_text(encoding="utf-8"), mpath).key_precision

    @property
    def key_precision(self) -> str:
        return self._m.key_precision

    def __enter__(self) -> Datastore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Datastore({str(self.path)!r}, entries={len(self)}, dim={self.dim})"
