"""The Milvus memory's lasting deletions since its last build, kept to apply again.

A forget and a consolidation's retirement are final: the rows must never be served
again. Milvus 2.3 servers before 2.3.15 may lose a delete that meets a compaction
(the merged segment written without it: milvus-io/milvus#33015 and its kin), and then
the rows come back to every search. So each lasting delete is written here first, and
each build, once its compaction is done and its segments served, counts the rows these
deletes name: any still there are deleted again (``MilvusIndexed._settle_deletes``),
logged, and counted in the build record (``deletes_reapplied``). Until a build settles
them, searches hide every entry the journal names (``MilvusCollection.search`` and
``successors``: ``hide``), and pages read for a backup, a migration or a re-created
generation's copy leave them out (``without``): a forget is not served again, whatever
the server did with its delete.

One JSON line a delete, ``{"field": "doc_id" | "id", "values": [...]}``, appended under
an exclusive ``flock`` (the API, the workers and the builder may share a data
directory); a build takes what is there and removes exactly that part, so a delete
written meanwhile waits for the next build. Without a data directory the journal is this
process's list. Only lasting deletes go here: the cleanup of a document whose ingest
never committed is not one (its retry stores the same entry ids again).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import numpy.typing as npt

from memlm.memory.base import Neighbours
from memlm.memory.milvus_client import POSITION_BITS, entry_ids
from memlm.memory.milvus_reads import Page

log = logging.getLogger(__name__)

JOURNAL_FILE = "milvus-deletes.jsonl"
FIELDS = ("doc_id", "id")
_NONE = np.zeros(0, np.int64)


class DeleteJournal:
    """Lasting deletes not yet checked by a build (see the module docstring)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lines: list[str] = []  # without a path
        self._edits = 0  # changes to ``_lines``
        # ``named``'s answer, and the file's (inode, size, mtime) or the list's length it
        # was read at
        self._named: tuple[object, tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]] = (
            None,
            (_NONE, _NONE),
        )
        self._named_lock = threading.Lock()

    def named(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """(documents, entry ids) the journal names now, sorted: what searches hide
        until a build settles them (``MilvusCollection.search``). Read again only when
        the file changed (one ``stat`` a call)."""
        if self.path is None:
            stamp: object = self._edits
        else:
            try:
                st = self.path.stat()
            except FileNotFoundError:
                return _NONE, _NONE
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        seen, answer = self._named
        if seen == stamp:
            return answer
        with self._named_lock:
            values = self.pending()[0]
            answer = np.array(values["doc_id"], np.int64), np.array(values["id"], np.int64)
            self._named = (stamp, answer)
        return answer

    def record(self, field: str, values: Sequence[int]) -> None:
        """Write the delete down before it is sent (a delete that then fails is sent
        again by the next build: deleting an absent row does nothing)."""
        if field not in FIELDS:
            raise ValueError(f"field must be one of {FIELDS}, got {field!r}")
        if not len(values):
            return
        line = json.dumps({"field": field, "values": [int(v) for v in values]}) + "\n"
        if self.path is None:
            self._lines.append(line)
            self._edits += 1
            return
        with self._locked(os.O_RDWR | os.O_APPEND | os.O_CREAT) as fd:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                line = "\n" + line  # after a line a crash cut short: that one stays apart
            os.write(fd, line.encode())
            os.fsync(fd)

    def hide(self, found: Neighbours) -> tuple[Neighbours, int]:
        """``found`` without the entries this journal names, and how many it held (0
        where the server applied the deletes); a row that held some has its others
        moved up and ends padded (inf, -1, -1)."""
        docs, ids = self.named()
        if not (docs.size or ids.size):
            return found, 0
        dead = (found.ids >= 0) & (
            np.isin(found.ids >> POSITION_BITS, docs) | np.isin(found.ids, ids)
        )
        hidden = int(dead.sum())
        if not hidden:
            return found, 0
        order = np.argsort(dead, axis=1, kind="stable")  # the kept first, in their order
        pad = np.take_along_axis(dead, order, 1)
        dist = np.take_along_axis(found.distances, order, 1)
        hit = np.take_along_axis(found.ids, order, 1)
        val = np.take_along_axis(found.values, order, 1)
        dist[pad], hit[pad], val[pad] = np.inf, -1, -1
        return Neighbours(dist, hit, val), hidden

    def without(self, page: Page) -> Page | None:
        """``page``'s rows less those this journal names (None: none left)."""
        docs, ids = self.named()
        if not (docs.size or ids.size):
            return page
        keys, values, documents, positions, days = page
        keep = ~(np.isin(documents, docs) | np.isin(entry_ids(documents, positions), ids))
        if keep.all():
            return page
        if not keep.any():
            return None
        return keys[keep], values[keep], documents[keep], positions[keep], days[keep]

    def pending(self) -> tuple[dict[str, list[int]], int]:
        """The values each field's deletes named (sorted, distinct) and how many bytes
        (or lines, without a file) that was: ``settle`` removes exactly those."""
        if self.path is None:
            lines, end = list(self._lines), len(self._lines)
        else:
            if not self.path.exists():
                return {f: [] for f in FIELDS}, 0
            with self._locked(os.O_RDONLY) as fd:
                data = _read_all(fd)
            end = data.rfind(b"\n") + 1  # a line cut by a crash mid-write is not read
            lines = data[:end].decode().splitlines()
        named: dict[str, set[int]] = {f: set() for f in FIELDS}
        for line in lines:
            try:
                rec = json.loads(line)
                named[rec["field"]].update(int(v) for v in rec["values"])
            except (ValueError, KeyError, TypeError):
                if line.strip():  # a line a crash cut short: its delete was never sent
                    log.warning("%s: skipped a damaged line %r", self.path, line[:80])
        return {f: sorted(v) for f, v in named.items()}, end

    def settle(self, end: int) -> None:
        """Remove what ``pending`` read (its ``end``); later lines stay. The one builder
        calls it (two settling at once could remove a line twice)."""
        if self.path is None:
            del self._lines[:end]
            self._edits += 1
            return
        if end == 0 or not self.path.exists():
            return
        with self._locked(os.O_RDONLY) as fd:
            rest = _read_all(fd)[end:]
            # a new file renamed over this one (a crash leaves the one or the other whole);
            # a writer waiting for the lock on the old file opens the new one (``_locked``)
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            tmp.write_bytes(rest)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, self.path)

    @contextmanager
    def _locked(self, flags: int) -> Iterator[int]:
        """The journal open and locked: opened again where ``settle`` replaced the file
        while this waited for the lock."""
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, flags, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        try:
            yield fd
        finally:
            os.close(fd)  # releases the lock


def _read_all(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


class LostDeleteLog:
    """The warning that a search hid deleted rows a server served, at most once per
    ``every`` seconds (a lost delete is served to every search until the next build):
    each line counts the rows hidden since the last one. Thread-safe."""

    def __init__(self, every: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every = every
        self._clock = clock
        self._lock = threading.Lock()
        self._last: float | None = None
        self._pending = 0  # hidden since the last line
        self.total = 0  # hidden in this process's lifetime

    def note(self, collection: str, hidden: int) -> None:
        if hidden <= 0:
            return
        with self._lock:
            self.total += hidden
            self._pending += hidden
            now = self._clock()
            if self._last is not None and now - self._last < self.every:
                return
            count, self._pending, self._last = self._pending, 0, now
        log.warning(
            "Milvus collection %s served %d deleted entries since the last warning "
            "(a delete the server lost): hidden; the next build deletes them again",
            collection,
            count,
        )
