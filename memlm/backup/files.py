"""Copying files with their checksum, durably, and the "is it empty" checks."""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from memlm.backup.errors import BackupCorrupt, TargetNotEmpty
from memlm.backup.manifest import FileEntry

# Bytes per read of a copy: large enough for sequential disk speed, small enough for
# a progress bar that moves.
_CHUNK = 8 << 20

Advance = Callable[[int], None]
# A progress display: (label, total bytes) -> a context whose value advances it by n bytes.
Progress = Callable[[str, int], contextlib.AbstractContextManager[Advance]]


@contextlib.contextmanager
def no_progress(label: str, total: int) -> Iterator[Advance]:
    yield lambda n: None


class HashingWriter:
    """A binary file that also hashes and counts what is written to it."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "xb")  # noqa: SIM115 - closed by close()
        self._h = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self._h.update(data)
        self.size += len(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> FileEntry:
        """fsync and close; the file's entry for the manifest."""
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return FileEntry(self.size, self._h.hexdigest())


def copy_stream(
    src: IO[bytes], dst: Path, length: int | None, advance: Advance | None = None
) -> FileEntry:
    """Copy ``length`` bytes (None: to the end) from ``src``'s position into a new file."""
    out = HashingWriter(dst)
    try:
        left = length
        while left is None or left > 0:
            block = src.read(_CHUNK if left is None else min(_CHUNK, left))
            if not block:
                break
            out.write(block)
            if left is not None:
                left -= len(block)
            if advance is not None:
                advance(len(block))
    finally:
        entry = out.close()
    if length is not None and entry.size != length:
        raise BackupCorrupt(f"{dst}: {entry.size} bytes copied, {length} expected")
    return entry


def hash_file(path: Path) -> FileEntry:
    """The size and SHA-256 of a file."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
            size += len(block)
    return FileEntry(size, h.hexdigest())


def check_entry(path: Path, entry: FileEntry, got: FileEntry) -> None:
    if got != entry:
        raise BackupCorrupt(
            f"{path}: {got.size} bytes with SHA-256 {got.sha256[:16]}..., the backup's "
            f"manifest records {entry.size} bytes with {entry.sha256[:16]}...: the backup "
            "is damaged; restore from another one"
        )


def fsync_tree(root: Path) -> None:
    """fsync every directory under ``root`` (new entries durable; files were fsynced)."""
    for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def require_empty_dir(path: Path, what: str, allowed: frozenset[str] = frozenset()) -> None:
    """Refuse a directory holding anything but the names in ``allowed``."""
    if not path.exists():
        return
    if not path.is_dir():
        raise TargetNotEmpty(f"{what} {path} is a file, not a directory")
    extra = sorted(p.name for p in path.iterdir() if p.name not in allowed)
    if extra:
        shown = ", ".join(extra[:5]) + (", ..." if len(extra) > 5 else "")
        raise TargetNotEmpty(
            f"{what} {path} is not empty ({shown}); give an empty or new directory"
        )
