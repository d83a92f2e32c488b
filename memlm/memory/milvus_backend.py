"""The ``milvus`` memory: a Milvus collection (:mod:`memlm.memory.milvus_collection`) with
what the engine asks of every memory (:class:`~memlm.memory.base.MemoryBackend`).

- The records of its builds live in the data directory (``root``: ``index/v000042/
  meta.json`` and ``CURRENT``, as the faiss memory's versions, without an index file),
  so the interpolation chosen at a build is saved beside its record and served with it.
  A build flushes, compacts and (when the size or ``retrain`` asks) re-creates the
  collection's index, then publishes the record; a crash before the record leaves the
  previous version served, and the build runs again.
- A document's ``put_document`` replaces whatever an earlier try of it stored (the ids
  are deterministic), so writers need no turns (``writer()`` holds nothing), and
  ``rollback`` has only a failed try's document to delete.
- Milvus keeps no tombstones: forgetting deletes at once, and the documents deleted so
  far are counted beside the records (``prune`` drops versions older than a deletion).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from memlm.datastore import SimulatedCrash
from memlm.index import BuildInfo, IndexParams, current_version, prune
from memlm.index.versions import next_version, publish, version_name
from memlm.memory.base import Committed, MemoryBackend, Recovered
from memlm.memory.milvus_builds import SWAP_CRASH_POINTS, MilvusIndexed
from memlm.memory.milvus_client import MilvusException, MilvusMemoryError, entry_ids, mapped
from memlm.memory.milvus_deletes import JOURNAL_FILE, DeleteJournal
from memlm.memory.url import MilvusURL
from memlm.memory.versions import DeletedCount, reconcile_versions

__all__ = [
    "BUILD_CRASH_POINTS",
    "MilvusException",
    "MilvusMemory",
    "MilvusMemoryError",
    "entry_ids",
]

log = logging.getLogger(__name__)

BUILD_CRASH_POINTS = (
    # only where the index is re-created: the next generation filled and loaded, not
    # named by the alias; the alias switched, the old generation not dropped
    *SWAP_CRASH_POINTS,
    "after_add",  # the collection flushed, compacted and indexed; no record written
    "after_write",  # tmp-... record complete and fsynced, not renamed
    "after_rename",  # v000042 in place, CURRENT still names the old version
    "before_current",  # CURRENT's temp file written, not renamed over CURRENT
)


class MilvusMemory(MilvusIndexed, MemoryBackend):
    """A memory in one Milvus collection; ``root``: where its build records live (None:
    the collection alone, for tools that copy or index it: ``build_index``)."""

    build_crash_points = BUILD_CRASH_POINTS

    def __init__(self, url: MilvusURL, dim: int | None, root: Path | None = None) -> None:
        super().__init__(url, dim)
        self._root = None if root is None else Path(root)
        self._deleted = DeletedCount(self._root)
        if self._root is not None:
            self.deletes = DeleteJournal(self._root / JOURNAL_FILE)
        self._served = None if self._root is None else current_version(self._root)

    @property
    def root(self) -> Path:
        if self._root is None:
            raise MilvusMemoryError(
                f"{self.url} was opened without a data directory: it keeps no build records"
            )
        return self._root

    @property
    def served_version(self) -> int | None:
        return self._served

    @property
    def deleted_documents(self) -> int:
        return self._deleted.value

    # --- writing -----------------------------------------------------------------------

    def put_document(
        self,
        doc_id: int,
        keys: npt.ArrayLike,
        values: npt.ArrayLike,
        positions: npt.ArrayLike,
        day: int,
    ) -> None:
        """Replace the document's entries by these (ids ``doc_id * 2**24 + position``)."""
        n = len(np.asarray(values))
        if n:
            self.append(keys, values, np.full(n, doc_id, np.int64), positions, np.full(n, day))
        else:  # nothing to store: an earlier, killed try may have stored some
            self._delete_by_document(doc_id)
        return None

    def entry_ids(
        self, doc_id: int, positions: npt.ArrayLike, span: range | None
    ) -> npt.NDArray[np.int64]:
        pos = np.asarray(positions, np.int64)
        return entry_ids(np.full(len(pos), doc_id, np.int64), pos)

    @mapped
    def _delete_by_document(self, doc_id: int) -> int:
        return self._delete_expr(f"doc_id == {int(doc_id)}")

    def rollback(self, committed: Committed, document: int | None = None) -> int:
        """Delete ``document``'s entries unless the database holds them (done, or another
        worker's try); without a document nothing can be left behind: a put replaces its
        document's earlier entries."""
        if document is None or document in committed.holds([document]):
            return 0
        return self.delete_entries(document)

    def recover(self, committed: Committed) -> Recovered:
        """Delete the entries of documents that are neither done nor claimed by a live
        worker (a worker killed between its insert and its commit left them)."""
        before = self.count()
        held = self.documents()
        keep = sorted(committed.holds(held.tolist()))
        dropped = int(self.delete_documents_except(keep, held))
        if dropped:
            log.warning("deleted %d Milvus entries of uncommitted documents", dropped)
        return Recovered(before, before - dropped)

    def delete_document(self, doc_id: int, *, entries: range | None = None) -> int:
        """Delete the document's entries (``entries`` is not needed: they are found by
        document) and count the deletion, also when another process's hide deleted
        them first."""
        held = self.delete_entries(doc_id, lasting=True)
        self._deleted.add()
        return held

    def hide_documents(self, doc_ids: Sequence[int]) -> int:
        """Deleted now: Milvus has no tombstone to wait for (the writer's forget then
        finds none and counts the deletion)."""
        for d in doc_ids:
            self.delete_entries(d, lasting=True)
        return len(doc_ids)

    def build(
        self,
        params: IndexParams | None = None,
        *,
        retrain: bool = False,
        crash_at: str | None = None,
    ) -> BuildInfo:
        """Index the collection (``build_index``) and publish its version record."""
        if crash_at is not None and crash_at not in BUILD_CRASH_POINTS:
            raise ValueError(f"crash_at must be one of {BUILD_CRASH_POINTS}, got {crash_at!r}")
        root = self.root
        root.mkdir(parents=True, exist_ok=True)
        deleted = self.deleted_documents  # read first: a later deletion prunes this one
        base = self._record(current_version(root))
        swap_crash = crash_at if crash_at in SWAP_CRASH_POINTS else None
        done = self.build_index(params, retrain=retrain, crash_at=swap_crash)
        if crash_at == "after_add":
            raise SimulatedCrash(crash_at)
        n, recreated = int(done["entries"]), bool(done["index_recreated"])
        if recreated:
            mode, reason, trained = "full", "index re-created", n
        else:
            mode, reason = "incremental", "Milvus indexed the new segments"
            trained = n if base is None else (base.trained_entries or base.entries)
        version = next_version(root)
        info = BuildInfo(
            version=version,
            entries=n,
            upto=n,
            params=self.params,
            train_seconds=0.0,
            add_seconds=float(done["seconds"]),
            path=root / version_name(version),
            dim=self.dim,
            deleted_documents=deleted,
            mode=mode,
            reason=reason,
            base_version=None if base is None else base.version,
            trained_entries=trained,
            details={k: v for k, v in done.items() if k not in ("backend", "entries", "params")},
        )
        publish(root, None, info, crash_at)
        return info

    def _record(self, version: int | None) -> BuildInfo | None:
        if version is None:
            return None
        try:
            return BuildInfo.read(self.root / version_name(version))
        except (OSError, ValueError, TypeError):
            return None

    def prune(self, keep: int = 3) -> list[Path]:
        return prune(self.root, keep=keep, deleted_documents=self.deleted_documents)

    # --- reading -----------------------------------------------------------------------

    def reload(self) -> bool:
        """Follow an index another process re-created and the version it recorded."""
        self.refresh()
        version = None if self._root is None else current_version(self._root)
        if version == self._served:
            return False
        self._served = version
        return True

    def reconcile(self, recorded: Collection[int], *, delete: bool = False) -> list[int]:
        """Serve the newest recorded version; ``delete`` (the builder, at its start) also
        puts the alias back on the collection that version names where a build killed
        after its switch moved it, and drops the generations killed builds left."""
        if self._root is None:
            return []
        orphans, self._served = reconcile_versions(self._root, recorded, delete=delete)
        if delete:
            record = self._record(self._served)
            self.cleanup(None if record is None else record.details.get("collection"))
        else:
            self.refresh()
        return orphans

    def stats(self) -> dict[str, Any]:
        """The collection's own count and index; no local files hold entries."""
        mem = super().stats()
        return {
            **mem,
            "datastore_entries": mem["entries"],  # no local files: the collection's count
            "deleted_documents": self.deleted_documents,
            "bytes_on_disk": None,
            "bytes_in_ram": None,
        }
