"""The memory boundary: what the engine, the workers and the service ask of the vector memory.

Two implementations: ``faiss`` (the embedded files: datastore segments, versioned IVF-PQ
and the fresh exact index) and ``milvus`` (a Milvus standalone or Distributed server).
Callers never ask which one serves: where the two differ, the difference is a method
here (with a harmless default where one of them has nothing to do), the way starlette's
authentication backends or LlamaIndex's vector stores are plugged in.

Every memory keeps the records of its builds as version directories under ``root``
(``v000042/meta.json``, the ``CURRENT`` pointer; the faiss memory's also hold the index
file), and the engine saves the interpolation chosen at a build beside its record, so
the served interpolation follows the served version on every backend.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from memlm.datastore import Compaction
from memlm.index import BuildInfo, IndexParams


class Neighbours(NamedTuple):
    """k neighbours of each query, nearest first; padded with (inf, -1, -1).

    Unpacks like ``MemoryIndex.search_values``: ``dist, ids, vals = memory.search(q, k)``.
    """

    distances: npt.NDArray[np.float32]  # (nq, k) squared L2
    ids: npt.NDArray[np.int64]  # (nq, k) entry ids
    values: npt.NDArray[np.int32]  # (nq, k) next-token ids


def empty_neighbours(nq: int, k: int) -> Neighbours:
    return Neighbours(
        np.full((nq, k), np.inf, np.float32),
        np.full((nq, k), -1, np.int64),
        np.full((nq, k), -1, np.int32),
    )


class Provenance(NamedTuple):
    documents: npt.NDArray[np.int64]
    positions: npt.NDArray[np.int64]
    days: npt.NDArray[np.int32]


class Scanned(NamedTuple):
    """Live entries read in id order by :meth:`MemoryBackend.scan`."""

    ids: npt.NDArray[np.int64]  # (n,) ascending
    keys: npt.NDArray[np.float32]  # (n, dim)
    values: npt.NDArray[np.int32]  # (n,)
    next_cursor: int  # where the next scan starts; 0 once the end was reached (wrapped)


class Recovered(NamedTuple):
    """Entries the memory held before and after a start-up :meth:`MemoryBackend.recover`."""

    before: int
    after: int


class MemoryBehind(RuntimeError):
    """The memory holds less than the database says its committed documents stored: the
    data directory (or the collection) is not this database's."""


class Committed(Protocol):
    """What the database committed, as a memory's rollback asks it (the ingest worker
    answers from its repositories)."""

    def end(self) -> int:
        """The end of the committed documents' entry ranges (0 when none has one)."""
        ...

    def holds(self, doc_ids: Sequence[int]) -> set[int]:
        """Those of ``doc_ids`` whose entries must stay: done, or claimed by another
        live worker (its try may still commit)."""
        ...


