"""The vector memory behind one interface (memlm.memory.base; docs/architecture.md).

``open_memory`` picks the backend from ``MEMLM_MEMORY_URL``, once: the embedded ``faiss``
files (default) or a Milvus collection; nothing after it asks which one serves. pymilvus
is imported only when a Milvus memory is opened.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from memlm.datastore import Compaction, Datastore, SimulatedCrash
from memlm.index import BuildInfo, IndexParams
from memlm.memory.base import (
    Committed,
    MemoryBackend,
    MemoryBehind,
    Neighbours,
    Provenance,
    Recovered,
    Scanned,
)
from memlm.memory.url import MilvusURL, parse_memory_url

if TYPE_CHECKING:
    from memlm.memory.faiss_backend import FaissMemory
    from memlm.memory.milvus_backend import MilvusMemory

__all__ = [
    "BuildInfo",
    "Committed",
    "Compaction",
    "IndexParams",
    "MemoryBackend",
    "MemoryBehind",
    "MilvusURL",
    "Neighbours",
    "Provenance",
    "Recovered",
    "Scanned",
    "SimulatedCrash",
    "open_faiss",
    "open_memory",
    "open_milvus",
    "parse_memory_url",
    "stored_key_precision",
]


def open_faiss(
    data_dir: Path, dim: int | None, *, readonly: bool = False, shared: bool = False
) -> FaissMemory:
    from memlm.memory.faiss_backend import FaissMemory

    return FaissMemory.open(data_dir, dim, readonly=readonly, shared=shared)


def open_milvus(url: MilvusURL | str, dim: int | None, *, root: Path | None = None) -> MilvusMemory:
    """Connect to the collection (created, with a FLAT index, if it does not exist);
    ``root``: the directory of its build records (the engine's ``data_dir/index``)."""
    from memlm.memory.milvus_backend import MilvusMemory

    parsed = parse_memory_url(url) if isinstance(url, str) else url
    if parsed is None:
        raise ValueError("not a milvus:// URL")
    return MilvusMemory(parsed, dim, root)


def open_memory(
    url: str | None,
    data_dir: Path,
    dim: int,
    *,
    readonly: bool = False,
    shared: bool = False,
    key_precision: str | None = None,
    threads: int | None = None,
) -> MemoryBackend:
    """The memory of an engine on ``data_dir``: the faiss files under it, or the Milvus
    collection ``url`` names with its build records under it (``data_dir/index``).

    ``readonly``: another process writes (faiss opens the files without the write lock);
    ``shared``: one of several writer processes; ``key_precision``: the faiss datastore
    refuses keys of another precision (Milvus holds float32 keys whatever the model's);
    ``threads``: faiss's threads of each search (``MEMLM_THREADS``; Milvus searches on
    its server).
    """
    milvus = parse_memory_url(url)
    if milvus is not None:
        return open_milvus(milvus, dim, root=Path(data_dir) / "index")
    from memlm.memory.faiss_backend import FaissMemory

    return FaissMemory.open(
        data_dir,
        None if readonly else dim,
        readonly=readonly,
        shared=shared,
        key_precision=key_precision,
        threads=threads,
    )


def stored_key_precision(url: str | None, data_dir: Path) -> str | None:
    """The precision the memory's keys were made with, when it records one (the faiss
    datastore does; None otherwise)."""
    if parse_memory_url(url) is not None:
        return None
    return Datastore.stored_key_precision(Path(data_dir) / "datastore")
