"""Version directories under an index root: ``v000042/{index.faiss,meta.json}``, the
``CURRENT`` pointer, publishing a build atomically, pruning and orphan removal."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Collection
from pathlib import Path

import faiss

from memlm.datastore import SimulatedCrash, atomic_write_text, fsync_dir
from memlm.index.params import CURRENT, INDEX_FILE, META_FILE, BuildInfo, IndexFormatError


def version_name(version: int) -> str:
    return f"v{version:06d}"


def list_versions(root: Path) -> list[int]:
    """Complete version directories under ``root``, ascending."""
    if not root.exists():
        return []
    out = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith("v") and p.name[1:].isdigit():
            out.append(int(p.name[1:]))
    return sorted(out)


def current_version(root: Path) -> int | None:
    """The version ``root/CURRENT`` names, or None before the first build."""
    cur = Path(root) / CURRENT
    if not cur.exists():
        return None
    name = cur.read_text(encoding="utf-8").strip()
    if not (name.startswith("v") and name[1:].isdigit()):
        raise IndexFormatError(f"{cur}: malformed content {name!r}")
    return int(name[1:])


def next_version(root: Path) -> int:
    versions = list_versions(root)
    cur = current_version(root)
    return max([0, *versions, *([cur] if cur is not None else [])]) + 1


def prune(root: Path, keep: int = 3, *, deleted_documents: int | None = None) -> list[Path]:
    """Delete all but the newest ``keep`` versions (never CURRENT's) and stale tmp dirs.

    ``deleted_documents`` (the datastore's count now): also delete every version built
    when fewer documents were deleted, since it still holds a forgotten document's keys
    (codes, or float32 keys in a flat index) and lexical statistics. A version whose
    meta cannot be read counts as such. Only call it from the single builder: a tmp dir
    of a build in progress would go too.
    """
    root = Path(root)
    cur = current_version(root)
    versions = list_versions(root)
    doomed = [v for v in versions[: max(0, len(versions) - keep)] if v != cur]
    if deleted_documents:
        for v in versions:
            if v == cur or v in doomed:
                continue
            try:
                built_with = BuildInfo.read(root / version_name(v)).deleted_documents
            except (OSError, ValueError, TypeError):
                built_with = -1
            if built_with < deleted_documents:
                doomed.append(v)
    removed = [root / version_name(v) for v in doomed]
    removed += [p for p in root.iterdir() if p.name.startswith("tmp-")] if root.exists() else []
    for p in removed:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    if removed:
        fsync_dir(root)
    return removed


def newest_recorded(root: Path, recorded: Collection[int]) -> int | None:
    """The newest version directory under ``root`` that the build records vouch for."""
    kept = [v for v in list_versions(Path(root)) if v in set(recorded)]
    return max(kept) if kept else None


def remove_orphan_versions(root: Path, recorded: Collection[int]) -> list[int]:
    """Delete version directories that no build record names; point CURRENT at the newest
    recorded one (remove it when there is none). Returns the deleted versions, ascending.

    An orphan is a build killed after writing its directory (or CURRENT) and before the
    database recorded it: its request is still marked running and is built again. Only
    the single builder may call this, holding the build lock (a build in progress has an
    unrecorded directory too).
    """
    root = Path(root)
    orphans = [v for v in list_versions(root) if v not in set(recorded)]
    keep = newest_recorded(root, recorded)
    cur = root / CURRENT
    if keep is None:
        if cur.exists():
            cur.unlink()
    elif current_version(root) != keep:
        atomic_write_text(cur, version_name(keep) + "\n")
    for v in orphans:  # CURRENT no longer names them: a crash here leaves only orphans
        shutil.rmtree(root / version_name(v))
    if root.exists():
        fsync_dir(root)
    return orphans


# MEMLM_PQ_TABLE_MB: the largest IVF-PQ precomputed distance table a served index keeps.
PQ_TABLE_MB_DEFAULT = 1024


def pq_table_max_bytes() -> int:
    """The table budget in bytes, from ``MEMLM_PQ_TABLE_MB`` (0: never keep one)."""
    raw = os.environ.get("MEMLM_PQ_TABLE_MB", "").strip()
    try:
        mb = int(raw) if raw else PQ_TABLE_MB_DEFAULT
    except ValueError:
        raise ValueError(f"MEMLM_PQ_TABLE_MB must be a whole number of MB, got {raw!r}") from None
    if mb < 0:
        raise ValueError(f"MEMLM_PQ_TABLE_MB must be >= 0, got {mb}")
    return mb << 20


def pq_table_bytes(index: faiss.Index) -> int:
    """Bytes of IVF-PQ's precomputed distance table (nlist * m * 2^nbits floats); 0
    for other indexes."""
    if not isinstance(index, faiss.IndexIVFPQ):
        return 0
    return int(index.nlist) * int(index.pq.M) * int(index.pq.ksub) * 4


def read_index(path: Path, table_max_bytes: int = 0) -> faiss.Index:
    """Read an index file; keep IVF-PQ's precomputed distance table only if it fits in
    ``table_max_bytes``.

    The table is nlist * m * 256 floats: 201 MB at 4096 lists and 48-byte codes (200 B
    per entry at 1M, more than the codes), 403 MB at 8192 lists.  Without it a search
    computes the tables of the lists it probes (~0.15 MFLOP each): the same neighbours at
    1.10-1.43x the search time (`python benchmarks/bench_index.py --search-paths`).  An index
    read to be extended (an incremental build) never needs it.
    """
    index = faiss.read_index(str(path), faiss.IO_FLAG_SKIP_PRECOMPUTE_TABLE)
    if isinstance(index, faiss.IndexIVFPQ):
        size = pq_table_bytes(index)
        use = index.by_residual and 0 < size <= table_max_bytes
        index.use_precomputed_table = 1 if use else -1
        if use:
            index.precompute_table()
    return index


def load_version(root: Path, version: int) -> tuple[faiss.Index, BuildInfo]:
    """Read one version's index and metadata, checking that they agree."""
    vdir = Path(root) / version_name(version)
    info = BuildInfo.read(vdir)
    index = read_index(vdir / INDEX_FILE, pq_table_max_bytes())
    if index.ntotal != info.entries or index.d != info.dim:
        raise IndexFormatError(
            f"{vdir}: index has {index.ntotal} x {index.d}, meta says {info.entries} x {info.dim}"
        )
    return index, info


def publish(root: Path, index: faiss.Index | None, info: BuildInfo, crash_at: str | None) -> None:
    """Write ``index`` and ``info`` into ``root/tmp-...``, fsync, rename it to
    ``info.path`` and atomically point CURRENT at it. A crash at any step leaves CURRENT
    naming the old version (or, after the last rename, the new one, complete).

    ``index`` None: a record only (a memory whose index lives elsewhere, Milvus)."""
    tmp = root / f"tmp-{info.path.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    names = [META_FILE]
    if index is not None:
        faiss.write_index(index, str(tmp / INDEX_FILE))
        names.append(INDEX_FILE)
    (tmp / META_FILE).write_text(json.dumps(info.to_json(), indent=1), encoding="utf-8")
    for name in names:
        with open(tmp / name, "rb") as f:
            os.fsync(f.fileno())
    fsync_dir(tmp)
    if crash_at == "after_write":
        raise SimulatedCrash(crash_at)
    os.replace(tmp, info.path)
    fsync_dir(root)
    if crash_at == "after_rename":
        raise SimulatedCrash(crash_at)
    atomic_write_text(
        root / CURRENT,
        version_name(info.version) + "\n",
        crash_at="before_current" if crash_at == "before_current" else None,
    )