@runtime_checkable
class MemoryBackend(Protocol):
    """A kNN-LM memory: entries (key -> value) with provenance (document, position, day).

    A writer process writes through ``writer()``, ``put_document``, ``rollback``,
    ``recover``, ``delete_document``, ``compact``, ``build`` and ``prune``; every process
    reads through ``search``, ``provenance``, ``count`` and follows the others with
    ``refresh`` (entries) and ``reload`` / ``reconcile`` (built versions).
    """

    name: str  # "faiss" or "milvus": what /admin/stats reports
    # where ``build(crash_at=...)`` may stop, in order (tests kill a build at each)
    build_crash_points: tuple[str, ...]
    # where ``retire(crash_at=...)`` may stop (none where retiring is one idempotent call)
    retire_crash_points: tuple[str, ...] = ()

    @property
    def dim(self) -> int: ...

    @property
    def root(self) -> Path:
        """The directory of the build records (``v000042/``, ``CURRENT``); the engine keeps
        each version's interpolation and calibrator beside its record."""
        ...

    @property
    def served_version(self) -> int | None:
        """The built version served now (None before the first build)."""
        ...

    @property
    def deleted_documents(self) -> int:
        """Documents deleted so far (never decreases): a version built when fewer were
        deleted may hold traces of one (keys, statistics), and ``prune`` removes it."""
        ...

    # --- writing ------------------------------------------------------------------------

    def writer(self) -> AbstractContextManager[None]:
        """The block in which this process is the memory's one writer, with the others'
        writes visible. Default: nothing to hold (a memory whose writes by document need
        no turns)."""
        return contextlib.nullcontext()

    def append(
        self,
        keys: npt.ArrayLike,  # (n, dim) float
        values: npt.ArrayLike,  # (n,) next-token ids
        documents: npt.ArrayLike,  # (n,) document ids
        positions: npt.ArrayLike,  # (n,) token positions in the document
        days: npt.ArrayLike,  # (n,) days since 1970-01-01
    ) -> npt.NDArray[np.int64]:
        """Store entries durably and make them searchable; returns their ids."""
        ...

    def put_document(
        self,
        doc_id: int,
        keys: npt.ArrayLike,  # (n, dim) float32
        values: npt.ArrayLike,  # (n,) next-token ids
        positions: npt.ArrayLike,  # (n,) token positions
        day: int,
    ) -> range | None:
        """Store one document's entries (n may be 0), durably and searchable; returns the
        id range that holds them for the database to record, or None where ids are not a
        range (they are then found by document). Call it inside ``writer()`` after
        ``rollback``: an earlier, uncommitted try of the document is not stored twice."""
        ...

    def entry_ids(
        self, doc_id: int, positions: npt.ArrayLike, span: range | None
    ) -> npt.NDArray[np.int64]:
        """The ids ``put_document(doc_id, ..., positions, ...)`` gave its entries, in order
        (``span``: what it returned)."""
        ...

    def rollback(self, committed: Committed, document: int | None = None) -> int:
        """Take out entries of tries the database did not commit: everything past the
        committed end, or ``document``'s entries unless the database holds them (a try of
        it that failed). Cheap: called around every document. Returns how many left."""
        ...

    def recover(self, committed: Committed) -> Recovered:
        """At a writer's start: take out every entry that no committed document (or live
        worker's claim) owns. Raises ``MemoryBehind`` when the memory holds less than
        was committed."""
        ...

    def delete_document(self, doc_id: int, *, entries: range | None = None) -> int:
        """Forget a document: its entries leave every later search and build (``entries``:
        the id range the database recorded, where the memory gave one). Returns how many
        it held (0 when none: forgetting again is harmless)."""
        ...

    def hide_documents(self, doc_ids: Sequence[int]) -> int:
        """Stop serving these documents' entries now, before the writer's
        ``delete_document`` (a forget accepted by another process)."""
        ...

    def retire(self, ids: npt.ArrayLike, *, crash_at: str | None = None) -> int:
        """Consolidation's retirement of single entries: gone from every later search and
        build, as a forgotten document's are. Returns how many of ``ids`` this newly
        retired (ids not live now count 0: a retry after a crash counts nothing twice)."""
        ...

    def compact(self, *, crash_at: str | None = None) -> Compaction:
        """Remove deleted documents' rows from storage. Default: nothing to do (a memory
        that compacts in ``build``)."""
        return Compaction(0, 0, 0)

    def build(
        self,
        params: IndexParams | None = None,
        *,
        retrain: bool = False,
        crash_at: str | None = None,
    ) -> BuildInfo:
        """Build the approximate index over the live entries and publish a new version
        record (``CURRENT`` names it; this process serves it after ``reload``).
        ``retrain``: train the quantizer again instead of building on the current one."""
        ...

    def prune(self, keep: int = 3) -> list[Path]:
        """Delete old version records: all but the newest ``keep``, and every one built
        before a later document deletion. Only the single builder calls it."""
        ...

    # --- reading ------------------------------------------------------------------------

    def search(self, queries: npt.ArrayLike, k: int, *, depth: int | None = None) -> Neighbours:
        """The k nearest live entries of each query (one batched call for all rows).

        ``depth``: approximate candidates this call re-ranks exactly (never fewer than k);
        None: the memory's own default. Each caller pays for its own: MoNIM's decision
        and the served interpolation need k <= 64, the evaluation's tuning 1,024."""
        ...

    def successors(self, queries: npt.ArrayLike, ids: npt.ArrayLike) -> Neighbours:
        """The entries that follow ``ids`` (nq, m; -1 pads) in their documents (the same
        document's entry of the next position, where it stored one), with exact squared L2 distances to each row's
        query, ascending, padded (inf, -1, -1): RetoMaton's pointers
        (memlm.memory.pointers)."""
        ...

    def scan(self, cursor: int, limit: int) -> Scanned:
        """Up to ``limit`` live entries with ids >= ``cursor``, in id order (consolidation
        rotates through the memory with it; the work is bounded by ``limit``)."""
        ...

    def provenance(self, ids: npt.ArrayLike) -> Provenance:
        """Document, position and day of each (valid) entry id."""
        ...

    def live_days(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]]:
        """Every live entry's id (ascending) and day: two integer columns, no keys (the
        ``spread`` budget counts each day's entries with it)."""
        ...

    def count(self) -> int:
        """Live entries the memory holds now."""
        ...

    def unavailable(self) -> str | None:
        """Why the memory cannot answer a search now (for the log), or None where it can.
        The worker asks before it claims another document after a try failed because a
        dependency was away, so that it waits instead of encoding documents in vain.
        Default: always searchable (local files)."""
        return None

    def refresh(self) -> int:
        """Make entries written by other processes searchable; returns how many were new
        (0 where the backend does not know: Milvus shows them by itself)."""
        ...

    def reload(self) -> bool:
        """Serve the version ``CURRENT`` names if another process built one; returns
        whether the served version changed."""
        ...

    def reconcile(self, recorded: Collection[int], *, delete: bool = False) -> list[int]:
        """Serve the newest version the database recorded; returns the versions it did not
        record (orphans of builds killed before their record), which ``delete`` (the
        builder, holding the build lock) removes."""
        ...

    def stats(self) -> dict[str, Any]:
        """``backend``, ``entries`` (== ``count()``), ``datastore_entries`` (entries the
        storage holds, deleted ones included), ``bytes_on_disk`` and ``bytes_in_ram``
        (None where the memory is not local), ``index`` and backend-specific details."""
        ...

    def close(self) -> None: ...
