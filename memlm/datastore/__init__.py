"""Append-only on-disk kNN-LM datastore: float16 keys, int32 values and provenance.

Layout of a datastore directory::

    manifest.json            the only source of truth (see ``_Manifest``)
    LOCK                     flock held by the single writer process
    seg-000000.keys          float16 (count, dim), raw C order
    seg-000000.values        int32 (count,)     next-token ids
    seg-000000.doc_ids       int64 (count,)     provenance: document id
    seg-000000.positions     int32 (count,)     provenance: token position in the document
    seg-000000.days          int32 (count,)     provenance: day (e.g. days since 1970-01-01)
    seg-000001.*             ...

Every segment but the last covers exactly ``max_segment_entries`` ids, so a global
entry id maps to ``(id // max_segment_entries, id % max_segment_entries)``. Ids are
stable for the life of the store: compaction removes rows but never renumbers.

Deletion and compaction (forget)::

    tombstones               int64 (n,)  deleted document ids, an append-only log
    seg-000003-c000042.*     a compacted segment (written at generation 42) ...
    seg-000003-c000042.ids   int32 (rows,) ... with the in-segment offsets of its rows

``delete_document`` appends one id to the tombstone log and commits the new log length
in the manifest: a commit costs the same whatever the number of deleted documents, and
the manifest keeps the count of live entries, updated by each change from the rows it
touched only (an append's batch, a truncation's cut, a deleted document's entries).
``compact`` rewrites every segment holding rows of deleted documents without them, under
new file names, then commits the manifest that names the new files, then unlinks the old
ones (see :meth:`Datastore.compact` for why ids stay stable and how a crash is safe).
A compacted segment keeps its ids: its ``.ids`` column says which ids it still holds,
and an id it no longer holds reads as absent (``live_mask`` False; reading its key or
value is an error). New entries may still be appended to a compacted last segment.

Crash safety (single writer): an append writes the data files at the committed offsets,
fsyncs them, and only then replaces ``manifest.json`` (temp file + fsync + ``os.replace``
+ fsync of the directory). Whatever the manifest does not cover is uncommitted: the
writer's ``open`` cuts file tails beyond the committed counts and removes segment files
it does not list.

Reads go through ``np.memmap`` views of the committed prefix of each segment and always
return copies. Other processes open the store ``readonly=True`` and ``reload()`` the
manifest to see new commits; so that their maps stay valid, an open store never shrinks
a file (``truncate`` leaves the tail for the next writer ``open`` to cut).

Several writer processes (ingest workers sharing a data directory) open the store
``shared=True``: such a handle takes the ``LOCK`` only inside ``exclusive()``, where it
first reloads the manifest, so appends from different processes follow one another and
each starts at the committed end. A shared writer leaves file tails alone, as readers
do, and an exclusive writer (the default) keeps the others out for its whole life.

Modules, one responsibility each::

    layout.py     file names, columns, format version, crash points, the errors
    durable.py    directory fsync, atomic replace, the writer's flock
    manifest.py   ``manifest.json`` (``_Manifest``)
    segments.py   a handle's state and every read (``keys``, ``live_mask``, ``iter_chunks``...)
    recovery.py   committing the manifest, ``exclusive``, ``reload``, recovery at open
    writing.py    ``append``, ``truncate``
    forget.py     ``delete_document`` (tombstones), ``retire_entries`` (the retired log:
                  single entries consolidation retires), ``compact``
    store.py      :class:`Datastore` (all of the above) and ``Datastore.open``
"""

from memlm.datastore.durable import atomic_write_text, fsync_dir
from memlm.datastore.forget import Compaction
from memlm.datastore.layout import (
    COMPACT_CRASH_POINTS,
    CRASH_POINTS,
    DEFAULT_MAX_SEGMENT_ENTRIES,
    DELETE_CRASH_POINTS,
    FORMAT,
    FORMAT_VERSION,
    LOCK,
    MANIFEST,
    RETIRE_CRASH_POINTS,
    RETIRED,
    TOMBSTONES,
    DatastoreError,
    KeyPrecisionMismatch,
    SimulatedCrash,
)
from memlm.datastore.store import Datastore

__all__ = [
    "COMPACT_CRASH_POINTS",
    "CRASH_POINTS",
    "DEFAULT_MAX_SEGMENT_ENTRIES",
    "DELETE_CRASH_POINTS",
    "FORMAT",
    "FORMAT_VERSION",
    "LOCK",
    "MANIFEST",
    "RETIRED",
    "RETIRE_CRASH_POINTS",
    "TOMBSTONES",
    "Compaction",
    "Datastore",
    "DatastoreError",
    "KeyPrecisionMismatch",
    "SimulatedCrash",
    "atomic_write_text",
    "fsync_dir",
]
