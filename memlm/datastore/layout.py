"""The datastore directory's names, columns and crash points, and its two errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

MANIFEST = "manifest.json"
LOCK = "LOCK"  # flock of the writer (for its life, or a shared writer's exclusive())
TOMBSTONES = "tombstones"  # int64 log of deleted document ids; the manifest commits its length
# int64 (entry id, generation of its commit) pairs of entries that consolidation retired;
# the manifest commits the number of pairs
RETIRED = "retired"
FORMAT = "memlm-datastore"
# 2: tombstone log, live count, compacted segments. A v1 manifest (deleted documents
# listed inline) is read, and the first writer open rewrites it as v2.
FORMAT_VERSION = 2
# 1M entries per segment: 1.1 GB of keys at d=576, small enough to copy or rsync one file
# at a time, large enough that a 10M-entry store has only 10 segments (50 files).
DEFAULT_MAX_SEGMENT_ENTRIES = 1_000_000

# Names of the points where ``append(crash_at=...)`` raises ``SimulatedCrash``, in order.
CRASH_POINTS = (
    "before_data",  # nothing written yet
    "mid_data",  # keys and values written, provenance not yet
    "after_data",  # all data files written and fsynced, manifest untouched
    "before_manifest",  # new manifest in its temp file, not yet renamed
    "after_manifest",  # manifest renamed: the append is committed, directory not fsynced
)
# Where ``compact(crash_at=...)`` raises ``SimulatedCrash``, in order.
COMPACT_CRASH_POINTS = (
    "mid_files",  # the first rewritten segment's files written, the others not yet
    "after_files",  # every new file written and fsynced, manifest untouched
    "before_manifest",  # new manifest in its temp file, not yet renamed
    "after_manifest",  # committed: the new files are served, the old ones not yet unlinked
)
# Where ``delete_document(crash_at=...)`` raises ``SimulatedCrash``.
DELETE_CRASH_POINTS = (
    "after_log",  # the id written to the tombstone log, manifest untouched
    "before_manifest",
    "after_manifest",
)
# Where ``retire_entries(crash_at=...)`` raises ``SimulatedCrash``.
RETIRE_CRASH_POINTS = DELETE_CRASH_POINTS
# Rows copied per step of a compaction: 64k keys at d=576 is 72 MB of float16.
_COMPACT_CHUNK = 65536

# (suffix, dtype) of the per-entry columns; keys are handled apart because of their width.
_COLUMNS: tuple[tuple[str, np.dtype[Any]], ...] = (
    ("values", np.dtype(np.int32)),
    ("doc_ids", np.dtype(np.int64)),
    ("positions", np.dtype(np.int32)),
    ("days", np.dtype(np.int32)),
)
_KEYS_DTYPE = np.dtype(np.float16)
_IDS_DTYPE = np.dtype(np.int32)  # a compacted segment's in-segment offsets (< 2**31)


class DatastoreError(ValueError):
    """Bad input to the datastore, or a datastore directory that is not valid."""


class KeyPrecisionMismatch(DatastoreError):
    """The store's keys were made in another encoder precision than the one opening it."""

    def __init__(self, path: Path, stored: str, wanted: str) -> None:
        self.stored, self.wanted = stored, wanted
        super().__init__(
            f"{path}: the datastore's keys were made with the encoder in {stored}, and this "
            f"encoder runs in {wanted}. Keys of two precisions are two key spaces: searching "
            f"or extending one with the other would silently mix them, so the store is not "
            f"opened. Serve it with MEMLM_PRECISION={stored} (or auto, which follows an "
            f"existing datastore), or re-encode: start a new data directory with "
            f"MEMLM_PRECISION={wanted} and ingest the documents again."
        )


class SimulatedCrash(RuntimeError):
    """Raised at a ``crash_at`` point to simulate the process dying there."""


def _check_crash(crash_at: str | None, point: str) -> None:
    if crash_at == point:
        raise SimulatedCrash(point)


def _segment_name(i: int) -> str:
    return f"seg-{i:06d}"


def _dtype(column: str) -> np.dtype[Any]:
    if column == "keys":
        return _KEYS_DTYPE
    return _IDS_DTYPE if column == "ids" else dict(_COLUMNS)[column]
