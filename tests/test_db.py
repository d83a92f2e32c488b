"""Repositories on real SQLite and real PostgreSQL, migrated with Alembic."""

from __future__ import annotations

import datetime as dt
import queue
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import StatementError
from sqlalchemy.orm import Session, sessionmaker

from memlm.db.errors import Conflict, NotFound
from memlm.db.models import Document, UTCDateTime
from memlm.db.repositories import (
    BuildRepository,
    DocumentRepository,
    NewDocument,
    PolicyRepository,
    SpanRepository,
    StatsRepository,
    content_hash,
    decode_spans,
    encode_spans,
)

MakeSessions = Callable[[str], sessionmaker[Session]]
D1, D2 = dt.date(2017, 2, 7), dt.date(2017, 2, 8)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def sessions(request: pytest.FixtureRequest, make_sessions: MakeSessions) -> sessionmaker[Session]:
    url = request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")
    return make_sessions(url)


def new(text: str, day: dt.date = D1, **kw: object) -> NewDocument:
    return NewDocument(text=text, published_at=day, source="s", **kw)  # type: ignore[arg-type]


def test_add_many_deduplicates(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as s:
        out = DocumentRepository(s).add_many(
            [new("a", external_id="1"), new("b", external_id="1"), new("a"), new("c")]
        )
    first, last = out[0].id, out[3].id
    assert [(a.id, a.duplicate) for a in out] == [
        (first, False),
        (first, True),  # same (source, external id)
        (first, True),  # same text
        (last, False),
    ]
    assert last != first
    with sessions() as s:
        doc = DocumentRepository(s).get(out[3].id)
        assert (doc.status, doc.content_hash, doc.published_at) == (
            "pending",
            content_hash("c"),
            D1,
        )
        with pytest.raises(NotFound):
            DocumentRepository(s).get(10**6)


def test_claim_order_done_and_committed_end(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as s:
        late, early = (a.id for a in DocumentRepository(s).add_many([new("x", D2), new("y", D1)]))
    with sessions.begin() as s:
        docs = DocumentRepository(s)
        claimed = docs.claim_next("w1")
        assert claimed is not None and (claimed.id, claimed.status) == (early, "processing")
        assert claimed.attempts == 1  # counted at the claim: a worker may die during it
        assert docs.mark_done(
            early, "w1", policy="monim", tokens_seen=9, tokens_stored=4, entry_start=0, entry_end=4
        )
        assert docs.get(early).attempts == 0  # failed tries: this one succeeded
        StatsRepository(s).add_document(D1, "monim", 9, 4)
    with sessions.begin() as s:
        docs = DocumentRepository(s)
        assert docs.committed_end() == 4
        nxt = docs.claim_next("w1")
        assert nxt is not None and nxt.id == late
        assert docs.claim_next("w1") is None
        assert docs.claimants() == ["w1"]
        assert docs.release_claims(["w2"], max_attempts=5, cause="died") == 0  # its own only
        assert docs.release_claims(["w1"], max_attempts=5, cause="died") == 1
        assert docs.claimants() == []
        assert (docs.get(late).attempts, docs.get(late).error) == (1, "died during try 1 of 5")
        assert docs.counts_by_status() == {"done": 1, "pending": 1}
    with sessions.begin() as s:
        docs = DocumentRepository(s)
        assert docs.request_forget(early).status == "forgetting"
        assert docs.request_forget(late).status == "forgotten"  # nothing stored yet
        with pytest.raises(Conflict):
            docs.request_forget(late)
        assert docs.next_forget() is not None
        assert docs.mark_forgotten(early) is True
        assert docs.mark_forgotten(early) is False  # a second worker does not count it again
        assert docs.committed_end() == 4  # forgotten entries still occupy their ids
    with sessions() as s:
        [row] = StatsRepository(s).per_day()
        assert (row.day, row.documents, row.tokens_seen, row.tokens_stored) == (D1, 1, 9, 4)


def test_retry_later_waits_its_time_and_requeue_failed(sessions: sessionmaker[Session]) -> None:
    now = dt.datetime.now(dt.UTC)
    with sessions.begin() as s:
        first, second = (a.id for a in DocumentRepository(s).add_many([new("r1"), new("r2")]))
    with sessions.begin() as s:
        docs = DocumentRepository(s)
        claimed = docs.claim_next("w1")
        assert claimed is not None and claimed.id == first
        assert docs.retry_later(first, "w1", "busy", now + dt.timedelta(hours=1))
        # the earlier document waits for its retry; the queue goes on without it
        nxt = docs.claim_next("w1")
        assert nxt is not None and nxt.id == second
        assert docs.claim_next("w1") is None
        docs.get(first).retry_at = now - dt.timedelta(seconds=1)
        again = docs.claim_next("w1")
        assert again is not None and (again.id, again.attempts, again.error) == (first, 2, "busy")
        assert not docs.mark_failed(first, "w2", "gave up")  # not w2's claim: nothing written
        assert docs.mark_failed(first, "w1", "gave up")
        with pytest.raises(Conflict, match="is processing; only a failed one is retried"):
            docs.requeue_failed(second)
        with pytest.raises(NotFound):
            docs.requeue_failed(10**6)
    with sessions.begin() as s:
        row = DocumentRepository(s).requeue_failed(first)
        assert (row.status, row.attempts, row.error, row.retry_at) == ("pending", 0, None, None)
    with sessions.begin() as s:
        assert DocumentRepository(s).claim_next("w2") is not None


@pytest.mark.postgres
def test_skip_locked_lets_two_workers_claim_different_documents(
    pg_url: str, make_sessions: MakeSessions
) -> None:
    sessions = make_sessions(pg_url)
    with sessions.begin() as s:
        ids = [a.id for a in DocumentRepository(s).add_many([new("p"), new("q"), new("r")])]
    s1, s2 = sessions(), sessions()
    try:
        a = DocumentRepository(s1).claim_next("w1")  # row lock held: s1 not committed
        b = DocumentRepository(s2).claim_next("w2")  # skips the locked row, no waiting
        assert a is not None and b is not None and (a.id, b.id) == (ids[0], ids[1])
        s1.commit()
        s2.commit()
    finally:
        s1.close()
        s2.close()


def test_spans_round_trip_replace_and_leave_with_forget(sessions: sessionmaker[Session]) -> None:
    # tokens that share characters (one emoji in two byte tokens) and a gap (a space)
    spans = np.array([[0, 3], [3, 7], [3, 7], [8, 200_000]], np.int64)
    assert decode_spans(encode_spans(spans), 4).tolist() == spans.tolist()
    with pytest.raises(ValueError, match="hold 4 tokens, 3 expected"):
        decode_spans(encode_spans(spans), 3)
    with sessions.begin() as s:
        a, b = (x.id for x in DocumentRepository(s).add_many([new("x"), new("y")]))
        SpanRepository(s).put(a, spans)
        SpanRepository(s).put(b, None)  # an engine that cannot tell: nothing stored
    with sessions.begin() as s:
        got = SpanRepository(s).many([a, b, a])
        assert list(got) == [a] and got[a].tolist() == spans.tolist()
        SpanRepository(s).put(a, spans[:2])  # processed again: replaced
    with sessions.begin() as s:
        assert SpanRepository(s).many([a])[a].tolist() == [[0, 3], [3, 7]]
        docs = DocumentRepository(s)
        docs.get(a).status = "done"
        docs.request_forget(a)
        assert docs.mark_forgotten(a)
    with sessions() as s:
        assert SpanRepository(s).many([a]) == {}


def test_builds_enqueue_claim_finish(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as s:
        builds = BuildRepository(s)
        row, created = builds.enqueue("k1", "manual")
        again, created2 = builds.enqueue("k1", "manual")
        assert created and not created2 and row.id == again.id
        assert builds.open_request() is not None and builds.active() is None
    with sessions.begin() as s:
        claimed = BuildRepository(s).claim_queued()
        assert claimed is not None and claimed.status == "building"
    with sessions.begin() as s:
        BuildRepository(s).finish(
            row.id, version="3", entries=10, params={"kind": "flat"}, seconds=0.5
        )
    with sessions() as s:
        active = BuildRepository(s).active()
        assert active is not None and (active.version, active.entries) == ("3", 10)
        assert BuildRepository(s).open_request() is None


def test_policy_row_defaults_then_updates(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as s:
        row = PolicyRepository(s).get(default_policy="monim", default_delta=-1.5)
        assert (row.policy, row.delta) == ("monim", -1.5)
    with sessions.begin() as s:
        PolicyRepository(s).set("monim-amt", -2.0, {"x": 1})
    with sessions() as s:
        row = PolicyRepository(s).get(default_policy="monim", default_delta=-1.5)
        assert (row.policy, row.delta, row.params) == ("monim-amt", -2.0, {"x": 1})


@pytest.mark.postgres
def test_policy_row_seeded_by_two_processes_at_once(
    pg_url: str, make_sessions: MakeSessions
) -> None:
    """API and worker starting together both find no row and insert it: one wins."""
    sessions = make_sessions(pg_url)
    pid: queue.Queue[int] = queue.Queue()
    out: dict[str, object] = {}

    def second() -> None:
        try:
            with sessions.begin() as s:
                pid.put(int(s.scalar(text("select pg_backend_pid()"))))
                row = PolicyRepository(s).get(default_policy="randmem", default_delta=-1.0)
                out["row"] = (row.policy, row.delta)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            out["error"] = repr(exc)

    s1 = sessions()
    try:
        PolicyRepository(s1).get(default_policy="monim", default_delta=None)  # not committed
        t = threading.Thread(target=second)
        t.start()
        backend = pid.get(timeout=20)
        deadline = time.monotonic() + 20
        with sessions() as watcher:  # wait until its insert waits for our row
            q = text("select wait_event_type from pg_stat_activity where pid = :pid")
            while watcher.scalar(q, {"pid": backend}) != "Lock":
                assert time.monotonic() < deadline
                watcher.rollback()
                time.sleep(0.01)
        s1.commit()
        t.join(20)
    finally:
        s1.close()
    assert out == {"row": ("monim", None)}


# --- timestamps: aware UTC out of every backend; naive refused ----------------------------

IST = dt.timezone(dt.timedelta(hours=5, minutes=30))


def _timestamps(row: object) -> dict[str, dt.datetime | None]:
    return {
        c.key: getattr(row, c.key)
        for c in row.__table__.columns  # type: ignore[attr-defined]
        if isinstance(c.type, UTCDateTime)
    }


def _assert_utc_between(
    values: dict[str, dt.datetime | None], lo: dt.datetime, hi: dt.datetime
) -> None:
    for name, value in values.items():
        assert value is not None, name
        assert value.tzinfo is dt.UTC, name
        # Server defaults (SQLite CURRENT_TIMESTAMP) have whole seconds.
        assert lo.replace(microsecond=0) <= value <= hi, name


def _every_timestamp_is_utc(sessions: sessionmaker[Session]) -> None:
    t0 = dt.datetime.now(dt.UTC)
    with sessions.begin() as s:
        [doc_id] = (a.id for a in DocumentRepository(s).add_many([new("tz")]))
        build, _ = BuildRepository(s).enqueue("tz", "test")
        PolicyRepository(s).get(default_policy="monim", default_delta=None)  # server default
    with sessions.begin() as s:
        docs = DocumentRepository(s)
        claimed = docs.claim_next("w")
        assert claimed is not None
        docs.mark_done(
            claimed.id,
            "w",
            policy="monim",
            tokens_seen=1,
            tokens_stored=1,
            entry_start=0,
            entry_end=1,
        )
        builds = BuildRepository(s)
        builds.claim_queued()
        builds.finish(build.id, version="1", entries=1, params={}, seconds=0.1)
    t1 = dt.datetime.now(dt.UTC)
    with sessions() as s:
        doc = DocumentRepository(s).get(doc_id)
        row = BuildRepository(s).get(build.id)
        policy = PolicyRepository(s).get(default_policy="x", default_delta=None)
        got = {**_timestamps(doc), **_timestamps(row), **_timestamps(policy)}
    assert got.pop("retry_at") is None  # a done document waits for no retry
    assert sorted(got) == [
        "claimed_at",
        "created_at",
        "finished_at",
        "processed_at",
        "requested_at",
        "started_at",
        "updated_at",
    ]
    _assert_utc_between(got, t0, t1)
    with sessions.begin() as s:
        [retried] = (a.id for a in DocumentRepository(s).add_many([new("tz retry")]))
    with sessions.begin() as s:
        assert DocumentRepository(s).claim_next("w") is not None
        assert DocumentRepository(s).retry_later(retried, "w", "busy", t1)
    with sessions() as s:
        assert DocumentRepository(s).get(retried).retry_at == t1
    with sessions.begin() as s:
        PolicyRepository(s).set("fullmem", None, {})  # a Python-side value this time
    with sessions() as s:
        updated = PolicyRepository(s).get(default_policy="x", default_delta=None).updated_at
    _assert_utc_between({"updated_at": updated}, t1, dt.datetime.now(dt.UTC))


def test_every_timestamp_comes_back_aware_utc(sessions: sessionmaker[Session]) -> None:
    _every_timestamp_is_utc(sessions)


@pytest.mark.postgres
def test_postgres_session_timezone_does_not_leak(pg_url: str, make_sessions: MakeSessions) -> None:
    """timestamptz comes back in the session's TimeZone; memlm still answers UTC."""
    sessions = make_sessions(f"{pg_url}%20-ctimezone%3DAsia%2FKolkata")
    with sessions() as s:
        assert s.scalar(text("SHOW TimeZone")) == "Asia/Kolkata"
    _every_timestamp_is_utc(sessions)


def test_aware_timestamps_keep_their_instant_and_naive_ones_are_refused(
    sessions: sessionmaker[Session],
) -> None:
    with sessions.begin() as s:
        [doc_id] = (a.id for a in DocumentRepository(s).add_many([new("instant")]))
        DocumentRepository(s).get(doc_id).processed_at = dt.datetime(2017, 2, 7, 12, 0, tzinfo=IST)
    with sessions() as s:
        got = DocumentRepository(s).get(doc_id).processed_at
        assert got == dt.datetime(2017, 2, 7, 6, 30, tzinfo=dt.UTC)
        assert got is not None and got.tzinfo is dt.UTC
        # Compared in SQL too: the stored value is the UTC instant, not IST wall time.
        q = select(Document.id).where(
            Document.processed_at == dt.datetime(2017, 2, 7, 6, 30, tzinfo=dt.UTC)
        )
        assert s.scalars(q).all() == [doc_id]
    with sessions() as s:
        DocumentRepository(s).get(doc_id).processed_at = dt.datetime(2017, 2, 7, 12, 0)
        with pytest.raises(StatementError, match="naive datetime 2017-02-07T12:00:00 refused"):
            s.flush()


@pytest.mark.parametrize("chars", [200, 20_000])  # in the page, and in overflow pages
def test_forgotten_text_leaves_the_sqlite_files(
    sqlite_url: str, make_sessions: MakeSessions, chars: int
) -> None:
    from pathlib import Path

    from memlm.db.session import purge_wal

    sessions = make_sessions(sqlite_url)
    secret = ("Zorblatt " * chars)[:chars]
    with sessions.begin() as s:
        docs = DocumentRepository(s)
        [a, b] = docs.add_many([new(secret, title="Hedge"), new("another text")])
    with sessions.begin() as s:
        docs = DocumentRepository(s)
        assert docs.claim_next("w") is not None
        docs.mark_done(
            a.id,
            "w",
            policy="monim",
            tokens_seen=3,
            tokens_stored=2,
            entry_start=0,
            entry_end=2,
        )
    db = Path(sqlite_url.removeprefix("sqlite:///"))
    files = [db, db.with_name(db.name + "-wal")]

    def blob() -> bytes:
        return b"".join(f.read_bytes() for f in files if f.exists())

    assert purge_wal(sessions.kw["bind"]) is True
    assert b"Zorblatt" in blob()
    with sessions.begin() as s:
        docs = DocumentRepository(s)
        assert docs.request_forget(a.id).status == "forgetting"
        assert docs.forgetting_ids() == [a.id]
        assert docs.mark_forgotten(a.id) is True
        assert docs.request_forget(b.id).status == "forgotten"  # pending: the text goes now
    assert purge_wal(sessions.kw["bind"]) is True
    assert b"Zorblatt" not in blob() and b"another text" not in blob()
    assert files[1].stat().st_size == 0
    with sessions() as s:
        row = DocumentRepository(s).get(a.id)
        assert (row.status, row.text, row.title, row.content_hash) == (
            "forgotten",
            "",
            "Hedge",
            content_hash(secret),
        )
        assert DocumentRepository(s).forgetting_ids() == []


@pytest.mark.postgres
def test_a_connection_checked_in_after_dispose_is_closed_not_left_to_the_collector(
    pg_url: str,
) -> None:
    """``Engine.dispose()`` while a thread still holds a connection (the API's shutdown
    abandoning a busy worker, a poll still running): that connection is closed when it
    comes back. SQLAlchemy's stock pool would keep it open in the replaced pool until the
    garbage collector deleted it, and psycopg's ResourceWarning would then fail whichever
    test happened to be running (CI, stop 42)."""
    import gc
    import warnings

    from memlm.db.session import make_engine

    engine = make_engine(pg_url)
    held = engine.connect()
    assert held.execute(text("select 1")).scalar() == 1
    raw = held.connection.dbapi_connection
    engine.dispose()
    assert raw is not None and not raw.closed  # in use: dispose leaves it to its holder
    held.close()
    assert raw.closed
    with engine.connect() as again:  # the engine itself goes on with a fresh pool
        assert again.execute(text("select 2")).scalar() == 2
    engine.dispose()
    del held, raw
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
    assert not [w for w in caught if "still open" in str(w.message)]


def test_connections_returned_while_the_engine_is_disposed_are_all_closed(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Threads return connections while another disposes the engine: every connection
    ever opened is closed at the end (the oracle: the pool's connect events). The stock
    return is slowed, so that each one queues while a dispose can drain the queue; a
    return that checked the flag before the dispose set it must still finish first."""
    from sqlalchemy import event
    from sqlalchemy.pool import QueuePool

    from memlm.db.session import make_engine

    stock = QueuePool._do_return_conn

    def slow_return(self, record):  # type: ignore[no-untyped-def]
        time.sleep(0.02)
        stock(self, record)

    monkeypatch.setattr(QueuePool, "_do_return_conn", slow_return)
    engine = make_engine(pg_url, pool_size=4, max_overflow=4)
    opened = []
    event.listen(engine, "connect", lambda dbapi, _rec: opened.append(dbapi))
    stop = threading.Event()
    errors: list[BaseException] = []

    def user() -> None:
        try:
            while not stop.is_set():
                with engine.connect() as c:
                    c.execute(text("select 1"))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=user) for _ in range(4)]
    for t in threads:
        t.start()
    for _ in range(10):
        time.sleep(0.03)
        engine.dispose()
    stop.set()
    for t in threads:
        t.join()
    engine.dispose()
    assert not errors
    assert len(opened) > 4  # the disposes made it open new ones
    assert [c for c in opened if not c.closed] == []
