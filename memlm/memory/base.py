"""The memory boundary: what the engine, the workers and the service ask of the vector memory.

Two implementations: ``faiss`` (the embedded files: datastore segments, versioned IVF-PQ
and the fresh exact index) and ``milvus`` (a Milvus standalone or Distributed server).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from memlm.index import IndexParams


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


@runtime_checkable
class MemoryBackend(Protocol):
    """A kNN-LM memory: entries (key -> value) with provenance (document, position, day)."""

    name: str  # "faiss" or "milvus": what /admin/stats reports

    @property
    def dim(self) -> int: ...

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

    def search(self, queries: npt.ArrayLike, k: int) -> Neighbours:
        """The k nearest live entries of each query (one batched call for all rows)."""
        ...

    def provenance(self, ids: npt.ArrayLike) -> Provenance:
        """Document, position and day of each (valid) entry id."""
        ...

    def delete_document(self, doc_id: int) -> int:
        """Remove a document's entries from every later search; returns how many."""
        ...

    def count(self) -> int:
        """Live entries the memory holds now."""
        ...

    def refresh(self) -> int:
        """Make entries written by other processes searchable; returns how many were new
        (0 where the backend does not know: Milvus shows them by itself)."""
        ...

    def build(self, params: IndexParams | None = None) -> dict[str, Any]:
        """(Re)build the approximate index over the live entries; returns what was done."""
        ...

    def stats(self) -> dict[str, Any]:
        """``backend``, ``entries`` (== ``count()``) and backend-specific details."""
        ...

    def close(self) -> None: ...
