"""The embedded ``faiss`` memory: the datastore files and the served index versions, behind
the :class:`~memlm.memory.base.MemoryBackend` interface (an adapter: the datastore and the
index keep their own crash safety, versions and fresh index)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import numpy.typing as npt

from memlm.datastore import RETIRE_CRASH_POINTS, Compaction, Datastore
from memlm.index import (
    BUILD_CRASH_POINTS,
    INCREMENTAL_CRASH_POINTS,
    BuildInfo,
    IndexParams,
    MemoryIndex,
    build_index,
    prune,
)
from memlm.memory.base import (
    Committed,
    MemoryBackend,
    MemoryBehind,
    Neighbours,
    Provenance,
    Recovered,
    Scanned,
)
from memlm.memory.versions import reconcile_versions

log = logging.getLogger(__name__)


class FaissMemory(MemoryBackend):
    """A datastore (keys, values, provenance) and the ``MemoryIndex`` serving it.

    Entry ids are datastore positions: a document's entries are one id range, appended
    after the committed ones, so a rollback cuts the datastore back to the committed end.
    """

    name = "faiss"
    build_crash_points = tuple(dict.fromkeys(BUILD_CRASH_POINTS + INCREMENTAL_CRASH_POINTS))
    retire_crash_points = RETIRE_CRASH_POINTS

    def __init__(
        self,
        datastore: Datastore,
        index: MemoryIndex,
        *,
        shared: bool = False,
        threads: int | None = None,
    ) -> None:
        self.datastore = datastore
        self.index = index
        self.shared = shared  # other writer processes append to the same files
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads

    def _own_threads(self) -> None:
        """Search with ``threads`` OpenMP threads on the calling thread. faiss's
        ``omp_set_num_threads`` sets only the calling thread's count: one set at start-up
        leaves the API's request threads and the ingest worker's thread searching with one
        thread per core whatever ``MEMLM_THREADS`` says."""
        if self.threads is not None and faiss.omp_get_max_threads() != self.threads:
            faiss.omp_set_num_threads(self.threads)

    @classmethod
    def open(
        cls,
        data_dir: Path,
        dim: int | None,
        *,
        readonly: bool = False,
        shared: bool = False,
        key_precision: str | None = None,
        threads: int | None = None,
    ) -> FaissMemory:
        """Open (or create) ``data_dir/datastore`` and serve ``data_dir/index``.

        ``key_precision``: refuse a store whose keys were made in another precision;
        ``threads``: OpenMP threads of each search, on whichever thread calls it (None:
        faiss's default, one per core)."""
        ds = Datastore.open(
            Path(data_dir) / "datastore",
            dim=dim,
            readonly=readonly,
            shared=shared,
            key_precision=key_precision,
        )
        return cls(ds, MemoryIndex(ds, Path(data_dir) / "index"), shared=shared, threads=threads)

    @property
    def dim(self) -> int:
        return self.datastore.dim

    @property
    def root(self) -> Path:
        return self.index.root

    @property
    def served_version(self) -> int | None:
        return self.index.version

    @property
    def deleted_documents(self) -> int:
        return int(self.datastore.num_deleted_documents)

    # --- writing -----------------------------------------------------------------------

    @contextlib.contextmanager
    def writer(self) -> Iterator[None]:
        """The datastore's write lock; a shared writer first serves what the others
        appended, so that it sees every entry they committed before it appends."""
        with self.datastore.exclusive():
            if self.shared:
                self.index.refresh()
            yield

    def append(
        self,
        keys: npt.ArrayLike,
        values: npt.ArrayLike,
        documents: npt.ArrayLike,
        positions: npt.ArrayLike,
        days: npt.ArrayLike,
    ) -> npt.NDArray[np.int64]:
        first = len(self.datastore)
        self.datastore.append(
            np.asarray(keys).astype(np.float16),
            np.asarray(values, np.int32),
            np.asarray(documents, np.int64),
            np.asarray(positions, np.int64),
            np.asarray(days, np.int32),
        )
        self.index.refresh()
        return np.arange(first, len(self.datastore), dtype=np.int64)

    def put_document(
        self,
        doc_id: int,
        keys: npt.ArrayLike,
        values: npt.ArrayLike,
        positions: npt.ArrayLike,
        day: int,
    ) -> range:
        with self.datastore.exclusive():  # the range is this document's alone
            first = len(self.datastore)
            n = len(np.asarray(values))
            if n:
                self.append(keys, values, np.full(n, doc_id), positions, np.full(n, day))
            return range(first, len(self.datastore))

    def entry_ids(
        self, doc_id: int, positions: npt.ArrayLike, span: range | None
    ) -> npt.NDArray[np.int64]:
        assert span is not None and len(span) == len(np.asarray(positions)), (span, doc_id)
        return np.arange(span.start, span.stop, dtype=np.int64)

    def truncate(self, n: int) -> None:
        """Drop the entries with ids >= ``n`` (tests and benchmarks reset a memory)."""
        with self.datastore.exclusive():
            self.datastore.truncate(n)
            self.index.refresh()

    def rollback(self, committed: Committed, document: int | None = None) -> int:
        """Cut the datastore back to the committed end (whatever ``document``: any
        worker's uncommitted tail sits past it)."""
        with self.datastore.exclusive():
            before, end = len(self.datastore), committed.end()
            if before > end:
                log.warning(
                    "cutting %d uncommitted datastore entries (%d -> %d)", before - end, before, end
                )
                self.truncate(end)
            return max(0, before - end)

    def recover(self, committed: Committed) -> Recovered:
        with self.datastore.exclusive():
            before, end = len(self.datastore), committed.end()
            if before < end:
                raise MemoryBehind(
                    f"datastore has {before} entries but committed documents own {end}: "
                    "the data directory does not match the database"
                )
            self.rollback(committed)
            return Recovered(before, len(self.datastore))

    def delete_document(self, doc_id: int, *, entries: range | None = None) -> int:
        return int(self.datastore.delete_document(doc_id, entries=entries))

    def hide_documents(self, doc_ids: Sequence[int]) -> int:
        """Filtered from every search until the writer's tombstone takes over
        (``MemoryIndex.hide_documents``)."""
        return self.index.hide_documents(list(doc_ids))

    def retire(self, ids: npt.ArrayLike, *, crash_at: str | None = None) -> int:
        """The datastore's retired log (``Datastore.retire_entries``): filtered from every
        search at once, removed from the index by the next build, from the disk by the
        next compaction."""
        return int(self.datastore.retire_entries(ids, crash_at=crash_at))

    def compact(self, *, crash_at: str | None = None) -> Compaction:
        with self.datastore.exclusive():
            done = self.datastore.compact(crash_at=crash_at)
            self.index.refresh()
        return done

    def build(
        self,
        params: IndexParams | None = None,
        *,
        retrain: bool = False,
        crash_at: str | None = None,
    ) -> BuildInfo:
        """A new index version (incremental unless ``retrain`` or the size asks for
        training: ``build_index``); served after ``reload``."""
        return build_index(
            self.datastore, self.root, params, retrain=retrain, crash_at=crash_at, progress=False
        )

    def build_index(self, params: IndexParams | None = None) -> dict[str, Any]:
        """``build`` and serve it at once (tools and benchmarks); what was built."""
        info = self.build(params)
        self.index.reload()
        return info.to_json()

    def prune(self, keep: int = 3) -> list[Path]:
        return prune(self.root, keep=keep, deleted_documents=self.deleted_documents)

    # --- reading -----------------------------------------------------------------------

    def search(self, queries: npt.ArrayLike, k: int, *, depth: int | None = None) -> Neighbours:
        self._own_threads()
        return Neighbours(*self.index.search_values(queries, k, depth=depth))

    def successors(self, queries: npt.ArrayLike, ids: npt.ArrayLike) -> Neighbours:
        self._own_threads()
        return Neighbours(*self.index.successors(queries, ids))

    def scan(self, cursor: int, limit: int) -> Scanned:
        ds = self.datastore
        total = len(ds)
        start = cursor if 0 <= cursor < total else 0
        found: list[npt.NDArray[np.int64]] = []
        have, pos = 0, start
        step = max(1024, limit)
        while have < limit and pos < total:  # ids, not rows: retired gaps are skipped
            ids = np.arange(pos, min(total, pos + step), dtype=np.int64)
            ids = ids[ds.live_mask(ids)][: limit - have]
            found.append(ids)
            have += len(ids)
            pos = int(ids[-1]) + 1 if have == limit else pos + step
        ids = np.concatenate(found) if found else np.empty(0, np.int64)
        keys = ds.keys(ids).astype(np.float32) if len(ids) else np.empty((0, self.dim), np.float32)
        values = ds.values(ids) if len(ids) else np.empty(0, np.int32)
        nxt = min(pos, total)
        return Scanned(ids, keys, np.asarray(values, np.int32), 0 if nxt >= total else nxt)

    def provenance(self, ids: npt.ArrayLike) -> Provenance:
        docs, pos, days = self.datastore.provenance(np.asarray(ids, np.int64))
        return Provenance(
            np.asarray(docs, np.int64), np.asarray(pos, np.int64), np.asarray(days, np.int32)
        )

    def live_days(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]]:
        ds = self.datastore
        ids = np.arange(len(ds), dtype=np.int64)
        ids = ids[ds.live_mask(ids)]
        return ids, self.provenance(ids).days

    def count(self) -> int:
        return int(self.datastore.num_live)

    def refresh(self) -> int:
        return int(self.index.refresh())

    def reload(self) -> bool:
        return self.index.reload()

    def reconcile(self, recorded: Collection[int], *, delete: bool = False) -> list[int]:
        orphans, want = reconcile_versions(self.root, recorded, delete=delete)
        if self.index.version != want:
            self.index.serve(want)
        return orphans

    def _index_ram_bytes(self, idx: dict[str, Any]) -> int:
        """Vectors the served index holds in RAM: float32 for exact parts, codes for PQ."""
        info = self.index._state.info
        fresh = int(idx["fresh_entries"]) * (4 * self.dim + 8)
        built = int(idx["built_entries"])
        if info is None or info.params.kind == "flat":
            return fresh + built * (4 * self.dim + 8)
        return fresh + built * (info.params.m + 8)

    def stats(self) -> dict[str, Any]:
        ds = self.datastore.stats()
        idx = self.index.stats()
        root = self.root
        index_bytes = (
            sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.exists() else 0
        )
        return {
            "backend": self.name,
            "entries": ds["live_entries"],
            "datastore_entries": ds["entries"],
            "datastore_rows": ds["rows"],
            "deleted_documents": ds["deleted_documents"],
            "retired_entries": ds["retired_entries"],
            "bytes_reclaimed": ds["bytes_reclaimed"],
            "bytes_on_disk": ds["bytes_on_disk"] + index_bytes,
            "bytes_in_ram": self._index_ram_bytes(idx),
            "index": idx,
        }

    def close(self) -> None:
        self.datastore.close()
