"""Copy an embedded faiss memory (``<data dir>/memory/datastore``) into a Milvus collection.

Live entries only (forgotten documents stay behind), with their values and provenance;
the Milvus ids are the deterministic ``doc_id * 2**24 + position``, so a second run
replaces instead of duplicating. Stop the ingest workers first: entries appended during
the copy are not moved (the final count check catches them).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from memlm.datastore import Datastore
from memlm.memory.milvus_backend import MilvusMemory


class MigrationMismatch(RuntimeError):
    """After the copy, Milvus does not hold exactly the datastore's live entries."""


@dataclass(frozen=True)
class Migration:
    source_entries: int  # live entries of the datastore
    copied: int
    target_entries: int  # what the collection holds afterwards
    seconds: float
    build: dict[str, object] | None


def migrate_faiss_to_milvus(
    datastore_dir: Path,
    target: MilvusMemory,
    *,
    chunk: int = 65536,
    build: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> Migration:
    """Copy every live entry of the datastore into ``target``; verify the counts."""
    t0 = time.perf_counter()
    ds = Datastore.open(Path(datastore_dir), dim=None, readonly=True)
    try:
        if ds.dim != target.dim:
            raise ValueError(f"datastore dim {ds.dim} != collection dim {target.dim}")
        if target.count():
            raise MigrationMismatch(
                f"collection {target.url} already holds {target.count()} entries; "
                "migrate into a new collection"
            )
        source = ds.num_live
        end = len(ds)
        copied = 0
        for first, keys, values in ds.iter_chunks(0, end, chunk=chunk):
            ids = np.arange(first, first + len(keys), dtype=np.int64)
            live = ds.live_mask(ids)
            if not live.any():
                continue
            docs, pos, days = ds.provenance(ids[live])
            target.upsert(keys[live].astype(np.float32), values[live], docs, pos, days)
            copied += int(live.sum())
            if progress is not None:
                progress(copied, source)
        info = target.build_index() if build else None
        held = target.count()
        if copied != source or held != source:
            raise MigrationMismatch(
                f"datastore holds {source} live entries, {copied} were copied and the "
                f"collection holds {held} (was a worker writing?)"
            )
        return Migration(source, copied, held, time.perf_counter() - t0, info)
    finally:
        ds.close()
