"""The running service trains its own calibrator: the worker records held-out tokens while
ingesting, each rebuild trains the calibrator beside the new index version, the API serves
its lambda; a crash between append and commit records and counts nothing twice."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from memlm.calibrator import Calibrator, epochs_for, token_features
from memlm.calibrator.heldout import HeldOutRecorder
from memlm.calibrator.lexical import LexicalStats
from memlm.db.repositories import DocumentRepository, NewDocument
from memlm.engine import open_engine, policy_factory
from memlm.knnlm import has_neighbours, interpolate, knn_logprob
from service.app import create_app, sync_index
from tests.service_helpers import ADMIN, make_settings
from workers.builder import enqueue_rebuild
from workers.ingest import IngestWorker, SimulatedCrash

DAY_A, DAY_B = dt.date(2017, 2, 7), dt.date(2017, 2, 8)
TEXTS = [
    "The harbour authority in Port Elsinore announced a new ferry timetable on Monday.",
    "Ferry operators said the new timetable would add two crossings every weekday morning.",
    "The central bank left its key interest rate unchanged and warned about rising prices.",
    "Heavy snow closed schools in the north of Scotland for a second day on Friday.",
    "Port Elsinore's mayor welcomed the ferry timetable and promised a bigger car park.",
    "Economists expect the central bank to raise interest rates before the summer.",
    "Schools in Scotland reopened after the snow, but several rural roads stayed closed.",
    "The harbour authority said ticket prices for the ferry would not change this year.",
]
# Ids 1-4 are published on DAY_A, 5-8 on DAY_B. With a sample share of 0.5 and seed 0 the
# seeded draws (crc32 of "0:<id>" / 2**32) are 0.685, 0.212, 0.255, 0.872, 0.657, 0.192,
# 0.274, 0.838: documents 2, 3, 6, 7 are sampled, and 1 and 5 are each day's first.
RECORDED_A, RECORDED_B = [1, 2, 3], [5, 6, 7]


@pytest.fixture(scope="module")
def tiny() -> Any:
    from memlm.encoder import Encoder

    return Encoder.load("tiny-llama", threads=1)


def _records(root: Path) -> dict[int, dict[str, np.ndarray]]:
    rec = HeldOutRecorder(root, None)  # type: ignore[arg-type]
    out = {}
    for p in rec.pending().paths:
        doc = int(p.name.split("-doc")[1].split("-")[0])
        out[doc] = HeldOutRecorder.load([p])
    return out


def test_worker_records_rebuild_trains_and_api_serves_the_calibrator(
    tmp_path: Path, sqlite_url: str, tiny: Any, make_sessions: Any
) -> None:
    scored = [len(tiny.tokenize(t)) - 1 for t in TEXTS]  # tokens scored per document
    tokens_a = sum(scored[i - 1] for i in RECORDED_A)
    tokens_b = sum(scored[i - 1] for i in RECORDED_B)
    settings = make_settings(
        tmp_path,
        sqlite_url,
        model="tiny-llama",
        policy="fullmem",  # FullMem does not search: sampled documents get their own search
        knn_k=8,
        knn_temperature=1.0,
        knn_lambda=0.5,
        calibrator_sample=0.5,
        calibrator_min_tokens=tokens_a + 1,  # day A alone is too little, A + B is enough
    )
    sessions = make_sessions(sqlite_url)
    with sessions.begin() as s:
        ids = [
            a.id
            for a in DocumentRepository(s).add_many(
                NewDocument(text=t, published_at=DAY_A if i < 4 else DAY_B, source="s")
                for i, t in enumerate(TEXTS)
            )
        ]
    assert ids == list(range(1, 9))
    pending = settings.datastore_dir / "calibrator-pending"

    # --- day A, with a crash between the append and the commit of document 2 --------------
    engine = open_engine(settings, encoder=tiny)
    worker = IngestWorker(engine, sessions, settings, policy_factory=policy_factory)
    worker.start(timeout=5)
    worker.step()
    with pytest.raises(SimulatedCrash):
        worker.step(crash_at="after_append")
    before_restart = _records(pending)
    assert sorted(before_restart) == [1, 2]
    worker.lock.release()
    engine.memory.datastore.close()  # the process is gone

    engine = open_engine(settings, encoder=tiny)
    worker = IngestWorker(engine, sessions, settings, policy_factory=policy_factory)
    worker.start(timeout=5)
    assert worker.step() is not None and worker.step() is not None  # documents 2 and 3
    worker.step()  # document 4: not sampled
    records = _records(pending)
    assert sorted(records) == RECORDED_A  # document 2 once, its first record unchanged
    for name, arr in before_restart[2].items():
        np.testing.assert_array_equal(records[2][name], arr)
    assert len(records[2]["day"]) == scored[1]
    assert records[2]["distances"].shape == (scored[1], 10)  # max(k = 8, 10) neighbours
    assert int(has_neighbours(np.where(records[1]["values"] >= 0, 0, -1)).sum()) == 0
    # lexical statistics: each document counted exactly once, document 2 included
    want = LexicalStats(tiny.vocab_size)
    for t in TEXTS[:4]:
        want.update(np.asarray(tiny.tokenize(t)))
    assert np.array_equal(engine.calibration.lexical.count, want.count)
    assert np.array_equal(engine.calibration.lexical.successors, want.successors)
    assert engine.calibration.lexical.docs == {1, 2, 3, 4}
    # the record of document 2 saw the statistics of documents 1 only
    only_1 = LexicalStats(tiny.vocab_size)
    only_1.update(np.asarray(tiny.tokenize(TEXTS[0])))
    out2 = tiny.encode_ids(tiny.tokenize(TEXTS[1]))
    np.testing.assert_array_equal(records[2]["lexical"], only_1.features(out2.prev_tokens))

    app = create_app(settings, engine=engine, run_worker=False, poll=False)
    with TestClient(app) as c:

        def rebuild() -> dict[str, Any]:
            row, _ = enqueue_rebuild(sessions, requested_by="test")
            assert worker.step() == row.request_key
            c.portal.call(sync_index, app.state.memlm)  # type: ignore[union-attr]
            return dict(c.get(f"/admin/builds/{row.id}", headers=ADMIN).json())

        st = c.get("/admin/stats", headers=ADMIN).json()["calibrator"]
        assert (st["active"], st["training"], st["pending_tokens"]) == (False, True, tokens_a)

        # --- rebuild 1: too few held-out tokens, no calibrator ------------------------------
        b1 = rebuild()
        assert b1["calibrator"] == {
            "merged_tokens": tokens_a,
            "training_tokens": tokens_a,
            "new_tokens": tokens_a,
            "trained": False,
            "reason": f"{tokens_a} held-out tokens, fewer than the {tokens_a + 1} training needs",
            "carried_from": None,
        }
        assert _records(pending) == {}  # merged into the training set
        assert c.get("/readyz").json()["calibrator_version"] is None

        # --- day B, rebuild 2 trains the calibrator beside version 2 ------------------------
        for _ in range(4):
            worker.step()
        assert sorted(_records(pending)) == RECORDED_B
        b2 = rebuild()
        cal_report = b2["calibrator"]
        assert (cal_report["trained"], b2["version"]) == (True, "2")
        assert cal_report["training_tokens"] == tokens_a + tokens_b
        assert cal_report["merged_tokens"] == tokens_b
        assert cal_report["new_tokens"] == tokens_a + tokens_b  # none trained on before
        with_neighbours = tokens_a + tokens_b - scored[0]  # document 1 met an empty memory
        for name in ("calibrator", "gate"):
            r = cal_report[name]
            assert r["train_tokens"] + r["val_tokens"] == with_neighbours
            assert r["warm_start"] is False and 1 <= r["best_epoch"] + 1 <= r["epochs"] + 1
        vdir = settings.datastore_dir / "index" / "v000002"
        saved = Calibrator.load(vdir / "calibrator")
        assert saved.meta["index_version"] == 2 and (vdir / "gate" / "calibrator.json").exists()
        # Each day's tokens fill less than one 64-token validation block, so the calibrator
        # validated on nothing: it cannot have beaten the constant, which is served.
        choice = b2["interpolation"]
        assert (choice["source"], choice["k"], choice["temperature"], choice["lambda"]) == (
            "fixed",
            8,
            1.0,
            0.5,
        )
        assert choice["calibrator"]["calibrator_version"] == 2
        assert choice["calibrator"]["val_tokens"] == 0 and choice["lambda_source"] == "constant"
        assert c.get("/readyz").json() == {
            "status": "ready",
            "model": "tiny-llama",
            "index_version": "2",
            "calibrator_version": None,
            "device": "cpu",
            "precision": "float32",
        }

        # --- rebuild 3: nothing new; the calibrator is carried beside version 3 ------------
        b3 = rebuild()
        assert b3["calibrator"]["trained"] is False
        assert (b3["calibrator"]["merged_tokens"], b3["calibrator"]["new_tokens"]) == (0, 0)
        assert b3["calibrator"]["reason"] == "no new held-out tokens"
        assert b3["calibrator"]["carried_from"] == 2
        st = c.get("/admin/stats", headers=ADMIN).json()["calibrator"]
        assert not st["active"] and (st["index_version"], st["trained_for"]) == ("3", "2")
        # the build record and /admin/stats show the choice written beside version 3
        on_disk = json.loads(
            (settings.datastore_dir / "index" / "v000003" / "interpolation.json").read_text()
        )
        assert b3["interpolation"] == on_disk
        assert on_disk["calibrator"]["calibrator_version"] == 3  # the carried copy, compared again
        assert on_disk["tokens"] == tokens_a + tokens_b
        assert c.get("/admin/stats", headers=ADMIN).json()["interpolation"] == {
            "index_version": "3",
            "chosen_for": "3",
            "k": 8,
            "temperature": 1.0,
            "lambda": 0.5,
            "source": "fixed",
            "lambda_source": "constant",
            "evidence": None,  # lambda fixed by the settings: no evidence interpolation
            "heldout_tokens": tokens_a + tokens_b,
            "heldout_ppl": on_disk["ppl"],
            "heldout_bare_ppl": on_disk["bare_ppl"],
            "calibrator_val_ppl": None,
            "constant_val_ppl": None,
        }
        assert st["pending_tokens"] == 0 and st["gate"] is True

        # --- the API serves the constant 0.5, not the calibrator that did not beat it -------
        context = TEXTS[0][: TEXTS[0].index(" ferry")]
        pred = c.post("/predict", json={"context": context}).json()
        ids_ctx = tiny.tokenize(context)
        out = tiny.encode_ids(ids_ctx + [ids_ctx[0]])  # the last row predicts after context
        dist, _, vals = engine.memory.index.search_values(out.keys[-1:], 8)
        lex = LexicalStats.load(vdir.with_name("v000003") / "lexical.npz", tiny.vocab_size)
        feats = token_features(
            out.top_logprob[-1:], out.entropy[-1:], lex.features(out.prev_tokens[-1:]), dist, vals
        )
        want_lam = float(saved.predict({n: feats[n] for n in saved.cfg.features})[0])
        assert pred["lambda"] == 0.5 and want_lam != 0.5

        text = TEXTS[4]
        sc = c.post("/score", json={"text": text}).json()
        o = tiny.encode_ids(tiny.tokenize(text))
        d, i, v = engine.memory.index.search_values(o.keys, 8)
        f = token_features(o.top_logprob, o.entropy, lex.features(o.prev_tokens), d, v)
        lam = np.full(len(o), 0.5)
        assert not np.allclose(saved.predict({n: f[n] for n in saved.cfg.features}), lam)
        knn = knn_logprob(d, i, v, o.targets[:, None], 1.0)[:, 0]
        want_lp = interpolate(o.target_logprob, knn, lam, has_neighbours(i))
        np.testing.assert_allclose(sc["logprobs"], want_lp, rtol=1e-5)

        # --- forgetting a document takes its rows out of the training set -----------------
        assert c.delete("/admin/documents/6", headers=ADMIN).status_code == 202
        worker.step()
        docs, per_day = engine.calibration.training_index()
        assert docs == {1, 2, 3, 5, 7}
        assert sum(per_day.values()) == tokens_a + tokens_b - scored[5]
        # ... and its tokens out of the lexical statistics
        kept = LexicalStats(tiny.vocab_size)
        for t in TEXTS[:5] + TEXTS[6:]:
            kept.update(np.asarray(tiny.tokenize(t)))
        lexical = engine.calibration.lexical
        assert np.array_equal(lexical.count, kept.count)
        assert np.array_equal(lexical.successors, kept.successors)
        assert lexical.docs == {1, 2, 3, 4, 5, 7, 8} and lexical.forgotten == {6}

        # --- a new day: rebuild 4 trains further from version 3's model (warm start) ------
        late = "Ferry tickets in Port Elsinore sold out within an hour of the new timetable."
        with sessions.begin() as s:
            [acc] = DocumentRepository(s).add_many(
                [NewDocument(text=late, published_at=DAY_B + dt.timedelta(days=1), source="s")]
            )
        worker.step()  # the first document of its day: recorded
        n_late = len(tiny.tokenize(late)) - 1
        b4 = rebuild()["calibrator"]
        assert (b4["trained"], b4["merged_tokens"], b4["new_tokens"]) == (True, n_late, n_late)
        assert b4["training_tokens"] == tokens_a + tokens_b - scored[5] + n_late
        r = b4["calibrator"]
        assert r["warm_start"] is True
        assert r["train_tokens"] + r["val_tokens"] == with_neighbours - scored[5] + n_late
        first = int(saved.meta["first_size"])
        assert r["epochs"] == epochs_for(saved.cfg, first, r["train_tokens"])
        v4 = Calibrator.load(settings.datastore_dir / "index" / "v000004" / "calibrator")
        assert v4.meta["first_size"] == first and v4.meta["version"] == saved.meta["version"] + 1
    worker.lock.release()
