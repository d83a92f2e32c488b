"""``memlm backup``: a consistent snapshot of a running service, ingest paused a moment.

Every ingest worker appends a document's entries and commits the document in one step
under the datastore's write lock (``workers/ingest.py``), so whoever holds that lock sees
a datastore and a database that agree. The backup holds it only while it:

1. reads the datastore's manifest and opens every file it commits (an open file keeps
   its bytes: a later compaction unlinks the old segment files, a replace of
   ``lexical.npz`` makes a new file, and neither reaches what the backup reads), and
2. starts the database snapshot (its first query fixes what the whole dump sees) and
   reads the committed end and the recorded index versions there;

then releases it (milliseconds: ``BackupManifest.paused_ingest_seconds``) and copies
outside it. The index build lock is held around that moment and while the index
versions and the calibrator's files are opened (no build in progress changes them); it
stops builds and the last step of a forget, never an append.

Entries beyond the committed end (a worker killed between its append and its commit)
are cut from the copy, as the next worker start would cut them. On Milvus the memory is
the collection: see :mod:`memlm.backup.milvus`.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection
from sqlalchemy.orm import Session

import memlm
from memlm.backup.errors import BackupError
from memlm.backup.files import (
    HashingWriter,
    Progress,
    copy_stream,
    fsync_tree,
    hash_file,
    no_progress,
    require_empty_dir,
)
from memlm.backup.manifest import DATA, DB, BackupManifest, FileEntry
from memlm.datastore import LOCK, Datastore
from memlm.datastore import MANIFEST as DATASTORE_MANIFEST
from memlm.db.dump import dump_table, snapshot_engine, tables
from memlm.db.migrate import head_revision
from memlm.db.repositories import BuildRepository, DocumentRepository
from memlm.index import list_versions
from memlm.index.versions import version_name
from memlm.locks import FileLock, LockBusy
from memlm.memory import MilvusURL, parse_memory_url
from memlm.memory.versions import DELETED_FILE
from memlm.settings import Settings

# How often the backup tries the datastore's write lock: workers hold it a few ms per
# document and wait for it blocking, so a try finds it free between two of their steps.
_POLL = 0.005

# Files of the memory directory besides the datastore and the index versions.
LEXICAL = "lexical.npz"
TRAIN = "calibrator-train.npz"  # memlm.calibrator.heldout_set.TRAIN_FILE
PENDING = "calibrator-pending"  # memlm.calibrator.heldout.PENDING_DIR


@dataclass
class _Opened:
    """A file opened inside the snapshot, copied after it."""

    rel: str  # its path under the data directory (and under the backup's data/)
    f: IO[bytes]
    length: int | None  # committed bytes; None: the whole file


@dataclass
class _Snapshot:
    files: list[_Opened] = field(default_factory=list)
    datastore_manifest: str = ""
    entries: int = 0  # the datastore's committed length at the snapshot
    live: int = 0
    deleted_documents: int = 0
    dim: int = 0
    key_precision: str = ""
    committed_end: int = 0  # what the committed documents own (<= entries)
    versions: list[int] = field(default_factory=list)  # recorded and copied
    stored: dict[int, int] = field(default_factory=dict)  # Milvus: documents done, entries
    paused: float = 0.0


def _transient(rel: Path) -> bool:
    """A temp file or directory of an atomic write in progress (``.tmp-x``,
    ``lexical.tmp.npz``, ``.calibrator-x``): never part of a committed state."""
    return any(p.startswith(".") or ".tmp" in p for p in rel.parts)


def _acquire(lock: FileLock, wait: float, why: str, poll: float = _POLL) -> None:
    try:
        lock.acquire(timeout=wait, poll=poll)
    except LockBusy:
        raise BackupError(f"{why} held {lock.path} for more than {wait:g} s; try again") from None


def _open(snap: _Snapshot, root: Path, path: Path, length: int | None = None) -> None:
    snap.files.append(_Opened(path.relative_to(root).as_posix(), open(path, "rb"), length))  # noqa: SIM115


def _take_snapshot(
    conn: Connection,
    data_dir: Path,
    wait: float,
    while_paused: Callable[[], None] | None,
    on_milvus: bool,
) -> _Snapshot:
    from memlm.engine import BUILD_LOCK

    memory = data_dir / "memory"
    snap = _Snapshot()
    build = FileLock(memory / BUILD_LOCK)
    _acquire(build, wait, "an index build", poll=min(0.5, wait / 4))  # builds take minutes
    try:
        if on_milvus:  # no lock to take: the documents done now say what to export
            revision = MigrationContext.configure(conn).get_current_revision()
            with Session(bind=conn) as s:
                snap.stored = DocumentRepository(s).stored_by_document()
                # the build records (and the interpolation chosen beside each)
                recorded = BuildRepository(s).recorded_versions()
            if (memory / LEXICAL).exists():
                _open(snap, data_dir, memory / LEXICAL)
            if (memory / "index" / DELETED_FILE).exists():  # what prune compares with
                _open(snap, data_dir, memory / "index" / DELETED_FILE)
        else:
            revision, recorded = _pause_ingest(snap, conn, data_dir, wait, while_paused)
        if revision != head_revision():
            raise BackupError(
                f"the database is at migration {revision}, this memlm needs {head_revision()}:"
                " run `memlm db upgrade` (the service does not start before it either)"
            )
        root = memory / "index"
        snap.versions = [v for v in list_versions(root) if v in recorded]
        for v in snap.versions:
            for p in sorted((root / version_name(v)).rglob("*")):
                if p.is_file() and not _transient(p.relative_to(root)):
                    _open(snap, data_dir, p)
        if (memory / TRAIN).exists():
            _open(snap, data_dir, memory / TRAIN)
        if (memory / PENDING).is_dir():
            for p in sorted((memory / PENDING).iterdir()):
                if p.is_file() and not _transient(p.relative_to(memory)):
                    _open(snap, data_dir, p)
    finally:
        build.release()
    return snap


def _pause_ingest(
    snap: _Snapshot,
    conn: Connection,
    data_dir: Path,
    wait: float,
    while_paused: Callable[[], None] | None,
) -> tuple[str | None, set[int]]:
    """The moment under the datastore's write lock (see the module docstring); returns
    the database's migration revision and its recorded index versions."""
    memory = data_dir / "memory"
    ds_dir = memory / "datastore"
    writer = FileLock(ds_dir / LOCK)
    _acquire(writer, wait, "a datastore writer")
    t0 = time.monotonic()
    try:
        snap.datastore_manifest = (ds_dir / DATASTORE_MANIFEST).read_text(encoding="utf-8")
        with Datastore.open(ds_dir, readonly=True) as ds:
            for path, length in ds.committed_files():
                _open(snap, data_dir, path, length)
            snap.entries, snap.live, snap.dim = len(ds), ds.num_live, ds.dim
            snap.deleted_documents, snap.key_precision = ds.num_deleted_documents, ds.key_precision
        if (memory / LEXICAL).exists():  # updated with each append, under this lock
            _open(snap, data_dir, memory / LEXICAL)
        if while_paused is not None:  # tests: what others try while ingest is paused
            while_paused()
        # the snapshot's first query: from here on it sees this moment, whatever commits
        with Session(bind=conn) as s:
            snap.committed_end = DocumentRepository(s).committed_end()
    finally:
        writer.release()
        snap.paused = time.monotonic() - t0
    revision = MigrationContext.configure(conn).get_current_revision()
    with Session(bind=conn) as s:
        recorded = BuildRepository(s).recorded_versions()
    return revision, recorded


