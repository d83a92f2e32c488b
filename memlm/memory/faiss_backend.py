"""The embedded ``faiss`` memory: today's datastore files and served index, behind the
:class:`~memlm.memory.base.MemoryBackend` interface (an adapter: the datastore and the index
keep their own crash safety, versions and fresh index)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from memlm.datastore import Datastore
from memlm.index import IndexParams, MemoryIndex, build_index
from memlm.memory.base import Neighbours, Provenance


class FaissMemory:
    """A datastore (keys, values, provenance) and the ``MemoryIndex`` serving it."""

    name = "faiss"

    def __init__(self, datastore: Datastore, index: MemoryIndex) -> None:
        self.datastore = datastore
        self.index = index

    @classmethod
    def open(
        cls,
        data_dir: Path,
        dim: int | None,
        *,
        readonly: bool = False,
        shared: bool = False,
    ) -> FaissMemory:
        """Open (or create) ``data_dir/datastore`` and serve ``data_dir/index``."""
        ds = Datastore.open(Path(data_dir) / "datastore", dim=dim, readonly=readonly, shared=shared)
        return cls(ds, MemoryIndex(ds, Path(data_dir) / "index"))

    @property
    def dim(self) -> int:
        return self.datastore.dim

    @property
    def root(self) -> Path:
        return self.index.root

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

    def search(self, queries: npt.ArrayLike, k: int) -> Neighbours:
        return Neighbours(*self.index.search_values(queries, k))

    def provenance(self, ids: npt.ArrayLike) -> Provenance:
        docs, pos, days = self.datastore.provenance(np.asarray(ids, np.int64))
        return Provenance(
            np.asarray(docs, np.int64), np.asarray(pos, np.int64), np.asarray(days, np.int32)
        )

    def delete_document(self, doc_id: int) -> int:
        return int(self.datastore.delete_document(doc_id))

    def count(self) -> int:
        return int(self.datastore.num_live)

    def refresh(self) -> int:
        return int(self.index.refresh())

    def build(self, params: IndexParams | None = None) -> dict[str, Any]:
        info = build_index(self.datastore, self.index.root, params, progress=False)
        self.index.reload()
        return info.to_json()

    def stats(self) -> dict[str, Any]:
        return {"backend": self.name, "entries": self.count(), "index": self.index.stats()}

    def close(self) -> None:
        self.datastore.close()
