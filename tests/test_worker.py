"""The ingest worker over the exact fake engine: order, failures, crash-resume, the lock."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from memlm.db.errors import Conflict
from memlm.db.models import DayStat, Document
from memlm.db.repositories import DocumentRepository, NewDocument
from memlm.locks import LockBusy
from memlm.settings import Settings
from memlm.unavailable import DATABASE
from tests.fakes import FakeEngine
from tests.service_helpers import make_settings
from workers.ingest import DatastoreAhead, IngestWorker, Processed, SimulatedCrash


def add(sessions: Sessions, *texts: str, day: str = "2017-02-07") -> list[int]:
    import datetime as dt

    with sessions.begin() as s:
        accepted = DocumentRepository(s).add_many(
            NewDocument(text=t, published_at=dt.date.fromisoformat(day), source="t") for t in texts
        )
    return [a.id for a in accepted]


Sessions = sessionmaker[Session]
Setup = tuple[Settings, Sessions, FakeEngine, Callable[[], IngestWorker]]


def _get(s: Session, doc_id: int) -> Document:
    d = s.get(Document, doc_id)
    assert d is not None
    return d


def by_name(name: str, delta: float | None, params: dict[str, object]) -> str:
    return name


def _setup(tmp_path: Path, url: str, make_sessions: Callable[[str], Sessions]) -> Iterator[Setup]:
    """Settings, sessions and a fake engine on ``url``, and a factory of workers on them
    (their locks released afterwards)."""
    settings = make_settings(tmp_path, url, ingest_retry_backoff_seconds=0)
    sessions = make_sessions(url)
    engine = FakeEngine()
    workers: list[IngestWorker] = []

    def new_worker() -> IngestWorker:
        w = IngestWorker(engine, sessions, settings, policy_factory=by_name)
        workers.append(w)
        return w

    yield settings, sessions, engine, new_worker
    for w in workers:
        w.lock.release()


@pytest.fixture
def setup(
    tmp_path: Path, sqlite_url: str, make_sessions: Callable[[str], Sessions]
) -> Iterator[Setup]:
    yield from _setup(tmp_path, sqlite_url, make_sessions)


def day_rows(sessions: Sessions) -> list[tuple[int, int, int]]:
    with sessions() as s:
        return [(r.documents, r.tokens_seen, r.tokens_stored) for r in s.scalars(select(DayStat))]


def test_crash_between_append_and_commit_loses_nothing_and_counts_nothing_twice(
    setup: Setup,
) -> None:
    settings, sessions, engine, new_worker = setup
    first, second = add(sessions, "a b c d", "x y z")
    w = new_worker()
    w.start(timeout=1)
    out = w.step()
    assert isinstance(out, Processed)
    assert (out.document_id, out.status, out.tokens_seen, out.tokens_stored) == (
        first,
        "done",
        3,
        3,
    )
    with pytest.raises(SimulatedCrash):
        w.step(crash_at="after_append")
    # The crash left 2 appended entries that no committed document owns.
    assert len(engine.entries) == 5
    with sessions() as s:
        assert _get(s, second).status == "processing"
    w.lock.release()

    restarted = new_worker()
    rec = restarted.start(timeout=1)
    assert (rec.released_documents, rec.datastore_before, rec.datastore_after) == (1, 5, 3)
    assert len(engine.entries) == 3
    out = restarted.step()
    assert isinstance(out, Processed) and out.document_id == second and out.status == "done"
    assert restarted.step() is None
    assert len(engine.entries) == 5
    with sessions() as s:
        d = s.get(Document, second)
        assert d is not None and (d.entry_start, d.entry_end, d.status) == (3, 5, "done")
    assert day_rows(sessions) == [(2, 5, 5)]  # two documents, each counted once
    # The engine saw the second document twice; the database and the memory once.
    assert engine.processed == [first, second, second]


def test_failed_commit_rolls_the_datastore_back(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings, sessions, engine, new_worker = setup
    [doc_id] = add(sessions, "a b c")
    w = new_worker()
    w.start(timeout=1)

    def broken(*_a: object, **_k: object) -> None:
        raise RuntimeError("database went away")

    monkeypatch.setattr("workers.ingest.StatsRepository.add_document", broken)
    assert w.step() == Processed(doc_id, "retrying")
    assert engine.entries == []
    with sessions() as s:
        d = _get(s, doc_id)
        assert (d.status, d.attempts, d.entry_end) == ("pending", 1, None)
    monkeypatch.undo()
    assert isinstance(w.step(), Processed)
    assert day_rows(sessions) == [(1, 2, 2)]


def test_failure_truncates_partial_appends_and_queue_goes_on(setup: Setup) -> None:
    settings, sessions, engine, new_worker = setup
    bad, good = add(sessions, "a poison b", "c d")
    engine.fail_on = "poison"
    w = new_worker()
    w.start(timeout=1)
    assert w.step() == Processed(bad, "failed")
    out = w.step()
    assert isinstance(out, Processed) and (out.document_id, out.status) == (good, "done")
    with sessions() as s:
        assert _get(s, bad).error == "EngineInputError: cannot encode the word 'poison'"


def test_unexpected_failure_reason_hides_the_exception_text(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings, sessions, engine, new_worker = setup
    [doc_id] = add(sessions, "a b")

    def boom(*_a: object, **_k: object) -> None:
        raise KeyError("/secret/path")

    monkeypatch.setattr(engine, "prepare_document", boom)
    w = new_worker()
    w.start(timeout=1)
    w.step()
    with sessions() as s:
        err = _get(s, doc_id).error
    assert err == "internal error while processing the document (details in the worker log)"


def test_a_second_worker_of_the_same_name_waits(setup: Setup) -> None:
    settings, sessions, engine, new_worker = setup
    first = new_worker()
    first.start(timeout=1)
    with pytest.raises(LockBusy):
        new_worker().start(timeout=0.2)
    first.lock.release()
    new_worker().start(timeout=1)


def test_start_up_leaves_a_live_workers_claim_and_takes_a_dead_ones(setup: Setup) -> None:
    settings, sessions, engine, new_worker = setup
    [doc_id] = add(sessions, "a b c")
    alive = IngestWorker(engine, sessions, settings, name="w1", policy_factory=by_name)
    alive.start(timeout=1)
    with sessions.begin() as s:
        assert DocumentRepository(s).claim_next("w1") is not None  # w1 is on it
    other = IngestWorker(engine, sessions, settings, name="w2", policy_factory=by_name)
    assert other.start(timeout=1).released_documents == 0
    assert other.step() is None  # nothing pending; w1 still lives
    with sessions() as s:
        assert (_get(s, doc_id).status, _get(s, doc_id).claimed_by) == ("processing", "w1")
    alive.lock.release()  # w1 dies: the kernel drops its lock
    assert other.step() is None  # idle: finds the dead worker's claim and queues it again
    assert other.step() == Processed(doc_id, "done", 2, 2, pytest.approx(0.0, abs=5.0))
    other.lock.release()


def test_workers_sharing_a_data_directory_each_document_once(setup: Setup) -> None:
    import threading

    settings, sessions, engine, new_worker = setup
    texts = [f"w{i} x{i} y{i} z" for i in range(30)]
    ids = add(sessions, *texts)
    stop = threading.Event()
    workers = [
        IngestWorker(engine, sessions, settings, name=f"w{i}", policy_factory=by_name)
        for i in range(3)
    ]
    threads = [threading.Thread(target=w.run, args=(stop,)) for w in workers]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while len(engine.processed) < len(ids) and time.monotonic() < deadline:
        time.sleep(0.02)
    stop.set()
    for t in threads:
        t.join(10)
    assert sorted(engine.processed) == ids
    with sessions() as s:
        docs = sorted((_get(s, i) for i in ids), key=lambda d: d.entry_start or 0)
    # the entry ranges tile the datastore, each range holds its own document's entries
    assert [d.status for d in docs] == ["done"] * len(ids)
    ends = [(d.entry_start, d.entry_end) for d in docs]
    assert ends[0][0] == 0 and ends[-1][1] == len(engine.entries)
    assert all(a[1] == b[0] for a, b in zip(ends, ends[1:], strict=False))
    for d in docs:
        assert {e.doc_id for e in engine.entries[d.entry_start : d.entry_end]} <= {d.id}
    assert day_rows(sessions) == [(30, 90, len(engine.entries))]
    assert sum(w.done for w in workers) == 30


def test_the_committed_view_holds_done_documents_and_other_workers_claims(
    setup: Setup,
) -> None:
    """What the memory's rollback may not take out (workers.committed): done documents and
    documents another worker is trying; a failed try of this worker's, a pending or a
    forgetting document's entries may go."""
    from workers.committed import DatabaseCommitted

    settings, sessions, engine, new_worker = setup
    ids = add(sessions, "a b", "c d", "e f", "g h", "i j", "k l")
    done, mine, theirs, pending, forgetting, failed = ids
    with sessions.begin() as s:
        rows = {d: _get(s, d) for d in ids}
        rows[done].status = "done"
        rows[done].entry_start, rows[done].entry_end = 0, 1
        rows[mine].status, rows[mine].claimed_by = "processing", "me"
        rows[theirs].status, rows[theirs].claimed_by = "processing", "other"
        rows[forgetting].status = "forgetting"
        rows[failed].status = "failed"
    view = DatabaseCommitted(sessions, "me")
    assert view.holds([*ids, 999]) == {done, theirs}
    assert view.holds([]) == set()
    assert view.end() == 1