def backup(
    settings: Settings,
    dest: Path,
    *,
    wait: float = 600.0,
    progress: Progress | None = None,
    while_paused: Callable[[], None] | None = None,
) -> BackupManifest:
    """Write a consistent snapshot of the service of ``settings`` into ``dest`` (new or
    empty); returns its manifest (also written, last, as ``dest/backup.json``).

    ``wait``: seconds to wait for a running index build (or a compaction) to let go of
    its lock. ``while_paused`` (tests only) runs while the backup holds ingest paused.
    On Milvus the entries of the documents done are exported from the collection
    (:mod:`memlm.backup.milvus`).
    """
    dest = Path(dest)
    require_empty_dir(dest, "the backup destination")
    milvus = parse_memory_url(settings.memory_url)
    data_dir = settings.data_dir
    ds_dir = data_dir / "memory" / "datastore"
    if milvus is None and not (ds_dir / DATASTORE_MANIFEST).exists():
        raise BackupError(
            f"no datastore at {ds_dir}: nothing to back up (is MEMLM_DATA_DIR the service's?)"
        )
    progress = progress or no_progress
    db = snapshot_engine(settings.db_url)
    snap = _Snapshot()
    try:
        with db.connect() as conn, conn.begin():
            snap = _take_snapshot(conn, data_dir, wait, while_paused, milvus is not None)
            if snap.committed_end > snap.entries:
                raise BackupError(
                    f"the datastore holds {snap.entries} entries but the committed documents "
                    f"own {snap.committed_end}: the data directory {data_dir} is not the "
                    "database's"
                )
            created = dt.datetime.now(dt.UTC).isoformat()
            dest.mkdir(parents=True, exist_ok=True)
            files: dict[str, FileEntry] = {}
            counts: dict[str, int] = {}
            for table in tables():  # in the snapshot transaction: what the moment saw
                rel = f"{DB}/{table.name}.jsonl.gz"
                out = HashingWriter(dest / rel)
                try:
                    counts[table.name] = dump_table(conn, table, out)  # type: ignore[arg-type]
                finally:
                    files[rel] = out.close()
        total = sum(o.length if o.length is not None else _size(o.f) for o in snap.files)
        with progress("backup", total) as advance:
            for o in snap.files:
                files[f"{DATA}/{o.rel}"] = copy_stream(o.f, dest / DATA / o.rel, o.length, advance)
    finally:
        for o in snap.files:
            o.f.close()
        db.dispose()
    if milvus is None:
        memory = _finish_faiss(dest, snap, files)
    else:
        memory = _export_milvus(dest, snap, files, milvus, progress)
    fsync_tree(dest)
    manifest = BackupManifest(
        created_at=created,
        memlm_version=memlm.__version__,
        revision=head_revision() or "",
        dialect=db.dialect.name,
        tables=counts,
        memory=memory,
        paused_ingest_seconds=snap.paused,
        files=files,
    )
    manifest.write(dest)
    return manifest


