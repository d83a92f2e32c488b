"""``backup.json``: what a backup holds, with the size and SHA-256 of every file.

Written last, atomically: a directory without it is not a (complete) backup.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from memlm.backup.errors import BackupError
from memlm.datastore import atomic_write_text

MANIFEST = "backup.json"
FORMAT = "memlm-backup"
FORMAT_VERSION = 1
DATA = "data"  # files of the data directory, at their paths under it
DB = "db"  # the database's tables, one gzipped JSON-lines file each


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass
class BackupManifest:
    """What a backup holds; ``files`` maps each path (POSIX, under the backup) to its
    size and checksum, which restore verifies before it trusts a byte."""

    created_at: str  # ISO 8601, UTC: the moment of the snapshot
    memlm_version: str
    revision: str  # the database's migration: restore needs the same head
    dialect: str  # where the tables came from (sqlite, postgresql); either restores
    tables: dict[str, int]  # rows per table
    # backend ("faiss"), entries (= the committed documents' end), live_entries,
    # deleted_documents, dim, key_precision, index_version (served; None before a build)
    memory: dict[str, Any]
    paused_ingest_seconds: float  # how long the datastore's write lock was held
    files: dict[str, FileEntry] = field(default_factory=dict)

    def write(self, dest: Path) -> None:
        body = {"format": FORMAT, "format_version": FORMAT_VERSION, **asdict(self)}
        atomic_write_text(Path(dest) / MANIFEST, json.dumps(body, indent=1, sort_keys=True))

    @classmethod
    def read(cls, src: Path) -> BackupManifest:
        path = Path(src) / MANIFEST
        if not path.is_file():
            raise BackupError(
                f"{src} is not a memlm backup: it has no {MANIFEST} (a backup that did not "
                "finish writes none)"
            )
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            if raw.pop("format") != FORMAT or raw.pop("format_version") != FORMAT_VERSION:
                raise BackupError(f"{path}: not a {FORMAT} v{FORMAT_VERSION} manifest")
            raw["files"] = {k: FileEntry(**v) for k, v in raw["files"].items()}
            return cls(**raw)
        except (KeyError, TypeError, ValueError) as exc:
            raise BackupError(f"{path}: malformed backup manifest: {exc}") from exc
