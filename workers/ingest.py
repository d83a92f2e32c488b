"""The ingest worker: claim pending documents in date order and memorise them.

One unit of work is one document (docs/architecture.md, the data flow)::

    claim (commit: processing) -> engine.prepare_document (encode, score, decide)
        -> inside the datastore's write lock: append durably, then one transaction:
           document done + the day's counters (commit)

Several workers may share one data directory, or only the database and a memory server
(Milvus): they claim different documents (``FOR UPDATE SKIP LOCKED`` / compare-and-set),
encode and score them in parallel, and take turns for the short append-and-commit step
where the memory needs turns (``engine.exclusive()``: the faiss datastore's lock across
processes). So the memory holds, at every moment outside that step, exactly the entries
of committed documents.

A crash between the append and the commit leaves entries that no committed document owns.
The worker never asks which memory serves: it tells the memory what the database
committed (``workers.committed``) and the memory takes out the rest, before each append
(``engine.rollback``: faiss cuts the datastore back to the end of the last committed
range; Milvus has nothing to cut, since a document's put replaces an earlier try's),
after a failed try (that document's entries) and at every worker's start-up
(``engine.recover``): nothing is lost, nothing is counted twice. Each worker holds a lock
named after it for its whole life (``workers.liveness``: a lock file, or a PostgreSQL
advisory lock where workers share no data directory); it goes when the process dies, so
another worker can tell that a document left in ``processing`` lost its worker and put it
back in the queue.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import signal
import socket
import sys
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
    SpanRepository,
    StatsRepository,
)
from memlm.engine import EngineLike, MemoryBehind, day_number, policy_params, reconcile_index
from memlm.locks import LockBusy
from memlm.settings import Settings
from memlm.unavailable import unavailable
from workers.builder import run_queued_build, start_builder
from workers.committed import DatabaseCommitted
from workers.liveness import worker_alive, worker_lock, worker_lock_path

__all__ = [
    "DatastoreAhead",
    "IngestWorker",
    "Processed",
    "Recovery",
    "Waiting",
    "worker_lock_path",
]

log = logging.getLogger(__name__)

# Where a test may stop the worker: after the engine appended, before the commit.
CRASH_POINTS = ("after_append",)


class SimulatedCrash(RuntimeError):
    """Raised at a ``crash_at`` point; the worker object must be discarded."""


# The memory holds less than the committed documents say: data was lost (raised by the
# memory's recover; the name older callers catch).
DatastoreAhead = MemoryBehind


# Why a claim went back without a result (the try was counted when it was claimed).
_DIED = "the worker processing it died (killed, or out of memory)"
_LOST = "the worker processing it could not record the result (database unreachable)"

# Exceptions whose message describes the document, so the reason may be shown to users.
_USER_ERRORS: tuple[type[BaseException], ...] = (ValueError,)


@dataclass(frozen=True)
class Recovery:
    released_documents: int
    released_builds: int
    datastore_before: int  # entries the memory held before the start-up rollback
    datastore_after: int  # ... and after it


@dataclass(frozen=True)
class Waiting:
    """A step that claimed nothing: the memory cannot be searched (``reason``, from the
    memory), for the ``tries``-th step in a row since a try failed for it."""

    reason: str
    tries: int


@dataclass(frozen=True)
class Processed:
    document_id: int
    status: str
    tokens_seen: int = 0
    tokens_stored: int = 0
    seconds: float = 0.0


def is_permanent(exc: BaseException) -> bool:
    """Whether a try at a document failed because of the document itself (bad text).

    Only the engine's own verdict on the text (``EngineInputError``) and text that cannot
    be decoded are permanent. Everything else is retried a bounded number of times: the
    passing failures a worker meets (a busy or locked database, a dropped connection, an
    out-of-memory batch on the CPU or the GPU, EAGAIN, a lock held elsewhere, a race
    between threads) raise many types, some of them ``ValueError`` or ``RuntimeError``;
    failing a document for good costs an operator's retry, another try costs seconds.
    """
    if isinstance(exc, UnicodeError):
        return True
    engine = sys.modules.get("memlm.engine")  # loaded whenever the real engine raised
    return engine is not None and isinstance(exc, engine.EngineInputError)


def retry_delay(settings: Settings, failures: int) -> float:
    """Seconds before the next try after ``failures`` failed ones: exponential, capped."""
    base = settings.ingest_retry_backoff_seconds
    return float(min(base * 2.0 ** (failures - 1), settings.ingest_retry_backoff_max_seconds))


def failure_reason(exc: BaseException) -> str:
    away = unavailable(exc)
    if away is not None:  # a full disk, the database or the memory server away
        return away
    if isinstance(exc, _USER_ERRORS):
        return f"{type(exc).__name__}: {exc}"
    return "internal error while processing the document (details in the worker log)"


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


class IngestWorker:
    """Memorises pending documents one at a time; queued index builds run in ``step``
    (tests, one-shot use) or, under ``run``, in a builder thread beside the loop."""

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
        self.lock = worker_lock(settings, self.name)  # "this worker lives"
        # what the database committed, for the memory's rollbacks
        self.committed = DatabaseCommitted(sessions, self.name)
        self.policy_factory = policy_factory
        self.done = 0
        # Tries in a row that failed because a dependency was away (a full disk, the
        # database, the memory server): run() pauses retry_delay(streak) before the next.
        self.unavailable_streak = 0
        # Steps that claimed nothing because the memory could not be searched (a Milvus
        # collection not loaded, its server away): counted for good, logged each time.
        self.memory_waits = 0
        self._owes_release = False  # a claim that a failed step could not give back yet
        self._owes_cut: int | None = None  # a failed try whose entries could not go yet

    # --- start-up ------------------------------------------------------------------------

    def start(self, timeout: float | None = None) -> Recovery:
        """Take this worker's liveness lock and recover what dead workers left behind."""
        if not self.lock.held:
            self.lock.acquire(timeout)
        return self.recover()

    def recover(self) -> Recovery:
        """Release dead workers' claims and builds; the memory keeps only committed entries."""
        released = self.release_dead_claims(including_self=True)
        builds = 0
        # nobody builds now, so a build marked running lost its builder
        with (
            contextlib.suppress(LockBusy),
            self.engine.building(timeout=0),
            self.sessions.begin() as s,
        ):
            builds = BuildRepository(s).release_orphans()
        # raises MemoryBehind (DatastoreAhead) when the memory holds less than was committed
        before, after = self.engine.recover(self.committed)
        # after the check above: a data directory that is not this database's keeps its files
        reconcile_index(self.engine, self.sessions, delete=True)
        return Recovery(released, builds, before, after)

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
            if (n == self.name and including_self) or (n != self.name and not self._alive(n))
        ]
        if not dead:
            return 0
        with self.sessions.begin() as s:
            released = DocumentRepository(s).release_claims(
                dead, max_attempts=self.settings.ingest_max_attempts, cause=_DIED
            )
        if released:
            log.warning("put %d documents of stopped workers %s back in the queue", released, dead)
        return released

    def _alive(self, name: str) -> bool:
        return worker_alive(self.settings, name)

    # --- work ------------------------------------------------------------------------------

    def step(
        self, *, crash_at: str | None = None, build: bool = True
    ) -> Processed | Waiting | str | None:
        """One unit of work: a queued build first (``build``), else one document.

        None when idle. ``run`` passes ``build=False``: its builder thread builds. After a
        try that failed because a dependency was away, the memory is asked first whether
        it can be searched: while it cannot, nothing is claimed nor encoded (``Waiting``;
        ``run`` pauses with the growing backoff).
        """
        if crash_at is not None and crash_at not in CRASH_POINTS:
            raise ValueError(f"crash_at must be one of {CRASH_POINTS}")
        # Forgets first: a build then compacts their entries away and leaves them out.
        forgotten = self.apply_forget()
        if forgotten is not None:
            return forgotten
        if build:
            built = run_queued_build(self.engine, self.sessions)
            if built is not None:
                return built
        if self.unavailable_streak:
            reason = self.engine.memory_unavailable()
            if reason is not None:
                self.unavailable_streak += 1
                self.memory_waits += 1
                log.warning(
                    "the memory cannot be searched (%s); no document claimed (%d waits in all)",
                    reason,
                    self.memory_waits,
                )
                return Waiting(reason, self.unavailable_streak)
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
            span = None
            if doc.entry_start is not None and doc.entry_end is not None:
                span = range(doc.entry_start, doc.entry_end)
        # Idempotent: a retry after a crash here hides nothing new, takes nothing out of the
        # lexical statistics twice, and counts once below. The text leaves the database in
        # the same transaction as the counters (mark_forgotten).
        hidden = self.engine.forget_document(doc_id, text, entries=span)
        if hidden not in (0, stored or 0):
            log.warning("document %d: %d entries hidden, %s recorded", doc_id, hidden, stored)
        with self.sessions.begin() as s:
            # two workers may hide the same document; the one that flips the status counts
            # (a document forgotten during its first try has no entries and no policy)
            if DocumentRepository(s).mark_forgotten(doc_id) and stored:
                StatsRepository(s).add_forgotten(day, policy or "unknown", stored)
        return Processed(doc_id, "forgotten", 0, stored or 0)

    def _policy(self, s: Session) -> tuple[str, Any]:
        row = PolicyRepository(s).get(
            default_policy=self.settings.policy, default_delta=self.settings.delta
        )
        if self.policy_factory is None:
            return row.policy, None
        params = policy_params(row.policy, row.params, self.settings, s)
        return row.policy, self.policy_factory(row.policy, row.delta, params)

    def process_next(self, *, crash_at: str | None = None) -> Processed | None:
        with self.sessions.begin() as s:
            doc = DocumentRepository(s).claim_next(self.name)
            if doc is None:
                return None
            doc_id, text, day = doc.id, doc.text, doc.published_at
            policy_name, policy = self._policy(s)
            after = DocumentRepository(s).peek_next() if self.settings.encode_ahead else None
        t0 = time.perf_counter()
        try:
            # the next document's forward runs beside this one's search, append and commit
            prepared = self.engine.prepare_document(
                doc_id,
                text,
                day_number(day),
                policy=policy,
                next_text=None if after is None else after[1],
            )
        except Exception as exc:
            return self._failed(doc_id, exc)
        with self.engine.exclusive():  # other workers wait from here to the commit
            try:
                # what a worker that died between its append and its commit left
                self.engine.rollback(self.committed)
                result = self.engine.store_document(prepared)
            except Exception as exc:
                return self._failed(doc_id, exc)
            if crash_at == "after_append":
                raise SimulatedCrash(f"crash_at={crash_at} after document {doc_id}")
            seen, stored = int(result.tokens_seen), int(result.tokens_stored)
            try:
                with self.sessions.begin() as s:
                    recorded = DocumentRepository(s).mark_done(
                        doc_id,
                        self.name,
                        policy=policy_name,
                        tokens_seen=seen,
                        tokens_stored=stored,
                        entry_start=_opt_int(result.first_entry),
                        entry_end=_opt_int(result.end_entry),
                    )
                    if recorded:
                        StatsRepository(s).add_document(day, policy_name, seen, stored)
                        # snippet offsets commit with the document (None: not known)
                        SpanRepository(s).put(doc_id, prepared.char_spans)
            except Exception as exc:
                # The commit failed: the entries must not outlive it (_failed cuts them
                # now; any worker's next append would too), and the document is retried.
                log.warning("commit of document %d failed; rolling the datastore back", doc_id)
                return self._failed(doc_id, exc)
            if not recorded:  # forgotten during the try: nothing of it may be served
                self._discard_try(doc_id)
                log.info("document %d was forgotten while processed; its entries are cut", doc_id)
                return Processed(doc_id, "withdrawn")
        self.done += 1
        self.unavailable_streak = 0
        return Processed(doc_id, "done", seen, stored, time.perf_counter() - t0)

    def _failed(self, doc_id: int, exc: Exception) -> Processed:
        """Record a failed try: failed for good (bad text, or no tries left), else retried.

        The tries are counted in the database, so a restart does not reset them. When this
        bookkeeping itself fails (the database is down), the exception leaves the step and
        ``run`` puts the claim back in the queue.
        """
        away = unavailable(exc)
        if away is not None:  # run() pauses before the next claim: no loop through the queue
            self.unavailable_streak += 1
        try:  # whatever this try wrote must not outlive it
            self._discard_try(doc_id)
        except Exception as undo:
            if unavailable(undo) is None:
                raise
            # The disk is full, the database or the memory server away, even for the
            # rollback: the document is recorded below all the same (with its reason), and
            # run() cuts the entries as soon as it can (so does any worker's next try).
            log.warning("document %d: rollback deferred: %s", doc_id, unavailable(undo))
            self._owes_cut = doc_id
        reason = failure_reason(exc)
        limit = self.settings.ingest_max_attempts
        with self.sessions.begin() as s:
            docs = DocumentRepository(s)
            failures = docs.get(doc_id).attempts  # this try included: the claim counted it
            if is_permanent(exc) or failures >= limit:
                settled = docs.mark_failed(doc_id, self.name, reason)
                status = "failed"
            else:
                delay = retry_delay(self.settings, failures)
                at = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=delay)
                settled = docs.retry_later(doc_id, self.name, reason, at)
                status = "retrying"
        if not settled:  # forgotten during the try: its forget runs next
            return Processed(doc_id, "withdrawn")
        if status == "failed":
            log.error("document %d failed (try %d of %d)", doc_id, failures, limit, exc_info=exc)
        else:
            log.warning(
                "document %d: try %d of %d failed; retrying in %.1f s",
                doc_id,
                failures,
                limit,
                delay,
                exc_info=exc,
            )
        return Processed(doc_id, status)

    def _discard_try(self, doc_id: int) -> None:
        """Take out whatever this try of the document wrote to the memory."""
        self.engine.rollback(self.committed, doc_id)

    def run(self, stop: threading.Event, *, crash_at: str | None = None) -> None:
        """Work until ``stop`` is set; sleeps ``worker_poll_seconds`` when idle.

        Index builds run in a builder thread beside this loop (``workers.builder``), so
        ingest goes on during a build.
        """
        while not self.lock.held:  # only a live worker of the same name holds it
            try:
                self.lock.acquire(timeout=self.settings.worker_poll_seconds)
            except LockBusy:
                log.warning("a live worker named %s holds %s; waiting", self.name, self.lock.path)
                if stop.wait(self.settings.worker_poll_seconds):
                    return
        recovery = self.start()
        log.info("worker %s started: %s", self.name, recovery)
        builder, stop_builder = start_builder(
            self.engine, self.sessions, self.settings.worker_poll_seconds
        )
        try:
            while not stop.is_set():
                if self._owes_release:  # the database was away when a step failed
                    self._owes_release = not self._release_own_claim()
                try:
                    owed = self._owes_cut  # before the memory serves anything else
                    if owed is not None and self._cut_deferred(owed):
                        self._owes_cut = None
                    out = self.step(crash_at=crash_at, build=False)
                except SimulatedCrash:
                    # A real kill, so the test sees exactly what a crash leaves behind.
                    os.kill(os.getpid(), signal.SIGKILL)
                    raise
                except Exception as exc:
                    away = unavailable(exc)
                    if away is None:
                        log.exception("worker step failed; retrying after a pause")
                    else:
                        self.unavailable_streak += 1
                        log.warning("worker step failed: %s", away)
                    self._owes_release = not self._release_own_claim()
                    stop.wait(self._pause(self.settings.worker_poll_seconds))
                    continue
                if out is None:
                    stop.wait(self.settings.worker_poll_seconds)
                elif isinstance(out, Waiting):
                    stop.wait(self._pause(0.0))
                elif isinstance(out, Processed):
                    self._log_progress(out)
                    if self.unavailable_streak:
                        stop.wait(self._pause(0.0))
        finally:
            stop_builder.set()
            builder.join(timeout=self.settings.worker_poll_seconds)  # a build may take long
            self.lock.release()

    def _cut_deferred(self, doc_id: int) -> bool:
        """Take out the entries of a failed try that ``_failed`` could not; False while
        the disk, the database or the memory server is still away. (The memory leaves a
        document that is done or another worker's by then alone.)"""
        try:
            self._discard_try(doc_id)
        except Exception as exc:
            if unavailable(exc) is None:
                raise
            return False
        return True

    def _pause(self, least: float) -> float:
        """Seconds to wait before the next step: ``least``, or the backoff of the tries in
        a row that a dependency's absence failed (a full disk costs no hot loop)."""
        if not self.unavailable_streak:
            return least
        delay = max(least, retry_delay(self.settings, self.unavailable_streak))
        log.warning(
            "a dependency is unavailable (%d tries in a row); next try in %.1f s",
            self.unavailable_streak,
            delay,
        )
        return delay

    def _release_own_claim(self) -> bool:
        """After a step that failed outside the per-document bookkeeping (the database was
        unreachable even for recording the failure): put this worker's claim back in the
        queue, so that the document does not wait for this worker's restart. False while
        the database is away: ``run`` tries again before each step until it is back."""
        try:
            with self.sessions.begin() as s:
                released = DocumentRepository(s).release_claims(
                    [self.name], max_attempts=self.settings.ingest_max_attempts, cause=_LOST
                )
        except Exception as exc:
            if unavailable(exc) is not None:
                return False
            log.exception("could not put the claim of worker %s back; its restart will", self.name)
            return True
        if released:
            log.warning("put %d document(s) of this worker back in the queue", released)
        return True

    def _log_progress(self, p: Processed) -> None:
        try:
            with self.sessions() as s:
                left = DocumentRepository(s).pending_count()
        except Exception as exc:  # the database went away just after the step: log less
            if unavailable(exc) is None:
                raise
            left = -1
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
            log.info("document %d %s; %d pending", p.document_id, p.status, left)