def _finish_faiss(dest: Path, snap: _Snapshot, files: dict[str, FileEntry]) -> dict[str, Any]:
    """The pointer files, the cut of an uncommitted tail; the manifest's memory part."""
    files.update(_write_pointers(dest, snap))
    ds_copy = dest / DATA / "memory" / "datastore"
    if snap.entries > snap.committed_end:
        _cut(ds_copy, snap.committed_end)
        prefix = ds_copy.relative_to(dest).as_posix() + "/"
        for rel in [r for r in files if r.startswith(prefix)]:
            del files[rel]
        files.update({p.relative_to(dest).as_posix(): hash_file(p) for p in ds_copy.iterdir()})
    with Datastore.open(ds_copy, readonly=True) as ds:
        live = ds.num_live
    return {
        "backend": "faiss",
        "entries": snap.committed_end,
        "live_entries": live,
        "deleted_documents": snap.deleted_documents,
        "dim": snap.dim,
        "key_precision": snap.key_precision,
        "index_version": snap.versions[-1] if snap.versions else None,
    }


def _export_milvus(
    dest: Path, snap: _Snapshot, files: dict[str, FileEntry], url: MilvusURL, progress: Progress
) -> dict[str, Any]:
    from memlm.backup.milvus import export_entries
    from memlm.memory import open_milvus

    memory = open_milvus(url, None)
    try:
        with progress("export", 0) as advance:
            parts, n = export_entries(memory, snap.stored, dest, advance)
        dim = memory.dim
    finally:
        memory.close()
    files.update(parts)
    files.update(_write_pointers(dest, snap, datastore=False))
    return {
        "backend": "milvus",
        "entries": n,
        "live_entries": n,
        "documents": len(snap.stored),
        "dim": dim,
        "collection": url.collection,
        "index_version": snap.versions[-1] if snap.versions else None,
    }


def _size(f: IO[bytes]) -> int:
    return os.fstat(f.fileno()).st_size


def _write_pointers(dest: Path, snap: _Snapshot, *, datastore: bool = True) -> dict[str, FileEntry]:
    """The datastore's manifest as the snapshot read it (``datastore``), and CURRENT naming
    the newest recorded version (a version built but never recorded is an orphan: not
    copied)."""
    out: dict[str, FileEntry] = {}
    memory = f"{DATA}/memory"
    texts = (
        {f"{memory}/datastore/{DATASTORE_MANIFEST}": snap.datastore_manifest} if datastore else {}
    )
    if snap.versions:
        texts[f"{memory}/index/CURRENT"] = version_name(snap.versions[-1]) + "\n"
    for rel, body in texts.items():
        w = HashingWriter(dest / rel)
        w.write(body.encode("utf-8"))
        out[rel] = w.close()
    return out


def _cut(ds_copy: Path, end: int) -> None:
    """Cut the copied datastore to the committed end with the datastore's own truncate
    (and the tail cut of its next exclusive writer's open)."""
    with Datastore.open(ds_copy) as ds:
        ds.truncate(end)
    Datastore.open(ds_copy).close()
    (ds_copy / LOCK).unlink()
