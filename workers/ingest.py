"""The ingest worker: claim pending documents in date order and memorise them.

One unit of work is one document (DESIGN.md, data flow step 2)::

    claim (commit: processing) -> engine.prepare_document (encode, score, decide)
        -> inside the datastore's write lock: append durably, then one transaction:
           document done + the day's counters (commit)

Several workers may share one data directory (and one PostgreSQL or SQLite database):
they claim different documents (``FOR UPDATE SKIP LOCKED`` / compare-and-set), encode
and score them in parallel, and take turns for the short append-and-commit step, which
the datastore's ``exclusive()`` lock serialises across processes. So the datastore holds,
at every moment outside that step, exactly the entries of committed documents.

A crash between the append and the commit leaves entries that no committed document owns.
Every committed document records its entry range, so the next append-and-commit step of
any worker (and every worker's start-up) first cuts the datastore back to the end of the
last committed range: nothing is lost, nothing is counted twice. Each worker holds a lock
file named after it (``MEMLM_DATA_DIR/workers/``) for its whole life; the kernel drops it
when the process dies, so another worker can tell that a document left in
``processing`` lost its worker and put it back in the queue.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from memlm.db.repositories import (
    BuildRepository,
    DocumentRepository,
    PolicyRepository,
    SpanRepository,
    StatsRepository,
)
from memlm.locks import FileLock, LockBusy, held_elsewhere
from memlm.settings import Settings
from workers.builder import run_queued_build
from workers.engine import EngineLike, day_number

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


def worker_lock_path(settings: Settings, name: str) -> Path:
    """The file a live worker of this name holds locked (``host:pid`` -> ``host_pid.lock``)."""
    safe = "".join(c if c.isalnum() or c in "-._" else "_" for c in name)
    return settings.workers_dir / f"{safe}.lock"


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
        self.lock = FileLock(worker_lock_path(settings, self.name))  # "this worker lives"
        self.policy_factory = policy_factory
        self.done = 0

    # --- start-up ------------------------------------------------------------------------

    def start(self, timeout: float | None = None) -> Recovery:
        """Take this worker's liveness lock and recover what dead workers left behind."""
        if not self.lock.held:
            self.lock.acquire(timeout)
        return self.recover()

    def recover(self) -> Recovery:
        """Release dead workers' claims and builds; cut the datastore to committed entries."""
        released = self.release_dead_claims(including_self=True)
        builds = 0
        # nobody builds now, so a build marked running lost its builder
        with (
            contextlib.suppress(LockBusy),
            self.engine.building(timeout=0),
            self.sessions.begin() as s,
        ):
            builds = BuildRepository(s).release_orphans()
        with self.engine.exclusive():
            before, end = self._cut_uncommitted()
        if before < end:
            raise DatastoreAhead(
                f"datastore has {before} entries but committed documents own {end}: "
                "the data directory does not match the database"
            )
        return Recovery(released, builds, before, end)

    def release_dead_claims(self, *, including_self: bool = False) -> int:
        """Put documents claimed by workers that no longer live back in the queue.

        ``including_self``: at start-up, claims under this worker's own name are a dead
        predecessor's (a restarted process with the same name).
        """
        with self.sessions() as s:
            names = DocumentRepository(s).claimants()
        dead = [
            n
            for n in names
            if (n == self.name and including_self)
            or (n != self.name and not held_elsewhere(worker_lock_path(self.settings, n)))
        ]
        if not dead:
            return 0
        with self.sessions.begin() as s:
            released = DocumentRepository(s).release_claims(dead)
        if released:
            log.warning("put %d documents of stopped workers %s back in the queue", released, dead)
        return released

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
        done = self.process_next(crash_at=crash_at)
        if done is None:  # idle: a good moment to look for documents a dead worker held
            self.release_dead_claims()
        return done

    def apply_forget(self) -> Processed | None:
        """Hide the entries of one document asked to be forgotten, then count them."""
        with self.sessions() as s:
            doc = DocumentRepository(s).next_forget()
            if doc is None:
                return None
            doc_id, day, policy, stored = doc.id, doc.published_at, doc.policy, doc.tokens_stored
            text = doc.text
        # Idempotent: a retry after a crash here hides nothing new, takes nothing out of the
        # lexical statistics twice, and counts once below.
        hidden = self.engine.forget_document(doc_id, text)
        if hidden not in (0, stored or 0):
            log.warning("document %d: %d entries hidden, %s recorded", doc_id, hidden, stored)
        with self.sessions.begin() as s:
            # two workers may hide the same document; the one that flips the status counts
            if DocumentRepository(s).mark_forgotten(doc_id):
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
            prepared = self.engine.prepare_document(doc_id, text, day_number(day), policy=policy)
        except Exception as exc:
            return self._failed(doc_id, exc)
        with self.engine.exclusive():  # other workers wait from here to the commit
            self._cut_uncommitted()  # a worker that died between its append and its commit
            try:
                result = self.engine.store_document(prepared)
            except Exception as exc:
                return self._failed(doc_id, exc)
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
                    # snippet offsets commit with the document (None from engines without)
                    SpanRepository(s).put(doc_id, getattr(prepared, "char_spans", None))
            except Exception:
                # The commit failed: the entries must not outlive it. Any worker's next
                # append also cuts them; this handles a live database error now.
                log.exception("commit of document %d failed; rolling the datastore back", doc_id)
                self._cut_uncommitted()
                with self.sessions.begin() as s:
                    DocumentRepository(s).release(doc_id)
                raise
        self.done += 1
        return Processed(doc_id, "done", seen, stored, time.perf_counter() - t0)

    def _failed(self, doc_id: int, exc: Exception) -> Processed:
        log.error("document %d failed", doc_id, exc_info=exc)
        with self.engine.exclusive():
            self._cut_uncommitted()
        with self.sessions.begin() as s:
            DocumentRepository(s).mark_failed(doc_id, failure_reason(exc))
        return Processed(doc_id, "failed")

    def _cut_uncommitted(self) -> tuple[int, int]:
        """Cut entries no committed document owns (call inside ``engine.exclusive()``).

        Returns the datastore's length before the cut and the committed end.
        """
        with self.sessions() as s:
            end = DocumentRepository(s).committed_end()
        before = datastore_length(self.engine)
        if before > end:
            log.warning(
                "cutting %d uncommitted datastore entries (%d -> %d)", before - end, before, end
            )
            self.engine.truncate_datastore(end)
        return before, end

    def run(self, stop: threading.Event, *, crash_at: str | None = None) -> None:
        """Work until ``stop`` is set; sleeps ``worker_poll_seconds`` when idle."""
        while not self.lock.held:  # only a live worker of the same name holds it
            try:
                self.lock.acquire(timeout=self.settings.worker_poll_seconds)
            except LockBusy:
                log.warning("a live worker named %s holds %s; waiting", self.name, self.lock.path)
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
