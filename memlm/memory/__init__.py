"""The vector memory behind one small interface (memlm.memory.base; docs/architecture.md).

``open_memory`` picks the backend from ``MEMLM_MEMORY_URL``: the embedded ``faiss`` files
(default) or a Milvus collection. Nothing heavy is imported until a backend is opened.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from memlm.memory.base import MemoryBackend, Neighbours, Provenance
from memlm.memory.url import MilvusURL, parse_memory_url

if TYPE_CHECKING:
    from memlm.memory.faiss_backend import FaissMemory
    from memlm.memory.milvus_backend import MilvusMemory

__all__ = [
    "MemoryBackend",
    "MilvusURL",
    "Neighbours",
    "Provenance",
    "open_faiss",
    "open_milvus",
    "parse_memory_url",
]


def open_faiss(
    data_dir: Path, dim: int | None, *, readonly: bool = False, shared: bool = False
) -> FaissMemory:
    from memlm.memory.faiss_backend import FaissMemory

    return FaissMemory.open(data_dir, dim, readonly=readonly, shared=shared)


def open_milvus(url: MilvusURL | str, dim: int | None) -> MilvusMemory:
    """Connect to the collection (created, with a FLAT index, if it does not exist)."""
    from memlm.memory.milvus_backend import MilvusMemory

    parsed = parse_memory_url(url) if isinstance(url, str) else url
    if parsed is None:
        raise ValueError("not a milvus:// URL")
    return MilvusMemory(parsed, dim)
