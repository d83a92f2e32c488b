"""FAISS memory over a :class:`~memlm.datastore.Datastore`: built versions + a fresh part.

- :mod:`memlm.index.params`: :class:`IndexParams` (flat below 50k live entries, IVF-PQ
  above) and :class:`BuildInfo` (a version's ``meta.json``).
- :mod:`memlm.index.build`: :func:`build_index` trains once and then builds each
  version incrementally from the previous one (``remove_ids`` + ``add_with_ids``),
  retraining when the store grew 4x or when asked.
- :mod:`memlm.index.versions`: ``root/v000042`` directories, the atomic ``CURRENT``
  pointer, pruning and orphan removal.
- :mod:`memlm.index.search`: :class:`MemoryIndex`, the served version plus an exact
  fresh index over the entries appended since, with deletions filtered at search.
"""

from memlm.index.build import (
    BUILD_CRASH_POINTS,
    INCREMENTAL_CRASH_POINTS,
    build_index,
    retrain_reason,
)
from memlm.index.params import (
    CURRENT,
    FLAT_THRESHOLD,
    INDEX_FILE,
    META_FILE,
    RETRAIN_GROWTH,
    BuildInfo,
    IndexFormatError,
    IndexParams,
)
from memlm.index.search import BLAS_MIN_QUERIES, MemoryIndex
from memlm.index.versions import (
    current_version,
    list_versions,
    load_version,
    newest_recorded,
    prune,
    remove_orphan_versions,
)

__all__ = [
    "BLAS_MIN_QUERIES",
    "BUILD_CRASH_POINTS",
    "CURRENT",
    "FLAT_THRESHOLD",
    "INCREMENTAL_CRASH_POINTS",
    "INDEX_FILE",
    "META_FILE",
    "RETRAIN_GROWTH",
    "BuildInfo",
    "IndexFormatError",
    "IndexParams",
    "MemoryIndex",
    "build_index",
    "current_version",
    "list_versions",
    "load_version",
    "newest_recorded",
    "prune",
    "remove_orphan_versions",
    "retrain_reason",
]
