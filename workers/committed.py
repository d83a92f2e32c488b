"""What the database committed, as the memory's rollback asks it (``memlm.memory.Committed``):
the worker answers from its repositories, the memory decides what to take out."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.orm import Session, sessionmaker

from memlm.db.repositories import DocumentRepository

# Document ids per query (SQLite binds at most 32,766 parameters in one statement).
BATCH = 1000


class DatabaseCommitted:
    """The committed documents of ``sessions``' database, as seen by worker ``worker``."""

    def __init__(self, sessions: sessionmaker[Session], worker: str) -> None:
        self.sessions = sessions
        self.worker = worker

    def end(self) -> int:
        with self.sessions() as s:
            return DocumentRepository(s).committed_end()

    def holds(self, doc_ids: Sequence[int]) -> set[int]:
        """Done documents, and those another worker claimed (its try may still commit;
        claims of dead workers are released before anything asks)."""
        out: set[int] = set()
        ids = [int(d) for d in doc_ids]
        for a in range(0, len(ids), BATCH):
            with self.sessions() as s:
                rows = DocumentRepository(s).many(ids[a : a + BATCH])
            out.update(
                d
                for d, row in rows.items()
                if row.status == "done"
                or (row.status == "processing" and row.claimed_by != self.worker)
            )
        return out
