"""Repositories on real SQLite and real PostgreSQL, migrated with Alembic."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

import pytest
from sqlalchemy.orm import Session, sessionmaker

from memlm.db.errors import Conflict, NotFound
from memlm.db.repositories import (
    BuildRepository,
    DocumentRepository,
    NewDocument,
    PolicyRepository,
    StatsRepository,
    content_hash,
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
        docs.mark_done(
            claimed, policy="monim", tokens_seen=9, tokens_stored=4, entry_start=0, entry_end=4
        )
        StatsRepository(s).add_document(D1, "monim", 9, 4)
    with sessions.begin() as s:
        docs = DocumentRepository(s)
        assert docs.committed_end() == 4
        nxt = docs.claim_next("w1")
        assert nxt is not None and nxt.id == late
        assert docs.claim_next("w1") is None
        assert docs.release_orphans() == 1
        assert docs.counts_by_status() == {"done": 1, "pending": 1}
    with sessions.begin() as s:
        docs = DocumentRepository(s)
        assert docs.request_forget(early).status == "forgetting"
        assert docs.request_forget(late).status == "forgotten"  # nothing stored yet
        with pytest.raises(Conflict):
            docs.request_forget(late)
        assert docs.next_forget() is not None
        assert docs.committed_end() == 4  # forgotten entries still occupy their ids
    with sessions() as s:
        [row] = StatsRepository(s).per_day()
        assert (row.day, row.documents, row.tokens_seen, row.tokens_stored) == (D1, 1, 9, 4)


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
