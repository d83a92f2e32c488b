"""Documents: accepting (deduplicated by content hash), claiming, finishing, failing,
forgetting; every status change is a compare-and-set."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from memlm.db.errors import Conflict, NotFound
from memlm.db.models import Document
from memlm.db.repositories.common import content_hash, utcnow
from memlm.db.repositories.spans import SpanRepository
from memlm.db.session import is_postgres

# Statuses under a worker's claim: processing, or forgetting while the try still runs.
_CLAIMED = ("processing", "forgetting")


@dataclass(frozen=True)
class NewDocument:
    text: str
    published_at: dt.date
    source: str
    external_id: str | None = None
    title: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Accepted:
    id: int
    status: str
    duplicate: bool


class DocumentRepository:
    """Documents: ingestion with deduplication, the worker's queue, and results."""

    def __init__(self, session: Session) -> None:
        self.s = session

    def add_many(self, docs: Iterable[NewDocument]) -> list[Accepted]:
        """Insert documents as pending; a duplicate (same source and external id, or same
        text) is not inserted and answers the existing document's id and status."""
        out = []
        for d in docs:
            digest = content_hash(d.text)
            existing = self._find_duplicate(d.source, d.external_id, digest)
            if existing is None:
                row = Document(
                    source=d.source,
                    external_id=d.external_id,
                    title=d.title,
                    text=d.text,
                    content_hash=digest,
                    published_at=d.published_at,
                    meta=dict(d.metadata),
                    status="pending",
                )
                try:
                    # A savepoint, so a concurrent insert of the same document only costs
                    # this one row and the lookup below finds the winner.
                    with self.s.begin_nested():
                        self.s.add(row)
                except IntegrityError:
                    existing = self._find_duplicate(d.source, d.external_id, digest)
                    if existing is None:
                        raise
                else:
                    out.append(Accepted(row.id, row.status, duplicate=False))
                    continue
            out.append(Accepted(existing.id, existing.status, duplicate=True))
        return out

    def _find_duplicate(self, source: str, external_id: str | None, digest: str) -> Document | None:
        if external_id is not None:
            q = select(Document).where(
                Document.source == source, Document.external_id == external_id
            )
            hit = self.s.scalars(q).first()
            if hit is not None:
                return hit
        return self.s.scalars(select(Document).where(Document.content_hash == digest)).first()

    def get(self, doc_id: int) -> Document:
        doc = self.s.get(Document, doc_id)
        if doc is None:
            raise NotFound(f"document {doc_id} does not exist")
        return doc

    def many(self, ids: Iterable[int]) -> dict[int, Document]:
        ids = sorted(set(ids))
        if not ids:
            return {}
        return {d.id: d for d in self.s.scalars(select(Document).where(Document.id.in_(ids)))}

    # --- the worker's queue -----------------------------------------------------------------
    #
    # Every status change is a compare-and-set: an UPDATE guarded by the statuses (and, for
    # a worker's result, the claimant) it may leave, whose row count says whether it won.
    # A read followed by an unguarded write lets a claim committed in between be
    # overwritten (PostgreSQL runs READ COMMITTED; SQLite escapes only by BEGIN IMMEDIATE).

    def _move(self, doc_id: int, from_: Sequence[str], *where: Any, **values: Any) -> bool:
        """Set ``values`` on the document if its status is in ``from_`` (and ``where``)."""
        res = self.s.execute(
            update(Document)
            .where(Document.id == doc_id, Document.status.in_(list(from_)), *where)
            .values(**values)
        )
        return int(res.rowcount) == 1  # type: ignore[attr-defined]

    def _settle(self, doc_id: int, worker: str, **values: Any) -> bool:
        """A worker's result for its claim: applied only while the claim is still its own.

        False when the claim was taken away meanwhile. A forget that arrived during the
        try made the document ``forgetting`` under the same claimant: the forget is handed
        to the forget queue here (``claimed_by`` cleared), so it runs once this try's
        side effects are all done (the engine counted and recorded the document before the
        worker settles) and none of them can come after it.
        """
        mine = Document.claimed_by == worker
        if self._move(doc_id, ("processing",), mine, **values):
            return True
        self._move(doc_id, ("forgetting",), mine, claimed_by=None)
        return False

    def claim_next(self, worker: str) -> Document | None:
        """Mark the earliest pending document as processing by ``worker`` and return it.

        The try is counted here, in the claim's transaction (``attempts`` + 1): a worker
        that dies during it (SIGKILL, out of memory) cannot leave it uncounted, so a
        document that kills every worker fails after the last try instead of looping.

        PostgreSQL: ``FOR UPDATE SKIP LOCKED`` so concurrent workers never wait for or take
        the same row. SQLite serialises writers; the guarded UPDATE below makes the claim a
        compare-and-set there too.
        """
        now = utcnow()
        q = (
            select(Document.id)
            .where(
                Document.status == "pending",
                or_(Document.retry_at.is_(None), Document.retry_at <= now),
            )
            .order_by(Document.published_at, Document.id)
            .limit(1)
        )
        if is_postgres(self.s):
            q = q.with_for_update(skip_locked=True)
        doc_id = self.s.scalar(q)
        if doc_id is None:
            return None
        claimed = self._move(
            doc_id,
            ("pending",),
            status="processing",
            claimed_by=worker,
            claimed_at=now,
            attempts=Document.attempts + 1,
        )
        return self._fresh(doc_id) if claimed else None

    def _fresh(self, doc_id: int) -> Document:
        """The row as committed now, not as this session's identity map last saw it."""
        doc = self.s.get(Document, doc_id, populate_existing=True)
        if doc is None:
            raise NotFound(f"document {doc_id} does not exist")
        return doc

    def claimants(self) -> list[str]:
        """The workers that hold claims now (documents processing, or being forgotten while
        their try runs)."""
        q = (
            select(Document.claimed_by)
            .where(Document.status.in_(_CLAIMED), Document.claimed_by.is_not(None))
            .distinct()
        )
        return sorted(str(n) for n in self.s.scalars(q))

    def release_claims(self, workers: Sequence[str], *, max_attempts: int, cause: str) -> int:
        """Put the claims of these workers, whose tries ended without a result, back.

        A processing document goes back to ``pending`` with ``cause`` as its error; its
        try was counted at the claim, so the one that was its last (``max_attempts``)
        fails it instead: a document that kills its worker every time does not loop. A
        document forgotten during the try goes to the forget queue. Returns how many
        documents went back to ``pending``.
        """
        if not workers:
            return 0
        names = list(workers)
        q = select(Document.id, Document.attempts).where(
            Document.status == "processing", Document.claimed_by.in_(names)
        )
        released = 0
        for doc_id, attempts in self.s.execute(q).all():
            tries = int(attempts or 0)
            mine = Document.claimed_by.in_(names)
            if tries >= max_attempts:
                reason = f"{cause} during try {tries} of {max_attempts}; no tries left"
                self._move(
                    doc_id,
                    ("processing",),
                    mine,
                    status="failed",
                    error=reason,
                    retry_at=None,
                    processed_at=utcnow(),
                )
            else:
                reason = f"{cause} during try {tries} of {max_attempts}"
                released += self._move(
                    doc_id,
                    ("processing",),
                    mine,
                    status="pending",
                    error=reason,
                    claimed_by=None,
                    claimed_at=None,
                )
        self.s.execute(
            update(Document)
            .where(Document.status == "forgetting", Document.claimed_by.in_(names))
            .values(claimed_by=None)
        )
        return released

    def release(self, doc_id: int, worker: str) -> bool:
        """Give a claimed document back to the queue (its try stays counted)."""
        return self._settle(doc_id, worker, status="pending", claimed_by=None, claimed_at=None)

    def committed_end(self) -> int:
        """End of the datastore prefix owned by committed documents."""
        owners = ("done", "forgetting", "forgotten")
        q = select(func.max(Document.entry_end)).where(Document.status.in_(owners))
        return int(self.s.scalar(q) or 0)

    def stored_by_document(self) -> dict[int, int]:
        """Entries stored of each document done (a Milvus backup checks its export)."""
        q = select(Document.id, Document.tokens_stored).where(Document.status == "done")
        return {int(i): int(n or 0) for i, n in self.s.execute(q)}

    def mark_done(
        self,
        doc_id: int,
        worker: str,
        *,
        policy: str,
        tokens_seen: int,
        tokens_stored: int,
        entry_start: int | None,
        entry_end: int | None,
    ) -> bool:
        """Record ``worker``'s result; False (nothing written) when its claim was taken
        away meanwhile (a forget arrived): the caller must then discard its entries.

        ``attempts`` counts failed tries: the claim counted this one, which succeeded.
        """
        return self._settle(
            doc_id,
            worker,
            status="done",
            error=None,
            retry_at=None,
            attempts=Document.attempts - 1,
            policy=policy,
            tokens_seen=tokens_seen,
            tokens_stored=tokens_stored,
            entry_start=entry_start,
            entry_end=entry_end,
            processed_at=utcnow(),
        )

    def mark_failed(self, doc_id: int, worker: str, reason: str) -> bool:
        """A failed try that is the last one: the document stays failed until retried.
        False when the claim was taken away meanwhile (see :meth:`mark_done`)."""
        return self._settle(
            doc_id,
            worker,
            status="failed",
            error=reason[:2000],
            retry_at=None,
            processed_at=utcnow(),
        )

    def retry_later(self, doc_id: int, worker: str, reason: str, at: dt.datetime) -> bool:
        """A failed try with tries left: back in the queue, claimable from ``at``.
        False when the claim was taken away meanwhile (see :meth:`mark_done`)."""
        return self._settle(
            doc_id,
            worker,
            status="pending",
            error=reason[:2000],
            retry_at=at,
            claimed_by=None,
            claimed_at=None,
        )

    def requeue_failed(self, doc_id: int) -> Document:
        """Put a failed document back in the queue with its tries counted from zero."""
        requeued = self._move(
            doc_id,
            ("failed",),
            status="pending",
            attempts=0,
            error=None,
            retry_at=None,
            processed_at=None,
            claimed_by=None,
            claimed_at=None,
        )
        doc = self._fresh(doc_id)
        if not requeued:
            raise Conflict(f"document {doc_id} is {doc.status}; only a failed one is retried")
        return doc

    def request_forget(self, doc_id: int) -> Document:
        """Ask to forget a document, whatever it is doing.

        A done one goes to ``forgetting`` (the worker hides its entries). A processing one
        goes to ``forgetting`` under its claimant, whose result then cannot be recorded:
        the worker discards its entries and hands the forget over (:meth:`_settle`). A
        pending or failed one, with nothing in the memory, is ``forgotten`` at once.
        """
        # Each lost compare-and-set means another transition committed in between; a
        # document moves a few steps at most while one request runs.
        for _ in range(8):
            status = self.s.scalar(select(Document.status).where(Document.id == doc_id))
            if status is None:
                raise NotFound(f"document {doc_id} does not exist")
            if status in ("forgetting", "forgotten"):
                raise Conflict(f"document {doc_id} is already {status}")
            if status == "done":
                # (claimed_at stays: with processed_at it times the try that memorised it)
                values: dict[str, Any] = {"status": "forgetting", "claimed_by": None}
            elif status == "processing":
                values = {"status": "forgetting"}  # the claimant stays: it settles the try
            else:  # nothing in the memory: the text goes now
                values = {"status": "forgotten", "text": "", "retry_at": None}
            if self._move(doc_id, (status,), **values):
                return self._fresh(doc_id)
        raise Conflict(f"document {doc_id} kept changing state; try again in a moment")

    def forgetting_ids(self) -> list[int]:
        """Documents whose forget is requested and not yet applied (to hide at once)."""
        q = select(Document.id).where(Document.status == "forgetting").order_by(Document.id)
        return [int(i) for i in self.s.scalars(q)]

    def next_forget(self) -> Document | None:
        """The next forget to apply; one still claimed waits for its try to settle."""
        q = (
            select(Document)
            .where(Document.status == "forgetting", Document.claimed_by.is_(None))
            .order_by(Document.id)
            .limit(1)
        )
        return self.s.scalars(q).first()

    def mark_forgotten(self, doc_id: int) -> bool:
        """``forgetting`` -> ``forgotten``; False when another worker got there first.

        The text leaves the row (set to ""): the memory no longer needs it, and a
        forgotten document keeps only its metadata (title, source, external id, dates,
        counts, entry range) and its content hash, so the same text sent again is
        answered as a duplicate of the forgotten document rather than memorised anew.
        """
        forgotten = self._move(
            doc_id, ("forgetting",), Document.claimed_by.is_(None), status="forgotten", text=""
        )
        SpanRepository(self.s).delete(doc_id)  # its token offsets are its bytes too
        return forgotten

    def counts_by_status(self) -> dict[str, int]:
        q = select(Document.status, func.count()).group_by(Document.status)
        return {status: int(n) for status, n in self.s.execute(q)}

    def peek_next(self) -> tuple[int, str] | None:
        """(id, text) of the document ``claim_next`` would give now, without claiming it: a
        worker encodes it ahead while its current document is searched (it may be claimed
        by another worker meanwhile; the encode is then wasted, never wrong)."""
        now = utcnow()
        q = (
            select(Document.id, Document.text)
            .where(
                Document.status == "pending",
                or_(Document.retry_at.is_(None), Document.retry_at <= now),
            )
            .order_by(Document.published_at, Document.id)
            .limit(1)
        )
        row = self.s.execute(q).first()
        return None if row is None else (int(row[0]), str(row[1]))

    def pending_count(self) -> int:
        q = select(func.count()).select_from(Document).where(Document.status == "pending")
        return int(self.s.scalar(q) or 0)