def test_datastore_shorter_than_committed_documents_is_refused(setup: Setup) -> None:
    settings, sessions, engine, new_worker = setup
    add(sessions, "a b c")
    w = new_worker()
    w.start(timeout=1)
    w.step()
    w.lock.release()
    engine.entries.clear()  # the data directory was replaced behind the database's back
    with pytest.raises(DatastoreAhead, match="0 entries but committed documents own 2"):
        new_worker().start(timeout=1)


def test_run_loop_processes_until_stopped(setup: Setup) -> None:
    import threading
    import time

    settings, sessions, engine, new_worker = setup
    ids = add(sessions, "a b", "c d", "e f")
    stop = threading.Event()
    t = threading.Thread(target=new_worker().run, args=(stop,))
    t.start()
    deadline = time.monotonic() + 10
    while engine.processed != ids and time.monotonic() < deadline:
        time.sleep(0.02)
    stop.set()
    t.join(5)
    assert engine.processed == ids and not t.is_alive()


def test_run_loop_of_a_same_name_worker_returns_when_stopped_while_waiting(
    setup: Setup,
) -> None:
    import threading

    settings, sessions, engine, new_worker = setup
    holder = new_worker()
    holder.start(timeout=1)
    stop = threading.Event()
    t = threading.Thread(target=new_worker().run, args=(stop,))
    t.start()
    stop.set()
    t.join(5)
    assert not t.is_alive()


