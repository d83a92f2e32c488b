"""The promise "A dependency dies" (issue 31), tried for real: the PostgreSQL server
restarted under the API and its embedded worker (a private server of the test's own,
tests/throwaway_pg.py), the real engine with a tiny random model."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from memlm.db.models import Document
from memlm.unavailable import DATABASE, MEMORY
from tests.service_helpers import ADMIN, INGEST, READ, doc, make_settings
from tests.tcp_proxy import TcpProxy
from tests.test_disk_full import _texts
from tests.throwaway_pg import throwaway_postgres


@pytest.fixture(scope="module")
def tiny() -> Any:
    from memlm.encoder import Encoder

    return Encoder.load("tiny-llama", threads=1)


def _wait(what: Callable[[], bool], timeout: float, why: str) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, f"not within {timeout} s: {why}"
        time.sleep(0.1)


def _timed(call: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.monotonic()
    out = call()
    return out, time.monotonic() - t0


def test_postgres_restarted_during_ingest_and_predict(tmp_path: Path, tiny: Any) -> None:
    """While the server is away every route that needs it answers 503 with the reason and
    a Retry-After at once (no 500, no hang), /healthz stays up, the worker waits; once it
    is back, everything recovers by itself and every document is memorised exactly once."""
    from memlm.cli.compose import build_app
    from memlm.db.migrate import upgrade
    from memlm.engine import open_engine, policy_factory

    with throwaway_postgres() as pg:
        upgrade(pg.url)
        settings = make_settings(
            tmp_path,
            pg.url,
            model="tiny-llama",
            policy="fullmem",
            ingest_retry_backoff_seconds=0.2,
            ingest_retry_backoff_max_seconds=1.0,
            index_poll_seconds=0.2,
        )
        engine: Any = open_engine(settings, encoder=tiny)
        app = build_app(
            settings, engine=engine, policy_factory=policy_factory, embedded_worker=True
        )
        with TestClient(app) as c:
            sessions = app.state.memlm.sessions
            r = c.post(
                "/ingest", headers=INGEST, json={"documents": [doc(t) for t in _texts(12, 2)]}
            )
            assert r.status_code == 202, r.text
            ids = [d["id"] for d in r.json()["documents"]]

            def statuses() -> list[str]:
                with sessions() as s:
                    return list(s.scalars(select(Document.status).where(Document.id.in_(ids))))

            _wait(lambda: statuses().count("done") >= 3, 60, "the first documents")
            context = {"context": _texts(1, 2)[0][:80], "neighbours": 5}
            assert c.post("/predict", headers=READ, json=context).status_code == 200

            pg.stop()  # mid-ingest: the worker is encoding, appending or committing
            away = {
                "ingest": lambda: c.post(
                    "/ingest", headers=INGEST, json={"documents": [doc(_texts(1, 3)[0])]}
                ),
                "predict": lambda: c.post("/predict", headers=READ, json=context),
                "document": lambda: c.get(f"/documents/{ids[0]}", headers=INGEST),
                "stats": lambda: c.get("/admin/stats", headers=ADMIN),
            }
            for name, call in away.items():
                resp, took = _timed(call)
                assert (name, resp.status_code) == (name, 503), resp.text
                assert resp.json() == {"error": "unavailable", "detail": DATABASE}
                assert resp.headers["Retry-After"] == "1"
                assert took < 5.0, (name, took)
            assert c.get("/healthz").json() == {"status": "ok"}
            time.sleep(2.0)  # the worker meets the dead server and backs off meanwhile
            assert engine.stats()["datastore_entries"] >= 0  # the engine itself is fine

            pg.start()
            _wait(lambda: statuses() == ["done"] * len(ids), 90, "recovery after the restart")
            assert c.post("/predict", headers=READ, json=context).status_code == 200

            with sessions() as s:
                done = list(
                    s.execute(
                        select(Document.id, Document.entry_start, Document.entry_end)
                        .where(Document.id.in_(ids))
                        .order_by(Document.entry_start)
                    )
                )
                stored = s.scalar(select(func.sum(Document.tokens_stored)))
            ds = engine.memory.datastore
            ends = [0] + [d.entry_end for d in done]
            assert [d.entry_start for d in done] == ends[:-1]  # no gap, no overlap
            for d in done:  # each range holds its own document's entries, once
                owners = ds.provenance(np.arange(d.entry_start, d.entry_end))[0]
                assert set(owners.tolist()) == {d.id}
            stats = c.get("/admin/stats", headers=ADMIN).json()
            assert len(ds) == ds.num_live == ends[-1] == stored
            assert stats["entries"] == stats["tokens_stored"] == stored


@pytest.mark.milvus
def test_milvus_away_raises_memory_unavailable_within_its_timeout_then_recovers(
    milvus_server: Any, milvus_url: str
) -> None:
    """The memory reaches the session's Milvus server through a proxy that the test stops
    (connections reset, new ones refused: the server as seen from a killed process) and
    starts again. While it is away every call raises MemoryUnavailable within the URL's
    timeout (pymilvus alone retried a float timeout's call ~75 times, minutes); once it
    is back the same memory answers again, with every entry once."""
    from memlm.memory import open_milvus
    from memlm.unavailable import MemoryUnavailable, unavailable

    rng = np.random.default_rng(0)
    keys = rng.standard_normal((30, 8)).astype(np.float32)

    def entries(doc: int) -> tuple[Any, ...]:
        return keys, np.arange(30), np.full(30, doc), np.arange(30), np.full(30, 7)

    open_milvus(milvus_url, 8).close()  # created and loaded with the fixture's 60 s
    with TcpProxy(milvus_server.host, milvus_server.port) as proxy:
        url = milvus_url.replace(f":{milvus_server.port}/", f":{proxy.port}/")
        mem = open_milvus(url.replace("timeout=60", "timeout=3"), 8)
        try:
            mem.append(*entries(1))
            assert mem.count() == 30
            proxy.stop()
            for name, call in {
                "search": lambda: mem.search(keys[:2], 3),
                "append": lambda: mem.append(*entries(2)),
                "count": mem.count,
            }.items():
                t0 = time.monotonic()
                with pytest.raises(MemoryUnavailable) as err:
                    call()
                assert time.monotonic() - t0 < 10.0, name
                assert unavailable(err.value) == MEMORY
            proxy.start()
            _wait(lambda: _answers(mem), 60, "Milvus reachable again")
            mem.append(*entries(2))  # the worker's retry of the document that failed
            assert mem.count() == 60
            found = mem.search(keys[:1], 1)
            assert found.distances[0, 0] == pytest.approx(0.0, abs=1e-4)
        finally:
            mem.close()


def _answers(mem: Any) -> bool:
    from memlm.unavailable import MemoryUnavailable

    try:
        mem.count()
    except MemoryUnavailable:
        return False
    return True


def test_memory_unavailable_answers_503_and_makes_the_worker_wait(
    tmp_path: Path, sqlite_url: str, make_sessions: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mapping alone, with the exact fake engine: /predict 503 with the reason and a
    Retry-After (not 500); the worker records the reason, keeps the try's count as any
    passing failure, and run() would pause before its next claim."""
    from memlm.db.repositories import DocumentRepository, NewDocument
    from memlm.unavailable import MemoryUnavailable
    from service.app import create_app
    from tests.fakes import FakeEngine
    from workers.ingest import IngestWorker, Processed

    settings = make_settings(tmp_path, sqlite_url, ingest_retry_backoff_seconds=0)
    engine = FakeEngine()

    def away(*_: Any, **__: Any) -> Any:
        raise MemoryUnavailable("the Milvus server at 127.0.0.1:1 is unavailable")

    for name in ("predict", "predict_batch", "store_document"):
        if hasattr(engine, name):
            monkeypatch.setattr(engine, name, away)
    app = create_app(settings, engine=engine, run_worker=False, poll=False)
    with TestClient(app) as c:
        r = c.post("/predict", json={"context": "the a of"})
        assert (r.status_code, r.json()) == (503, {"error": "unavailable", "detail": MEMORY})
        assert r.headers["Retry-After"] == "1"
    sessions = make_sessions(sqlite_url)
    with sessions.begin() as s:
        [acc] = DocumentRepository(s).add_many(
            [NewDocument(text="the a of and", published_at=dt.date(2017, 2, 7), source="t")]
        )
    w = IngestWorker(engine, sessions, settings)
    w.start(timeout=1)
    try:
        assert w.step() == Processed(acc.id, "retrying")
        with sessions() as s:
            d = s.get(Document, acc.id)
            assert d is not None and (d.status, d.attempts, d.error) == ("pending", 1, MEMORY)
        assert w.unavailable_streak == 1
    finally:
        w.lock.release()


def test_the_worker_waits_without_claiming_while_the_memory_cannot_be_searched(
    tmp_path: Path, sqlite_url: str, make_sessions: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a try failed because the memory was away, the worker asks the memory before
    it claims again: while it cannot be searched, nothing is claimed nor encoded (the
    document keeps its one counted try), each wait is counted and the backoff grows;
    once it can, the document is memorised."""
    from memlm.db.repositories import DocumentRepository, NewDocument
    from memlm.unavailable import MemoryUnavailable
    from tests.fakes import FakeEngine
    from workers.ingest import IngestWorker, Processed, Waiting

    settings = make_settings(
        tmp_path, sqlite_url, ingest_retry_backoff_seconds=0.5, ingest_retry_backoff_max_seconds=60
    )
    engine = FakeEngine()
    prepared: list[int] = []
    prepare = engine.prepare_document

    def counted(doc_id: int, *a: Any, **kw: Any) -> Any:
        prepared.append(doc_id)
        return prepare(doc_id, *a, **kw)

    def away(*_: Any, **__: Any) -> Any:
        raise MemoryUnavailable("the Milvus collection m__g0001 is NotLoad")

    monkeypatch.setattr(engine, "prepare_document", counted)
    monkeypatch.setattr(engine, "store_document", away)
    sessions = make_sessions(sqlite_url)
    with sessions.begin() as s:
        [acc] = DocumentRepository(s).add_many(
            [NewDocument(text="the a of and", published_at=dt.date(2017, 2, 7), source="t")]
        )
    w = IngestWorker(engine, sessions, settings)
    w.start(timeout=1)
    try:
        assert engine.memory_probes == 0  # nothing failed yet: no question asked
        assert w.step() == Processed(acc.id, "retrying")
        engine.memory_away = "the Milvus collection m__g0001 is NotLoad"
        with sessions.begin() as s:  # due again now: only the memory keeps it waiting
            DocumentRepository(s).get(acc.id).retry_at = None
        assert [w.step(), w.step()] == [
            Waiting(engine.memory_away, 2),
            Waiting(engine.memory_away, 3),
        ]
        assert (w.memory_waits, engine.memory_probes, prepared) == (2, 2, [acc.id])
        assert w._pause(0.0) == 2.0  # 0.5 s * 2**(3 - 1): the backoff grew with the waits
        with sessions() as s:
            d = s.get(Document, acc.id)
            assert d is not None and (d.status, d.attempts) == ("pending", 1)
        engine.memory_away = None
        monkeypatch.undo()
        out = w.step()
        assert isinstance(out, Processed) and (out.document_id, out.status) == (acc.id, "done")
        assert (w.unavailable_streak, w.memory_waits) == (0, 2)
    finally:
        w.lock.release()
