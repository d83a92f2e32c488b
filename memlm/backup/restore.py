"""``memlm restore``: fill an empty data directory and an empty database from a backup.

Every byte is checked against the checksum the backup's manifest records before it is
trusted: the data files as they are copied, each table's file before its rows are
loaded. The rows are loaded in one transaction, after the files; a failure at any point
removes the files the restore wrote and rolls the rows back, so the target is empty
again and the restore can be run anew. The target must be empty to begin with: a restore
never merges into, or overwrites, a service's data.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from sqlalchemy import make_url
from sqlalchemy.orm import Session

from memlm.backup.errors import BackupCorrupt, BackupError, TargetNotEmpty
from memlm.backup.files import (
    Progress,
    check_entry,
    copy_stream,
    fsync_tree,
    hash_file,
    no_progress,
    require_empty_dir,
)
from memlm.backup.manifest import DATA, DB, BackupManifest
from memlm.datastore import Datastore
from memlm.db.dump import load_table, not_empty_reason, read_lines, reset_sequences, tables
from memlm.db.migrate import head_revision, upgrade
from memlm.db.repositories import DocumentRepository
from memlm.db.session import make_engine
from memlm.memory import parse_memory_url
from memlm.settings import Settings


def _own_sqlite_files(settings: Settings) -> frozenset[str]:
    """Names the data directory may already hold: the settings' own SQLite database (and
    its WAL files) when it lives there, as ``memlm db upgrade`` leaves a new one."""
    url = make_url(settings.db_url)
    if url.get_backend_name() != "sqlite" or not url.database:
        return frozenset()
    db = Path(url.database).resolve()
    if db.parent != settings.data_dir.resolve():
        return frozenset()
    return frozenset(db.name + suffix for suffix in ("", "-wal", "-shm", "-journal"))


def _check_backup(m: BackupManifest, src: Path, settings: Settings) -> None:
    backend = m.memory.get("backend")
    on_milvus = parse_memory_url(settings.memory_url) is not None
    if backend not in ("faiss", "milvus"):
        raise BackupError(f"{src}: a backup of a {backend} memory")
    if backend == "faiss" and on_milvus:
        raise BackupError(
            "MEMLM_MEMORY_URL names a Milvus collection, and this backup holds the embedded "
            "faiss memory: restore it with MEMLM_MEMORY_URL unset, then move it into "
            "Milvus with `memlm migrate-memory`"
        )
    if backend == "milvus" and not on_milvus:
        raise BackupError(
            "this backup holds the entries of a Milvus memory: set MEMLM_MEMORY_URL to a "
            "new (or empty) collection, milvus://host:port/collection"
        )
    if m.revision != head_revision():
        raise BackupError(
            f"{src}: the backup's tables are at migration {m.revision}, this memlm's are at "
            f"{head_revision()}: restore with the memlm that made it ({m.memlm_version}), "
            "then run this one's `memlm db upgrade`"
        )
    if set(m.tables) != {t.name for t in tables()}:
        raise BackupError(f"{src}: tables {sorted(m.tables)} are not this memlm's")
    missing = [rel for rel in m.files if not (src / rel).is_file()]
    if missing:
        raise BackupCorrupt(f"{src}: {len(missing)} files of the backup are missing: {missing[:5]}")


def restore(settings: Settings, src: Path, *, progress: Progress | None = None) -> BackupManifest:
    """Restore the backup at ``src`` into the data directory and database of ``settings``
    (both empty); returns the backup's manifest."""
    src = Path(src)
    m = BackupManifest.read(src)
    _check_backup(m, src, settings)
    data_dir = settings.data_dir
    own_db = _own_sqlite_files(settings)
    require_empty_dir(data_dir, "the data directory", own_db)
    target = _empty_collection(m, settings)
    engine = make_engine(settings.db_url)
    try:
        # (a SQLite file in a data directory not yet made does not exist yet: empty)
        reason = None if own_db and not data_dir.exists() else not_empty_reason(engine)
        if reason is not None:
            shown = engine.url.render_as_string(hide_password=True)
            raise TargetNotEmpty(
                f"the database {shown} cannot receive a restore: {reason}; give an empty "
                "database (or PostgreSQL schema)"
            )
        data_dir.mkdir(parents=True, exist_ok=True)
        upgrade(settings.db_url)
        before = {p.name for p in data_dir.iterdir()}
        try:
            _copy_files(m, src, data_dir, progress or no_progress)
            with engine.begin() as conn:
                for table in tables():
                    rel = f"{DB}/{table.name}.jsonl.gz"
                    check_entry(src / rel, m.files[rel], hash_file(src / rel))
                    with open(src / rel, "rb") as f:
                        loaded = load_table(conn, table, read_lines(f))
                    if loaded != m.tables[table.name]:
                        raise BackupCorrupt(
                            f"{src / rel}: {loaded} rows, the manifest records "
                            f"{m.tables[table.name]}"
                        )
                reset_sequences(conn)
                with Session(bind=conn) as s:
                    docs = DocumentRepository(s)
                    end, stored = docs.committed_end(), sum(docs.stored_by_document().values())
                if target is None:
                    _check_datastore(src, data_dir, end, m.memory["entries"])
                else:
                    from memlm.backup.milvus import import_entries

                    if import_entries(m, src, target) != stored:
                        raise BackupCorrupt(f"{src}: the documents done stored {stored} entries")
        except BaseException:
            for p in data_dir.iterdir():  # the target was empty: all of it is ours
                if p.name not in before:
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
            if target is not None:  # the collection was empty (or new) too
                target.drop()
            raise
    finally:
        engine.dispose()
        if target is not None:
            target.close()
    return m


def _empty_collection(m: BackupManifest, settings: Settings) -> Any:
    """The target collection of a Milvus backup (made when missing); refused unless empty."""
    url = parse_memory_url(settings.memory_url)
    if url is None:
        return None
    from memlm.memory import open_milvus

    target = open_milvus(url, int(m.memory["dim"]))
    held = target.count()
    if held:
        target.close()
        raise TargetNotEmpty(
            f"the Milvus collection {url.collection} holds {held} entries; give a new one"
        )
    return target


def _check_datastore(src: Path, data_dir: Path, end: int, entries: int) -> None:
    with Datastore.open(data_dir / "memory" / "datastore", readonly=True) as ds:
        if len(ds) != end or end != entries:
            raise BackupCorrupt(
                f"{src}: the datastore holds {len(ds)} entries, the committed documents own "
                f"{end}, the manifest records {entries}"
            )


def _copy_files(m: BackupManifest, src: Path, data_dir: Path, progress: Progress) -> None:
    prefix = f"{DATA}/"
    rels = sorted(rel for rel in m.files if rel.startswith(prefix))
    with progress("restore", sum(m.files[r].size for r in rels)) as advance:
        for rel in rels:
            target = data_dir / rel[len(prefix) :]
            with open(src / rel, "rb") as f:
                got = copy_stream(f, target, None, advance)
            check_entry(src / rel, m.files[rel], got)
    fsync_tree(data_dir)
