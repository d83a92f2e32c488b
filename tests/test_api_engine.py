"""The service over the real engine: tiny random Llama for the flow and a real kill of
the worker process between append and commit; the bundled SmolLM2 in one slow test."""

from __future__ import annotations

import datetime as dt
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from memlm.calibrator.lexical import LexicalStats
from memlm.datastore import Datastore
from memlm.db.models import DayStat, Document
from memlm.db.repositories import BuildRepository, DocumentRepository, NewDocument, SpanRepository
from memlm.engine import day_number, open_engine, policy_factory
from memlm.index import current_version, list_versions
from memlm.settings import Settings
from service.app import create_app, sync_index
from tests.processes import ROOT, worker_env
from tests.service_helpers import ADMIN, INGEST, READ, doc, make_settings
from workers.ingest import IngestWorker

TEXT = (
    "The central bank of Ireland raised its key interest rate on Tuesday, citing "
    "stronger growth in Dublin and a tight labour market across the country."
)
OTHER = "Heavy snow closed schools in the north of Scotland for a second day on Friday."


@pytest.fixture(scope="module")
def tiny() -> Any:
    from memlm.encoder import Encoder

    return Encoder.load("tiny-llama", threads=1)


class Env:
    def __init__(self, client: TestClient, engine: Any, worker: IngestWorker) -> None:
        self.client, self.engine, self.worker = client, engine, worker

    def drain(self) -> int:
        n = 0
        while self.worker.step() is not None:
            n += 1
        return n

    def sync(self) -> None:
        self.client.portal.call(sync_index, self.client.app.state.memlm)  # type: ignore[union-attr,attr-defined]


def _env(settings: Settings, encoder: Any) -> Iterator[Env]:
    engine = open_engine(settings, encoder=encoder)
    app = create_app(settings, engine=engine, run_worker=False, poll=False)
    with TestClient(app) as client:
        worker = IngestWorker(
            engine, app.state.memlm.sessions, settings, policy_factory=policy_factory
        )
        worker.start(timeout=5)
        try:
            yield Env(client, engine, worker)
        finally:
            worker.lock.release()


def test_flow_with_a_tiny_random_llama(tmp_path: Path, sqlite_url: str, tiny: Any) -> None:
    settings = make_settings(tmp_path, sqlite_url, model="tiny-llama", knn_lambda=0.25)
    for env in _env(settings, tiny):
        c = env.client
        context = TEXT[: TEXT.index(" interest")]  # "... raised its key"
        before = c.post("/predict", headers=READ, json={"context": context, "neighbours": 3}).json()
        assert before["lambda"] == 0.0 and before["neighbours"] == []

        [acc] = c.post(
            "/ingest", headers=INGEST, json={"documents": [doc(TEXT, title="Rates")]}
        ).json()["documents"]
        assert env.drain() == 1
        d = c.get(f"/documents/{acc['id']}", headers=INGEST).json()
        n_tokens = len(env.engine.encoder.tokenize(TEXT))
        assert d["status"] == "done" and d["tokens_seen"] == n_tokens - 1
        # A random model is surprised by every token: MoNIM (delta -1.5) stores them all.
        assert d["tokens_stored"] == n_tokens - 1
        assert (d["entry_start"], d["entry_end"]) == (0, n_tokens - 1)

        build = c.post("/admin/rebuild", headers=ADMIN).json()
        assert env.drain() == 1
        # the answer names the version it searched, before the API's poll has seen the build
        first = c.post("/predict", json={"context": context}).json()
        assert first["index_version"] == str(env.engine.memory.index.version) == "1"
        env.sync()
        build = c.get(f"/admin/builds/{build['id']}", headers=ADMIN).json()
        assert build["status"] == "done" and build["entries"] == n_tokens - 1
        assert build["version"] == str(env.engine.memory.index.version)

        after = c.post("/predict", headers=READ, json={"context": context, "neighbours": 3}).json()
        assert after["lambda"] == 0.25 and after["index_version"] == build["version"]
        top = after["neighbours"][0]
        # The same context was memorised: its own entry is at distance 0.
        assert top["document_id"] == acc["id"] and top["distance"] == pytest.approx(0, abs=1e-3)
        assert top["token"] == " interest" and top["title"] == "Rates"
        assert "[[ interest]]" in top["snippet"]
        # the worker stored the tokenizer's offsets with the document: the snippet's source
        with env.client.app.state.memlm.sessions() as db:  # type: ignore[attr-defined]
            stored = SpanRepository(db).many([acc["id"]])[acc["id"]]
        assert stored.tolist() == [list(x) for x in env.engine.encoder.char_offsets(TEXT)]
        mix = {s["token"]: s for s in after["suggestions"]}
        s = mix[" interest"]
        assert s["knn_prob"] > 0.3
        assert s["prob"] == pytest.approx(0.75 * s["lm_prob"] + 0.25 * s["knn_prob"], rel=1e-4)
        assert (
            s["prob"]
            > {x["token"]: x for x in before["suggestions"]}.get(" interest", {"prob": 0})["prob"]
        )

        sc = c.post("/score", json={"text": TEXT}).json()
        assert len(sc["tokens"]) == len(sc["logprobs"]) == len(sc["would_store"]) == n_tokens - 1
        assert sc["ppl"] < sc["lm_ppl"]  # the memory holds this very text
        assert sc["policy"] == "monim"
        assert c.get("/admin/policy", headers=ADMIN).json()["delta"] is None  # MoNIM's -1.5
        short = c.post("/score", json={"text": "Hi"})
        assert short.status_code == 422 and short.json()["error"] == "invalid_input"

        st = c.get("/admin/stats", headers=ADMIN).json()
        assert (
            st["entries"]
            == st["tokens_stored"]
            == env.engine.memory.datastore.num_live
            == n_tokens - 1
        )
        assert st["bytes_on_disk"] > 0 and st["index"]["served_version"] == build["version"]

        assert c.delete(f"/admin/documents/{acc['id']}", headers=ADMIN).status_code == 202
        assert env.drain() == 1
        st = c.get("/admin/stats", headers=ADMIN).json()
        assert st["entries"] == 0 == st["tokens_stored"] - st["entries_forgotten"]
        gone = c.post("/predict", headers=READ, json={"context": context, "neighbours": 3}).json()
        assert gone["neighbours"] == [] and gone["lambda"] == 0.0


