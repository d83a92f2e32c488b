"""The ingest worker: claim pending documents in date order and memorise them.

One unit of work is one document (DESIGN.md, data flow step 2)::

    claim (commit: processing) -> engine.process_document (appends durably)
        -> one transaction: document done + the day's counters (commit)

A crash between the append and the commit leaves datastore entries that no committed
document owns. Every committed document records its entry range, so at start-up
:meth:`IngestWorker.recover` cuts the datastore back to the end of the last committed
range and puts documents left in ``processing`` back to ``pending``: nothing is lost,
nothing is counted twice. The same cut runs after any failed document.

The datastore has a single writer: a worker holds the data directory's file lock for
its whole life, so a second worker on the same machine waits as a hot standby.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from memlm.db.repositories import (
    BuildRepository,
    DocumentRepository,
    PolicyRepository,
    StatsRepository,
)
from memlm.settings import Settings
from workers.builder import run_queued_build
from workers.engine import EngineLike, day_number
from workers.lock import FileLock, LockBusy

log = logging.getLogger(__name__)

# Where a test may stop the worker: after the engine appended, before the commit.
CRASH_POINTS = ("after_append",)


class SimulatedCrash(RuntimeError):
    """Raised at a ``crash_at`` point; the worker object must be discarded."""


class DatastoreAhead(RuntimeError):
    """The datastore is shorter than the committed documents say: data was lost."""


# Exceptions whose message describes the document, so the reason may be shown to users.
_USER_ERRORS: tuple[type[BaseException], ...] = (ValueError,)


@dataclass(frozen=True)
class Recovery:
    released_documents: int
    released_builds: int
    datastore_before: int
    datastore_after: int


@dataclass(frozen=True)
class Processed:
    document_id: int
    status: str
    tokens_seen: int = 0
    tokens_stored: int = 0
    seconds: float = 0.0


def datastore_length(engine: EngineLike) -> int:
    """Committed datastore entries, deleted ones included (ids run 0..length-1)."""
    return int(engine.stats()["datastore_entries"])


def failure_reason(exc: BaseException) -> str:
    if isinstance(exc, _USER_ERRORS):
        return f"{type(exc).__name__}: {exc}"
    return "internal error while processing the document (details in the worker log)"


class IngestWorker:
    """Memorises pending documents one at a time and runs queued index builds."""

    def __init__(
        self,
        engine: EngineLike,
        sessions: sessionmaker[Session],
        settings: Settings,
        *,
        name: str | None = None,
        policy_factory: Callable[[str, float | None, dict[str, Any]], Any] | None = None,
    ) -> None:
        self.engine = engine
        self.sessions = sessions
        self.settings = settings
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.lock = FileLock(settings.lock_path)
        self.policy_factory = policy_factory
        self.done = 0

    # --- start-up ------------------------------------------------------------------------

    def start(self, timeout: float | None = None) -> Recovery:
        """Take the datastore lock (waiting for another worker to stop) and recover."""
        if not self.lock.held:
            self.lock.acquire(timeout)
        return self.recover()

    def recover(self) -> Recovery:
        """Release orphaned claims and cut the datastore to the committed entries."""
        with self.sessions.begin() as s:
            docs = DocumentRepository(s)
            released = docs.release_orphans()
            builds = BuildRepository(s).release_orphans()
            end = docs.committed_end()
        before = datastore_length(self.engine)
        if before < end:
            raise DatastoreAhead(
                f"datastore has {before} entries but committed documents own {end}: "
                "the data directory does not match the database"
            )
        if before > end:
            log.warning(
                "cutting %d uncommitted datastore entries (%d -> %d)", before - end, before, end
            )
            self.engine.truncate_datastore(end)
        if released:
            log.warning("put %d interrupted documents back in the queue", released)
        return Recovery(released, builds, before, end)

    # --- work ------------------------------------------------------------------------------

    def step(self, *, crash_at: str | None = None) -> Processed | str | None:
        """One unit of work: a queued build first, else one document. None when idle."""
        if crash_at is not None and crash_at not in CRASH_POINTS:
            raise ValueError(f"crash_at must be one of {CRASH_POINTS}")
        built = run_queued_build(self.engine, self.sessions)
        if built is not None:
            return built
        forgotten = self.apply_forget()
        if forgotten is not None:
            return forgotten
        return self.process_next(crash_at=crash_at)

    def apply_forget(self) -> Processed | None:
        """Hide the entries of one document asked to be forgotten, then count them."""
        with self.sessions() as s:
            doc = DocumentRepository(s).next_forget()
            if doc is None:
                return None
            doc_id, day, policy, stored = doc.id, doc.published_at, doc.policy, doc.tokens_stored
        # Idempotent: a retry after a crash here hides nothing new and counts once below.
        hidden = self.engine.forget_document(doc_id)
        if hidden not in (0, stored or 0):
            log.warning("document %d: %d entries hidden, %s recorded", doc_id, hidden, stored)
        with self.sessions.begin() as s:
            docs = DocumentRepository(s)
            docs.mark_forgotten(docs.get(doc_id))
            StatsRepository(s).add_forgotten(day, policy or "unknown", stored or 0)
        return Processed(doc_id, "forgotten", 0, stored or 0)

    def _policy(self, s: Session) -> tuple[str, Any]:
        row = PolicyRepository(s).get(
            default_policy=self.settings.policy, default_delta=self.settings.delta
        )
        arg = (
            self.policy_factory(row.policy, row.delta, row.params) if self.policy_factory else None
        )
        return row.policy, arg

    def process_next(self, *, crash_at: str | None = None) -> Processed | None:
        with self.sessions.begin() as s:
            doc = DocumentRepository(s).claim_next(self.name)
            if doc is None:
                return None
            doc_id, text, day = doc.id, doc.text, doc.published_at
            policy_name, policy = self._policy(s)
        t0 = time.perf_counter()
        try:
            result = self.engine.process_document(doc_id, text, day_number(day), policy=policy)
        except Exception as exc:
            log.exception("document %d failed", doc_id)
            self._cut_uncommitted()
            with self.sessions.begin() as s:
                DocumentRepository(s).mark_failed(doc_id, failure_reason(exc))
            return Processed(doc_id, "failed")
        if crash_at == "after_append":
            raise SimulatedCrash(f"crash_at={crash_at} after document {doc_id}")
        seen, stored = int(result.tokens_seen), int(result.tokens_stored)
        try:
            with self.sessions.begin() as s:
                docs = DocumentRepository(s)
                docs.mark_done(
                    docs.get(doc_id),
                    policy=policy_name,
                    tokens_seen=seen,
                    tokens_stored=stored,
                    entry_start=int(result.first_entry),
                    entry_end=int(result.end_entry),
                )
                StatsRepository(s).add_document(day, policy_name, seen, stored)
        except Exception:
            # The commit failed: the entries must not outlive it. Recover() at the next
            # start also handles a crash here; this handles a live database error.
            log.exception("commit of document %d failed; rolling the datastore back", doc_id)
            self._cut_uncommitted()
            with self.sessions.begin() as s:
                DocumentRepository(s).release(doc_id)
            raise
        self.done += 1
        return Processed(doc_id, "done", seen, stored, time.perf_counter() - t0)

    def _cut_uncommitted(self) -> None:
        with self.sessions() as s:
            end = DocumentRepository(s).committed_end()
        if datastore_length(self.engine) > end:
            self.engine.truncate_datastore(end)

    def run(self, stop: threading.Event, *, crash_at: str | None = None) -> None:
        """Work until ``stop`` is set; sleeps ``worker_poll_seconds`` when idle."""
        while not self.lock.held:
            try:
                self.lock.acquire(timeout=self.settings.worker_poll_seconds)
            except LockBusy:
                log.info("another worker holds %s; waiting as a standby", self.lock.path)
                if stop.wait(self.settings.worker_poll_seconds):
                    return
        recovery = self.start()
        log.info("worker %s started: %s", self.name, recovery)
        try:
            while not stop.is_set():
                try:
                    out = self.step(crash_at=crash_at)
                except SimulatedCrash:
                    # A real kill, so the test sees exactly what a crash leaves behind.
                    os.kill(os.getpid(), signal.SIGKILL)
                    raise
                except Exception:
                    log.exception("worker step failed; retrying after a pause")
                    stop.wait(self.settings.worker_poll_seconds)
                    continue
                if out is None:
                    stop.wait(self.settings.worker_poll_seconds)
                elif isinstance(out, Processed):
                    self._log_progress(out)
        finally:
            self.lock.release()

    def _log_progress(self, p: Processed) -> None:
        with self.sessions() as s:
            left = DocumentRepository(s).pending_count()
        if p.status == "forgotten":
            log.info("document %d forgotten: %d entries hidden", p.document_id, p.tokens_stored)
        elif p.status == "done":
            rate = p.tokens_seen / p.seconds if p.seconds else 0.0
            log.info(
                "document %d done: %d tokens, %d stored (%.0f%%), %.1f s, %.0f tok/s; %d pending",
                p.document_id,
                p.tokens_seen,
                p.tokens_stored,
                100.0 * p.tokens_stored / max(p.tokens_seen, 1),
                p.seconds,
                rate,
                left,
            )
        else:
            log.info("document %d failed; %d pending", p.document_id, left)
