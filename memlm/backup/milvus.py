"""The entries of a Milvus memory in a backup: exported from the collection, upserted
into a new one at restore.

Milvus has no write lock to pause ingest with; its writes are idempotent per document
instead (a document's entries are replaced whole under deterministic ids, then the
document commits). So the backup reads the documents done in its database snapshot,
then exports exactly their entries: a document committed after the snapshot is left out
(pending again after a restore, ingested again), and one whose entries no longer match
what its commit recorded (forgotten meanwhile) makes the backup fail, to be run again.
Keys are exported in float32, as the collection holds them: a restored collection
answers the same searches.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from memlm.backup.errors import BackupCorrupt, BackupError
from memlm.backup.files import Advance, check_entry, hash_file
from memlm.backup.manifest import BackupManifest, FileEntry

EXPORT = "milvus"  # the parts under the backup: milvus/part-000000.npz ...
_PART_ROWS = 65536  # entries a part: 151 MB of float32 keys at d=576
_COLUMNS = ("keys", "values", "doc_ids", "positions", "days")


def _write_part(dest: Path, n: int, parts: list[tuple[np.ndarray, ...]]) -> tuple[str, FileEntry]:
    rel = f"{EXPORT}/part-{n:06d}.npz"
    path = dest / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    keys, values, doc_ids, positions, days = (
        np.concatenate([p[i] for p in parts]) for i in range(len(_COLUMNS))
    )
    with open(path, "xb") as f:  # the names are _COLUMNS
        np.savez(f, keys=keys, values=values, doc_ids=doc_ids, positions=positions, days=days)
        f.flush()
        os.fsync(f.fileno())
    return rel, hash_file(path)


def export_entries(
    memory: Any, stored: dict[int, int], dest: Path, advance: Advance
) -> tuple[dict[str, FileEntry], int]:
    """Export the entries of the documents in ``stored`` (document -> entries its commit
    recorded); returns the part files and the entries exported."""
    done = np.array(sorted(stored), np.int64)
    found: Counter[int] = Counter()
    files: dict[str, FileEntry] = {}
    buf: list[tuple[np.ndarray, ...]] = []
    rows = total = 0
    for page in memory.entries():
        keep = np.isin(page[2], done)
        if not keep.any():
            continue
        part = tuple(c[keep] for c in page)
        found.update(part[2].tolist())
        buf.append(part)
        rows += int(keep.sum())
        if rows >= _PART_ROWS:
            rel, entry = _write_part(dest, len(files), buf)
            files[rel] = entry
            advance(entry.size)
            total, rows, buf = total + rows, 0, []
    if buf:
        rel, entry = _write_part(dest, len(files), buf)
        files[rel] = entry
        advance(entry.size)
        total += rows
    changed = sorted(d for d, n in stored.items() if found[d] != n)
    if changed:
        raise BackupError(
            f"{len(changed)} documents done in the backup's snapshot hold other entries in "
            f"Milvus now (forgotten during the backup?), e.g. {changed[:5]}: run it again"
        )
    return files, total


def import_entries(m: BackupManifest, src: Path, target: Any) -> int:
    """Upsert the backup's exported entries into ``target``, index it, check the count."""
    rels = sorted(r for r in m.files if r.startswith(f"{EXPORT}/"))
    for rel in rels:
        check_entry(src / rel, m.files[rel], hash_file(src / rel))
        with np.load(src / rel) as z:
            target.upsert(*(z[c] for c in _COLUMNS))
    target.build_index()
    held = int(target.count())
    if held != m.memory["entries"]:
        raise BackupCorrupt(
            f"{src}: the collection holds {held} entries after the restore, the backup "
            f"{m.memory['entries']}"
        )
    return held