def test_a_build_killed_before_its_record_is_not_served_after_restart(
    tmp_path: Path, sqlite_url: str, tiny: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The builder wrote v000002 and CURRENT, then died before recording the build."""
    settings = make_settings(tmp_path, sqlite_url, model="tiny-llama")
    root = settings.datastore_dir / "index"
    for env in _env(settings, tiny):
        c = env.client
        c.post("/ingest", headers=INGEST, json={"documents": [doc(TEXT)]})
        c.post("/admin/rebuild", headers=ADMIN)
        assert env.drain() == 2  # the document, then build 1 (recorded)
        c.post("/ingest", headers=INGEST, json={"documents": [doc(OTHER)]})
        assert env.drain() == 1
        killed = c.post("/admin/rebuild", headers=ADMIN).json()
        with env.worker.sessions.begin() as s:  # what run_queued_build does before building
            claimed = BuildRepository(s).claim_queued()
            assert claimed is not None and claimed.id == killed["id"]
        with env.engine.building():
            env.engine.rebuild()  # ... and the process dies here, before BuildRepository.finish
        assert list_versions(root) == [1, 2] and current_version(root) == 2

    # An API over a read-only engine (the worker is another process) serves the record.
    engine = open_engine(settings, encoder=tiny, writer=False)
    assert engine.memory.index.version == 2  # what CURRENT names
    app = create_app(settings, engine=engine, run_worker=False, poll=False)
    with caplog.at_level(logging.WARNING), TestClient(app) as c:
        assert c.get("/readyz").json()["index_version"] == "1"
        assert c.post("/predict", json={"context": "The"}).json()["index_version"] == "1"
        assert list_versions(root) == [1, 2]  # a reader deletes nothing
    assert "not serving index version 2: no build record names it" in caplog.messages

    # The worker's start deletes the orphan, points CURRENT back, and builds the request again.
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        for env in _env(settings, tiny):
            assert "deleted index version 2: no build record names it" in caplog.messages
            assert list_versions(root) == [1] and current_version(root) == 1
            assert env.client.get("/readyz").json()["index_version"] == "1"
            build = env.client.get(f"/admin/builds/{killed['id']}", headers=ADMIN).json()
            assert build["status"] == "queued"  # released by the worker's recovery
            assert env.drain() == 1
            env.sync()
            build = env.client.get(f"/admin/builds/{killed['id']}", headers=ADMIN).json()
            assert (build["status"], build["version"]) == ("done", "2")
            assert env.client.get("/readyz").json()["index_version"] == "2"
            assert list_versions(root) == [1, 2] and current_version(root) == 2


def test_worker_process_killed_between_append_and_commit(
    tmp_path: Path, sqlite_url: str, tiny: Any, make_sessions: Any
) -> None:
    settings = make_settings(tmp_path, sqlite_url, model="tiny-llama", calibrator_sample=1.0)
    sessions = make_sessions(sqlite_url)
    with sessions.begin() as s:
        ids = [
            a.id
            for a in DocumentRepository(s).add_many(
                NewDocument(text=t, published_at=dt.date(2017, 2, 7), source="s")
                for t in (TEXT, OTHER)
            )
        ]
    env = worker_env(
        settings,
        MEMLM_DATABASE_URL=sqlite_url,
        MEMLM_POLICY=None,  # the settings' own policy
        MEMLM_WORKER_POLL_SECONDS=None,
        MEMLM_CALIBRATOR_SAMPLE="1.0",  # both documents are recorded for the calibrator
    )
    proc = subprocess.run(
        [sys.executable, "-m", "memlm.cli", "worker", "--crash-at", "after_append"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    n_first = len(tiny.tokenize(TEXT)) - 1
    on_disk = Datastore.open(settings.datastore_dir / "datastore")
    assert len(on_disk) == n_first  # appended durably, never committed
    on_disk.close()
    with sessions() as s:
        assert s.get(Document, ids[0]).status == "processing"

    engine = open_engine(settings, encoder=tiny)
    worker = IngestWorker(engine, sessions, settings, policy_factory=policy_factory)
    try:
        rec = worker.start(timeout=5)
        assert (rec.released_documents, rec.datastore_before, rec.datastore_after) == (
            1,
            n_first,
            0,
        )
        assert worker.step() is not None and worker.step() is not None and worker.step() is None
    finally:
        worker.lock.release()
    n_second = len(tiny.tokenize(OTHER)) - 1
    with sessions() as s:
        docs = [s.get(Document, i) for i in ids]
        assert [(d.status, d.entry_start, d.entry_end) for d in docs if d] == [
            ("done", 0, n_first),
            ("done", n_first, n_first + n_second),
        ]
        [day] = s.scalars(select(DayStat)).all()
        assert (day.documents, day.tokens_stored) == (2, n_first + n_second)
    assert engine.stats()["entries"] == n_first + n_second
    # The killed run had recorded the first document's held-out tokens and counted its
    # lexical statistics; the re-run did neither again.
    pending = sorted(p.name for p in (settings.datastore_dir / "calibrator-pending").iterdir())
    assert pending == [
        f"d{day_number(dt.date(2017, 2, 7))}-doc{ids[0]}-n{n_first}.npz",
        f"d{day_number(dt.date(2017, 2, 7))}-doc{ids[1]}-n{n_second}.npz",
    ]
    want = LexicalStats(tiny.vocab_size)
    for t in (TEXT, OTHER):
        want.update(np.asarray(tiny.tokenize(t)))
    lex = LexicalStats.load(settings.datastore_dir / "lexical.npz", tiny.vocab_size)
    assert np.array_equal(lex.count, want.count) and lex.docs == set(ids)
    assert np.array_equal(lex.successors, want.successors)


@pytest.mark.slow
def test_bundled_smollm2_neighbours_come_from_the_ingested_article(
    tmp_path: Path, sqlite_url: str
) -> None:
    from memlm.encoder import Encoder

    # The memory's pull on the words is the point here, so a fixed lambda of 0.25 (the
    # served default, 0.005, barely moves a word before a build tunes it)
    settings = make_settings(tmp_path, sqlite_url, knn_k=64, knn_temperature=5.0, knn_lambda=0.25)
    for env in _env(settings, Encoder.load("smollm2-135m", threads=1)):
        c = env.client
        docs = [doc(TEXT, title="Rates", source="news"), doc(OTHER, title="Snow", source="news")]
        ids = [
            d["id"]
            for d in c.post("/ingest", headers=INGEST, json={"documents": docs}).json()["documents"]
        ]
        assert env.drain() == 2
        st = c.get("/admin/stats", headers=ADMIN).json()
        # A real LM predicts many tokens well: MoNIM stores only part of them.
        assert 0 < st["tokens_stored"] < st["tokens_seen"]
        assert st["entries"] == st["tokens_stored"]
        pred = c.post(
            "/predict",
            headers=READ,
            json={"context": "Heavy snow closed schools in the north of", "neighbours": 5},
        ).json()
        assert pred["neighbours"] and pred["neighbours"][0]["document_id"] == ids[1]
        assert pred["neighbours"][0]["title"] == "Snow"
        words = c.post(
            "/predict", json={"context": "Heavy snow closed schools in the north of", "words": 3}
        ).json()["words"]
        scotland = next(w for w in words if w["word"] == " Scotland")
        assert scotland["knn_prob"] > 0.5 and scotland["prob"] > scotland["lm_prob"]
        sc = c.post("/score", json={"text": OTHER}).json()
        assert sc["ppl"] < sc["lm_ppl"]


SECRET = (
    "Mrs Quillfeather of Zorblatt Lane told the parish council on Monday that her "
    "neighbour's hedge had grown over the public footpath again."
)


def _files_blob(root: Path) -> bytes:
    """Every byte of every file under ``root`` (data directory, SQLite database, WAL)."""
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())


def test_forget_leaves_no_byte_of_the_document(tmp_path: Path, sqlite_url: str, tiny: Any) -> None:
    from memlm.index import list_versions

    settings = make_settings(
        tmp_path, sqlite_url, model="tiny-llama", calibrator_training=True, calibrator_sample=1.0
    )
    for env in _env(settings, tiny):
        c = env.client
        ds = env.engine.memory.datastore
        docs = [doc(TEXT, title="Rates"), doc(SECRET, title="Hedge"), doc(OTHER)]
        ids = [
            d["id"]
            for d in c.post("/ingest", headers=INGEST, json={"documents": docs}).json()["documents"]
        ]
        assert env.drain() == 3
        c.post("/admin/rebuild", headers=ADMIN)
        assert env.drain() == 1
        env.sync()
        secret = c.get(f"/documents/{ids[1]}", headers=ADMIN).json()
        span = np.arange(secret["entry_start"], secret["entry_end"])
        assert len(span) == secret["tokens_stored"] == len(tiny.tokenize(SECRET)) - 1
        keys16 = ds.keys(span)
        keys32 = keys16.astype(np.float32)  # what the flat index version holds
        # Before: the grep finds the text and the keys, and the document is served.
        blob = _files_blob(tmp_path)
        assert b"Zorblatt" in blob
        assert all(k.tobytes() in blob for k in keys16)
        assert all(k.tobytes() in blob for k in keys32)
        context = SECRET[: SECRET.index(" Lane")]
        ask = {"context": context, "neighbours": 8}
        before = c.post("/predict", headers=READ, json=ask).json()
        assert before["neighbours"][0]["document_id"] == ids[1]

        # Right after the request, before any worker step: never a neighbour again.
        assert c.delete(f"/admin/documents/{ids[1]}", headers=ADMIN).json()["status"] == (
            "forgetting"
        )
        now = c.post("/predict", headers=READ, json=ask).json()
        assert len(now["neighbours"]) == 8
        assert ids[1] not in {n["document_id"] for n in now["neighbours"]}
        # A forget another API process accepted is hidden here at the next index sync.
        snow = {"context": OTHER[: OTHER.index(" schools")], "neighbours": 8}
        assert (
            c.post("/predict", headers=READ, json=snow).json()["neighbours"][0]["document_id"]
            == ids[2]
        )
        with env.client.app.state.memlm.sessions.begin() as s:  # type: ignore[attr-defined]
            DocumentRepository(s).request_forget(ids[2])
        env.sync()
        hidden = c.post("/predict", headers=READ, json=snow).json()["neighbours"]
        assert len(hidden) == 8 and ids[2] not in {n["document_id"] for n in hidden}
        n_other = c.get(f"/documents/{ids[2]}", headers=ADMIN).json()["tokens_stored"]

        assert env.drain() == 2  # the worker deletes them ...
        c.post("/admin/rebuild", headers=ADMIN)
        assert env.drain() == 1  # ... and the next build compacts
        env.sync()
        blob = _files_blob(tmp_path)
        assert b"Zorblatt" not in blob and b"Quillfeather" not in blob
        assert not any(k.tobytes() in blob for k in keys16)
        assert not any(k.tobytes() in blob for k in keys32)
        assert list_versions(settings.datastore_dir / "index") == [2]

        st = c.get("/admin/stats", headers=ADMIN).json()
        assert st["documents"] == {"done": 1, "forgotten": 2}
        assert st["entries_forgotten"] == len(span) + n_other
        assert st["entries"] == st["tokens_stored"] - st["entries_forgotten"] == ds.num_live
        assert ds.stats()["rows"] == ds.num_live == len(ds) - len(span) - n_other
        # Both documents' rows leave; the segment keeps a 4-byte id for each remaining row.
        row = 2 * ds.dim + 20
        assert st["bytes_reclaimed"] == (len(span) + n_other) * row - 4 * ds.num_live > 0
        gone = c.get(f"/documents/{ids[1]}", headers=ADMIN).json()
        assert (gone["status"], gone["title"], gone["tokens_stored"]) == (
            "forgotten",
            "Hedge",
            len(span),
        )
        after = c.post("/predict", headers=READ, json=ask).json()
        assert ids[1] not in {n["document_id"] for n in after["neighbours"]}


@pytest.mark.slow
def test_bundled_smollm2_score_of_a_heldout_article_is_not_worse_than_the_bare_lm(
    tmp_path: Path, sqlite_url: str
) -> None:
    """A new deployment (a few articles ingested, no calibrator, too few held-out tokens to
    tune the constant) serves the evidence interpolation: a held-out article of the same day
    scores within 0.5% of the bare LM (the old default, lambda 0.25 at T = 5, lost up to
    16%), while an ingested article is recalled: its perplexity falls far below the LM's
    and /predict along it ranks its own next token first."""
    from memlm.calibrator.constant import SERVED_DEFAULT
    from memlm.corpus import load_corpus
    from memlm.encoder import Encoder
    from memlm.evaluate import plan_stream

    [plan] = plan_stream(load_corpus("news"), days=1, start=dt.date(2017, 2, 13))
    articles = plan.train[:4]
    settings = make_settings(tmp_path, sqlite_url)
    for env in _env(settings, Encoder.load("smollm2-135m", threads=1)):
        c = env.client
        docs = [doc(a.text, day="2017-02-13", source="news", external_id=a.id) for a in articles]
        assert c.post("/ingest", headers=INGEST, json={"documents": docs}).status_code == 202
        assert env.drain() == 4
        build = c.post("/admin/rebuild", headers=ADMIN).json()
        assert env.worker.step() is not None
        env.sync()
        b = c.get(f"/admin/builds/{build['id']}", headers=ADMIN).json()
        assert b["interpolation"]["source"] == "default"
        assert b["interpolation"]["lambda_source"] == "evidence"
        st = c.get("/admin/stats", headers=ADMIN).json()
        assert st["entries"] > 0 and st["index"]["served_version"] == b["version"]
        served = st["interpolation"]
        assert served["k"] == SERVED_DEFAULT.k and served["lambda_source"] == "evidence"
        assert served["evidence"]["source"] in ("prior", "fitted")
        sc = c.post("/score", json={"text": plan.test[0].text}).json()
        assert sc["ppl"] <= sc["lm_ppl"] * 1.005, (sc["ppl"], sc["lm_ppl"])
        seen = c.post("/score", json={"text": articles[0].text[:600]}).json()
        assert seen["ppl"] < 0.5 * seen["lm_ppl"], (seen["ppl"], seen["lm_ppl"])
        words = articles[0].text[:600].split(" ")
        hits = 0
        for i in range(5, 25):
            context, nxt = " ".join(words[:i]), " " + words[i]
            top = c.post("/predict", json={"context": context, "top_n": 1}).json()
            hits += nxt.startswith(top["suggestions"][0]["token"])
        assert hits >= 16, hits  # the LM alone ranks about a third of them first


def test_stats_name_the_version_a_build_in_this_process_serves(
    tmp_path: Path, sqlite_url: str, tiny: Any
) -> None:
    """With the embedded worker, a build swaps the index in this process: /admin/stats says
    so at once, not only after the API's next poll of the build records."""
    settings = make_settings(tmp_path, sqlite_url, model="tiny-llama")
    for env in _env(settings, tiny):
        c = env.client
        c.post("/ingest", headers=INGEST, json={"documents": [doc(TEXT)]})
        assert env.drain() == 1
        assert c.get("/admin/stats", headers=ADMIN).json()["index"]["served_version"] is None
        build = c.post("/admin/rebuild", headers=ADMIN).json()
        assert env.drain() == 1  # the build, no poll in between
        b = c.get(f"/admin/builds/{build['id']}", headers=ADMIN).json()
        assert b["version"] == "1"
        assert c.get("/admin/stats", headers=ADMIN).json()["index"]["served_version"] == "1"