def test_build_interrupted_by_a_crash_is_built_after_restart(setup: Setup) -> None:
    from memlm.db.repositories import BuildRepository
    from workers.builder import enqueue_rebuild

    settings, sessions, engine, new_worker = setup
    enqueue_rebuild(sessions, key="nightly:2017-02-07", requested_by="scheduler")
    with sessions.begin() as s:
        assert BuildRepository(s).claim_queued() is not None  # a worker died while building
    w = new_worker()
    assert w.start(timeout=1).released_builds == 1
    assert w.step() == "nightly:2017-02-07"
    assert engine.built_version == 1
    with sessions() as s:
        [row] = BuildRepository(s).recent()
        assert (row.status, row.version) == ("done", "1")


class ReconcilingEngine(FakeEngine):
    """The fake plus the real engine's reconcile_index call, recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.reconciled: list[tuple[set[int], bool]] = []

    def reconcile_index(self, recorded: set[int], *, delete: bool = False) -> list[int]:
        self.reconciled.append((set(recorded), delete))
        return [9]


def test_reconcile_reads_records_under_the_build_lock_and_deletes_only_when_free(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    import logging
    import threading

    from memlm.db.repositories import BuildRepository
    from memlm.engine import reconcile_index
    from workers.builder import enqueue_rebuild

    _, sessions, _, _ = setup
    engine = ReconcilingEngine()
    for key, version in (("a", "1"), ("b", None), ("c", "3")):
        row, _ = enqueue_rebuild(sessions, key=key)
        if version is not None:
            with sessions.begin() as s:
                BuildRepository(s).finish(row.id, version=version, entries=1, params={}, seconds=0)
    with caplog.at_level(logging.WARNING):
        assert reconcile_index(engine, sessions, delete=True) == [9]
    assert engine.reconciled == [({1, 3}, True)]
    assert "deleted index version 9: no build record names it" in caplog.messages

    held, release = threading.Event(), threading.Event()

    def builder() -> None:  # another builder holds the lock: its directory is no orphan
        with engine.building():
            held.set()
            release.wait(10)

    t = threading.Thread(target=builder)
    t.start()
    assert held.wait(10)
    try:
        assert reconcile_index(engine, sessions, delete=True) == [9]
    finally:
        release.set()
        t.join()
    assert engine.reconciled[-1] == ({1, 3}, False)
    assert "not serving index version 9: no build record names it" in caplog.messages
    assert reconcile_index(FakeEngine(), sessions, delete=True) == []  # nothing versioned


def test_worker_start_reconciles_only_after_the_datastore_check(setup: Setup) -> None:
    settings, sessions, _, _ = setup
    engine = ReconcilingEngine()
    w = IngestWorker(engine, sessions, settings, policy_factory=by_name)
    try:
        w.start(timeout=1)
        assert engine.reconciled == [(set(), True)]
        add(sessions, "a b c")
        assert w.step() is not None
        engine.entries.clear()  # the data directory lost what the database says it holds
        with pytest.raises(DatastoreAhead):
            w.recover()
        assert engine.reconciled == [(set(), True)]  # refused before touching its files
    finally:
        w.lock.release()


def test_randmem_takes_rate_and_seed_from_the_settings_or_monims_measured_rate(
    tmp_path: Path, sqlite_url: str, make_sessions: Callable[[str], Sessions]
) -> None:
    import datetime as dt

    from memlm.db.repositories import PolicyRepository, StatsRepository
    from memlm.engine import policy_factory
    from memlm.knnlm.policy import RandMem

    sessions = make_sessions(sqlite_url)

    def active(**over: object) -> RandMem:
        settings = make_settings(tmp_path, sqlite_url, **over)
        w = IngestWorker(FakeEngine(), sessions, settings, policy_factory=policy_factory)
        with sessions.begin() as s:
            name, pol = w._policy(s)
        assert name == "randmem" and isinstance(pol, RandMem)
        return pol

    with sessions.begin() as s:
        PolicyRepository(s).set("randmem", None, {})
    pol = active(randmem_rate=0.2, randmem_seed=3)
    assert (pol.rate, pol.seed) == (0.2, 3)
    assert active().rate == 0.3  # MEMLM_RANDMEM_RATE's default, not make_policy's 0.5
    # MoNIM's measured rate: nothing measured yet -> the default rate
    assert active(randmem_rate="monim").rate == 0.3
    day = dt.date(2017, 2, 7)
    with sessions.begin() as s:
        stats = StatsRepository(s)
        stats.add_document(day, "monim", 1000, 250)
        stats.add_document(day, "monim-amt", 1000, 150)
        stats.add_document(day, "fullmem", 1000, 1000)  # not MoNIM: left out
    assert active(randmem_rate="monim").rate == 0.2  # (250 + 150) / 2000
    with sessions.begin() as s:
        PolicyRepository(s).set("randmem", None, {"rate": 0.1, "seed": 9})
    pol = active(randmem_rate=0.2, randmem_seed=3)
    assert (pol.rate, pol.seed) == (0.1, 9)  # the policy row's own params win
    with sessions.begin() as s:
        PolicyRepository(s).set("randmem", None, {"rate": "monim"})
    assert active().rate == 0.2


class _Flaky:
    """prepare_document that raises ``errors`` in turn, then does the real work."""

    def __init__(self, engine: FakeEngine, errors: list[Exception]) -> None:
        self.engine, self.errors, self.calls = engine, list(errors), 0
        self.real = engine.prepare_document

    def __call__(self, *a: object, **k: object) -> object:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.real(*a, **k)  # type: ignore[arg-type]


def _doc_state(sessions: Sessions, doc_id: int) -> tuple[str, int, str | None]:
    with sessions() as s:
        d = _get(s, doc_id)
        return d.status, d.attempts, d.error


def test_transient_failures_are_retried_and_counted_in_the_database(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sqlalchemy.exc import OperationalError

    settings, sessions, engine, new_worker = setup
    [doc_id] = add(sessions, "a b c")
    busy = OperationalError("SELECT 1", {}, Exception("database is locked"))
    flaky = _Flaky(engine, [busy, MemoryError()])
    monkeypatch.setattr(engine, "prepare_document", flaky)
    w = new_worker()
    w.start(timeout=1)
    assert w.step() == Processed(doc_id, "retrying")
    # a busy database is a dependency away: the reason says so (and run() pauses)
    assert _doc_state(sessions, doc_id) == ("pending", 1, DATABASE)
    assert w.unavailable_streak == 1
    reason = "internal error while processing the document (details in the worker log)"
    w.lock.release()
    restarted = new_worker()  # the count lives in the database, not in the worker
    restarted.start(timeout=1)
    assert restarted.step() == Processed(doc_id, "retrying")
    assert _doc_state(sessions, doc_id) == ("pending", 2, reason)
    out = restarted.step()
    assert isinstance(out, Processed) and (out.status, out.tokens_stored) == ("done", 2)
    with sessions() as s:
        d = _get(s, doc_id)
        assert (d.status, d.attempts, d.error, d.retry_at) == ("done", 2, None, None)
    assert flaky.calls == 3 and day_rows(sessions) == [(1, 2, 2)]


def test_a_document_fails_after_the_last_try_and_bad_text_at_once(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings, sessions, engine, new_worker = setup
    settings = settings.model_copy(update={"ingest_max_attempts": 3})
    flaky_id, bad_id, good_id = add(sessions, "a b", "c poison d", "e f")
    engine.fail_on = "poison"
    flaky = _Flaky(engine, [RuntimeError("CUDA out of memory")] * 3)
    monkeypatch.setattr(engine, "prepare_document", flaky)
    w = IngestWorker(engine, sessions, settings, policy_factory=by_name)
    w.start(timeout=1)
    try:
        # tries 1 and 2 of the flaky one leave it pending; the bad text fails at its first
        assert w.step() == Processed(flaky_id, "retrying")
        assert w.step() == Processed(flaky_id, "retrying")
        assert w.step() == Processed(flaky_id, "failed")
        assert w.step() == Processed(bad_id, "failed")
        out = w.step()
        assert isinstance(out, Processed) and (out.document_id, out.status) == (good_id, "done")
    finally:
        w.lock.release()
    assert _doc_state(sessions, flaky_id)[:2] == ("failed", 3)
    assert _doc_state(sessions, bad_id) == (
        "failed",
        1,
        "EngineInputError: cannot encode the word 'poison'",
    )
    assert flaky.calls == 5 and engine.entries[0].doc_id == good_id


def test_a_retry_waits_for_its_backoff_and_the_queue_goes_on(
    tmp_path: Path, sqlite_url: str, make_sessions: Callable[[str], Sessions]
) -> None:
    import datetime as dt

    from workers.ingest import retry_delay

    settings = make_settings(
        tmp_path,
        sqlite_url,
        ingest_retry_backoff_seconds=5,
        ingest_retry_backoff_max_seconds=30,
    )
    assert [retry_delay(settings, n) for n in range(1, 6)] == [5, 10, 20, 30, 30]
    sessions = make_sessions(sqlite_url)
    engine = FakeEngine()
    first, second = add(sessions, "a b", "c d")
    flaky = _Flaky(engine, [TimeoutError("lock wait")])
    engine.prepare_document = flaky  # type: ignore[method-assign]
    w = IngestWorker(engine, sessions, settings, policy_factory=by_name)
    w.start(timeout=1)
    try:
        before = dt.datetime.now(dt.UTC)
        assert w.step() == Processed(first, "retrying")
        with sessions() as s:
            at = _get(s, first).retry_at
        assert at is not None and 5 <= (at - before).total_seconds() < 6
        out = w.step()  # the first waits; the second is taken meanwhile
        assert isinstance(out, Processed) and (out.document_id, out.status) == (second, "done")
        assert w.step() is None
        with sessions.begin() as s:
            _get(s, first).retry_at = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
        out = w.step()
        assert isinstance(out, Processed) and (out.document_id, out.status) == (first, "done")
    finally:
        w.lock.release()


def test_a_claim_goes_back_to_the_queue_when_even_the_failure_cannot_be_recorded(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from sqlalchemy.exc import OperationalError

    settings, sessions, engine, new_worker = setup
    [doc_id] = add(sessions, "a b")
    down = OperationalError("UPDATE", {}, Exception("server closed the connection"))
    flaky = _Flaky(engine, [down])
    monkeypatch.setattr(engine, "prepare_document", flaky)
    real = DocumentRepository.retry_later

    def once_down(self: DocumentRepository, *a: object, **k: object) -> None:
        monkeypatch.setattr(DocumentRepository, "retry_later", real)
        raise down

    monkeypatch.setattr(DocumentRepository, "retry_later", once_down)
    stop = threading.Event()
    t = threading.Thread(target=new_worker().run, args=(stop,))
    t.start()
    deadline = time.monotonic() + 10
    while engine.processed != [doc_id] and time.monotonic() < deadline:
        time.sleep(0.02)
    stop.set()
    t.join(5)
    # the first try's failure could not be recorded, but the claim had counted the try;
    # the claim was put back, and the second try memorised it
    assert engine.processed == [doc_id] and flaky.calls == 2
    assert _doc_state(sessions, doc_id) == ("done", 1, None)


def test_ingest_goes_on_while_the_builder_thread_builds(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from memlm.db.repositories import BuildRepository
    from workers.builder import enqueue_rebuild

    settings, sessions, engine, new_worker = setup
    started, finish = threading.Event(), threading.Event()
    real_rebuild = engine.rebuild
    during: list[int] = []

    def slow_rebuild(**kw: object) -> object:
        started.set()
        assert finish.wait(20)  # the build lasts until the documents below are memorised
        during.extend(engine.processed)
        return real_rebuild(**kw)  # type: ignore[arg-type]

    monkeypatch.setattr(engine, "rebuild", slow_rebuild)
    enqueue_rebuild(sessions, key="nightly:2017-02-07", requested_by="scheduler")
    stop = threading.Event()
    t = threading.Thread(target=new_worker().run, args=(stop,))
    t.start()
    try:
        assert started.wait(10)
        ids = add(sessions, "a b c", "d e f", "g h")
        deadline = time.monotonic() + 10
        while engine.processed != ids and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.processed == ids  # memorised while the build was running
        finish.set()
        deadline = time.monotonic() + 10
        while engine.built_version != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        finish.set()
        stop.set()
        t.join(10)
    assert during == ids and engine.built_version == 1 and not t.is_alive()
    with sessions() as s:
        [row] = BuildRepository(s).recent()
        assert (row.status, row.version, row.entries) == ("done", "1", 5)


# --- status transitions under concurrency: forget against claim, tries counted at claim --


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def any_setup(
    request: pytest.FixtureRequest, tmp_path: Path, make_sessions: Callable[[str], Sessions]
) -> Iterator[Setup]:
    url = request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")
    yield from _setup(tmp_path, url, make_sessions)


def _forget(sessions: Sessions, doc_id: int) -> str:
    """What the forget route does: request it in its own unit of work."""
    with sessions.begin() as s:
        return DocumentRepository(s).request_forget(doc_id).status


def _live_of(engine: FakeEngine, doc_id: int) -> int:
    return sum(1 for e in engine._live() if e.doc_id == doc_id)


@pytest.mark.parametrize("at", ["prepare", "store"])
def test_a_forget_during_processing_withdraws_the_try_and_ends_forgotten(
    any_setup: Setup, monkeypatch: pytest.MonkeyPatch, at: str
) -> None:
    settings, sessions, engine, new_worker = any_setup
    keep, doc_id = add(sessions, "k l m", "a b c d")
    w = new_worker()
    w.start(timeout=1)
    assert isinstance(w.step(), Processed)  # keep: done, entries 0..2
    statuses: list[str] = []
    real = getattr(engine, f"{at}_document")

    def forgotten_meanwhile(*a: object, **k: object) -> object:
        if at == "prepare":  # before any entry exists
            statuses.append(_forget(sessions, doc_id))
            return real(*a, **k)
        out = real(*a, **k)  # after the append, before the worker records it
        statuses.append(_forget(sessions, doc_id))
        return out

    monkeypatch.setattr(engine, f"{at}_document", forgotten_meanwhile)
    assert w.step() == Processed(doc_id, "withdrawn")
    assert statuses == ["forgetting"]  # accepted (202), not refused as "being processed"
    assert len(engine.entries) == 2 and _live_of(engine, doc_id) == 0  # this try's are cut
    with sessions() as s:
        d = _get(s, doc_id)
        assert (d.status, d.claimed_by, d.entry_end, d.attempts) == ("forgetting", None, None, 1)
    assert w.step() == Processed(doc_id, "forgotten", 0, 0)
    assert w.step() is None
    with sessions() as s:
        d = _get(s, doc_id)
        assert (d.status, d.text, d.tokens_stored) == ("forgotten", "", None)
        assert _get(s, keep).status == "done"
    assert engine.deleted == {doc_id}
    assert day_rows(sessions) == [(1, 2, 2)]  # only the kept document is counted


def test_a_forget_waits_for_a_live_claimant_and_not_for_a_dead_one(any_setup: Setup) -> None:
    settings, sessions, engine, new_worker = any_setup
    [doc_id] = add(sessions, "a b c")
    alive = IngestWorker(engine, sessions, settings, name="w1", policy_factory=by_name)
    alive.start(timeout=1)
    with sessions.begin() as s:
        assert DocumentRepository(s).claim_next("w1") is not None
    assert _forget(sessions, doc_id) == "forgetting"
    other = IngestWorker(engine, sessions, settings, name="w2", policy_factory=by_name)
    other.start(timeout=1)
    try:
        assert other.step() is None  # w1's try may still append: its forget waits for it
        with sessions() as s:
            assert (_get(s, doc_id).status, _get(s, doc_id).claimed_by) == ("forgetting", "w1")
        alive.lock.release()  # w1 dies mid-try: the forget is handed to the queue
        assert other.step() is None
        assert other.step() == Processed(doc_id, "forgotten", 0, 0)
    finally:
        other.lock.release()
    with sessions() as s:
        assert (_get(s, doc_id).status, _get(s, doc_id).text) == ("forgotten", "")


def test_a_forget_racing_the_claim_never_leaves_a_document_served(any_setup: Setup) -> None:
    """Forget each document at the moment a worker claims and processes it, many times.

    The forget is a route's unit of work: the request, the route's own work (a pause of
    0 to 2 ms), the commit. Before compare-and-set transitions, a forget that read
    "pending" while the claim committed "processing" wrote "forgotten" over it, and the
    worker's "done" then wrote over that: done, text cleared, entries served.
    """
    import random
    import threading

    settings, sessions, engine, new_worker = any_setup
    w = new_worker()
    w.start(timeout=1)
    rng = random.Random(31)
    refused, ids = 0, []
    errors: list[BaseException] = []

    def work(go: threading.Barrier) -> None:
        go.wait()
        try:
            w.step()
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    for i in range(150):
        [doc_id] = add(sessions, f"r{i} s{i} t{i} u{i}")
        ids.append(doc_id)
        go = threading.Barrier(2)
        t = threading.Thread(target=work, args=(go,))
        t.start()
        go.wait()
        time.sleep(rng.uniform(0, 0.01))  # land before, during or after the claim
        while True:
            try:
                with sessions.begin() as s:
                    DocumentRepository(s).request_forget(doc_id)
                    time.sleep(rng.uniform(0, 0.002))
                break
            except Conflict:  # the old answer for a document being processed: try again
                refused += 1
                time.sleep(0.001)
        t.join(30)
        assert errors == []
        while w.step() is not None:  # the forget, and any withdrawn try's leftovers
            pass
    with sessions() as s:
        rows = [_get(s, i) for i in ids]
        ended = sorted({(d.status, d.text) for d in rows})
    assert ended == [("forgotten", "")]
    assert [i for i in ids if _live_of(engine, i)] == []
    assert refused == 0


def test_a_document_that_kills_its_worker_fails_after_the_last_try(any_setup: Setup) -> None:
    """SIGKILL or the OOM killer during a try: no failure is recorded, yet the try counts
    (at the claim), so the document fails after MEMLM_INGEST_MAX_ATTEMPTS instead of
    going back to pending forever."""
    settings, sessions, engine, new_worker = any_setup
    settings.ingest_max_attempts = 3  # the worker reads the same settings object
    killer, good = add(sessions, "a b c", "d e f")
    for tries in (1, 2, 3):
        w = new_worker()
        released = w.start(timeout=1).released_documents
        assert released == (0 if tries == 1 else 1)
        with pytest.raises(SimulatedCrash):
            w.step(crash_at="after_append")  # killed before it could record anything
        w.lock.release()  # the process is gone: the kernel drops its lock
        assert _doc_state(sessions, killer)[:2] == ("processing", tries)
    last = new_worker()
    assert last.start(timeout=1).released_documents == 0  # failed, not queued again
    died = "the worker processing it died (killed, or out of memory)"
    assert _doc_state(sessions, killer) == ("failed", 3, f"{died} during try 3 of 3; no tries left")
    out = last.step()  # the queue goes on
    assert isinstance(out, Processed) and (out.document_id, out.status) == (good, "done")
    assert last.step() is None
    assert _doc_state(sessions, good) == ("done", 0, None)
    assert len(engine.entries) == 2  # the killed tries' entries were all cut


def test_a_try_killed_once_then_retried_counts_one_failed_try(any_setup: Setup) -> None:
    settings, sessions, engine, new_worker = any_setup
    [doc_id] = add(sessions, "a b c")
    w = new_worker()
    w.start(timeout=1)
    with pytest.raises(SimulatedCrash):
        w.step(crash_at="after_append")
    w.lock.release()
    restarted = new_worker()
    assert restarted.start(timeout=1).released_documents == 1
    died = "the worker processing it died (killed, or out of memory)"
    assert _doc_state(sessions, doc_id) == ("pending", 1, f"{died} during try 1 of 5")
    out = restarted.step()
    assert isinstance(out, Processed) and (out.document_id, out.status) == (doc_id, "done")
    assert _doc_state(sessions, doc_id) == ("done", 1, None)  # one failed try, as documented


def test_the_next_pending_document_is_encoded_ahead(setup: Setup) -> None:
    settings, sessions, engine, new_worker = setup
    first, second, third = add(sessions, "a b", "c d", "e f")
    assert settings.encode_ahead  # on by default
    w = new_worker()
    w.start(timeout=1)
    out = w.step()
    assert isinstance(out, Processed) and (out.document_id, out.status) == (first, "done")
    assert engine.ahead == ["c d"]  # peeked, not claimed: still pending
    with sessions() as s:
        assert _get(s, second).status == "pending"
    w.step()
    w.step()
    assert engine.ahead == ["c d", "e f"]  # nothing after the last one
    settings.encode_ahead = False
    add(sessions, "g h", "i j")
    w.step()
    assert engine.ahead == ["c d", "e f"]
