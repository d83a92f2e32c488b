"""Durable file operations: directory fsync, atomic replace, the writer's flock."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Any

import numpy as np

from memlm.datastore.layout import LOCK, DatastoreError, SimulatedCrash


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
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except OSError:  # a full disk: leave no half-written temp file holding space
        tmp.unlink(missing_ok=True)
        raise
    if crash_at is not None:
        raise SimulatedCrash(crash_at)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_savez(path: Path, tmp: Path, arrays: dict[str, Any]) -> None:
    """``np.savez`` to ``tmp``, fsync, then ``os.replace`` onto ``path``; a write that fails
    (a full disk) removes its partial temp file instead of leaving it holding space."""
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def _give_back(f: Path, size: int, new_file: bool) -> None:
    """After a failed write (a full disk): return the bytes it added to ``f``, which held
    ``size`` bytes before (``new_file``: did not exist). No reader maps them: readers map
    committed rows, and a file is never shorter than what any manifest committed."""
    with contextlib.suppress(FileNotFoundError):
        if new_file:
            f.unlink()
        elif f.stat().st_size > size:
            os.truncate(f, size)


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
