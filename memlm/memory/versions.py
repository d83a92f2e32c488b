"""The build records every memory keeps under its ``root`` (memlm.index.versions: the
``v000042/`` directories and ``CURRENT``), what both backends do with them, and the
count of deleted documents of a memory that keeps no tombstones (Milvus)."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from memlm.datastore import atomic_write_text
from memlm.index.versions import (
    list_versions,
    newest_recorded,
    remove_orphan_versions,
)

# ``root/DELETED_FILE``: documents deleted so far, for a memory without tombstones
DELETED_FILE = "deleted-documents"


def reconcile_versions(
    root: Path, recorded: Collection[int], *, delete: bool
) -> tuple[list[int], int | None]:
    """The version directories no build record names (removed with ``delete``, and
    CURRENT pointed back), and the newest recorded one, which is to be served."""
    if delete:
        orphans = remove_orphan_versions(root, recorded)
    else:
        known = set(recorded)
        orphans = [v for v in list_versions(root) if v not in known]
    return orphans, newest_recorded(root, recorded)


class DeletedCount:
    """A count that only grows, in a file beside the version records: the documents this
    data directory's writers deleted from a memory that keeps no tombstones.

    Two writers adding at once may both write n + 1: the count then grew by one instead
    of two, which is all ``prune`` needs (more deletions than when a version was built).
    """

    def __init__(self, root: Path | None) -> None:
        self.path = None if root is None else Path(root) / DELETED_FILE
        self._value = 0  # without a root: this process's deletions

    @property
    def value(self) -> int:
        if self.path is None or not self.path.exists():
            return self._value
        text = self.path.read_text(encoding="utf-8").strip()
        return int(text) if text.isdigit() else self._value

    def add(self, n: int = 1) -> int:
        value = self.value + n
        self._value = value
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, f"{value}\n")
        return value
