"""The dashboard's data and session, without a browser: GET /admin/stats/history agrees
with the database and the engine, the cookie opens only the dashboard's GET routes, and
the held-out perplexity per day matches the records the worker wrote."""

from __future__ import annotations

import datetime as dt
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from memlm.calibrator.heldout import HeldOutRecorder
from memlm.db.models import Document
from memlm.knnlm import KnnParams, has_neighbours, interpolate, knn_logprob
from service.app import create_app, sync_index
from service.dashboard import history
from service.dashboard.auth import COOKIE, session_value, valid_session
from tests.fakes import FakeEngine
from tests.service_helpers import ADMIN, INGEST, doc, make_settings
from workers.ingest import IngestWorker

ADMIN_TOKEN = ADMIN["Authorization"].split()[1]

# Three stream days; "zzz" makes the fake engine fail a document for good.
STREAM = [
    ("the cat sat on the mat", "2017-02-07"),
    ("the cat sat on a chair in the hall", "2017-02-07"),
    ("a dog ran to the park and the cat sat", "2017-02-08"),
    ("the cat sat on the mat again today", "2017-02-09"),
    ("zzz cannot be read", "2017-02-09"),
]


class Service:
    def __init__(self, client: TestClient, engine: FakeEngine, worker: IngestWorker) -> None:
        self.client, self.engine, self.worker = client, engine, worker

    def drain(self) -> None:
        while self.worker.step() is not None:
            pass

    @property
    def sessions(self) -> Any:
        return self.client.app.state.memlm.sessions  # type: ignore[attr-defined]


@pytest.fixture
def service(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Service]:
    """The API over the fake engine with a worker; SQLite unless the test is parametrized
    with ``DATABASES`` (indirect)."""
    db = getattr(request, "param", "sqlite")
    url = request.getfixturevalue("sqlite_url" if db == "sqlite" else "pg_url")
    settings = make_settings(tmp_path, url)
    engine = FakeEngine(fail_on="zzz")
    app = create_app(settings, engine=engine, run_worker=False, poll=False)
    with TestClient(app) as client:
        worker = IngestWorker(engine, app.state.memlm.sessions, settings)
        worker.start(timeout=5)
        try:
            yield Service(client, engine, worker)
        finally:
            worker.lock.release()


def _ingest(svc: Service, items: list[tuple[str, str]]) -> list[int]:
    body = {"documents": [doc(t, day=d, source=f"s{i}") for i, (t, d) in enumerate(items)]}
    r = svc.client.post("/ingest", headers=INGEST, json=body)
    assert r.status_code == 202, r.text
    return [d["id"] for d in r.json()["documents"]]


DATABASES = pytest.mark.parametrize(
    "service", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)


@DATABASES
def test_empty_service_answers_empty_series(service: Service) -> None:
    r = service.client.get("/admin/stats/history", headers=ADMIN)
    assert r.status_code == 200
    d = r.json()
    assert d["model"] == "ready" and d["stats"]["tokens_seen"] == 0
    assert d["days"] == [] and d["builds"] == [] and d["throughput"]["points"] == []
    assert d["queue"]["counts"] == dict.fromkeys(
        ("pending", "processing", "done", "failed", "forgetting", "forgotten"), 0
    )
    assert d["failed"] == {"total": 0, "documents": []}
    # the memory now, from the engine: empty
    assert [(m["label"], m["entries"]) for m in d["memory"]] == [("now", 0)]
    assert d["heldout"]["days"] == [] and d["heldout"]["note"]


@DATABASES
def test_history_agrees_with_the_database_and_the_engine(service: Service) -> None:
    c = service.client
    ids = _ingest(service, STREAM)
    service.drain()
    build = c.post("/admin/rebuild", headers=ADMIN).json()
    service.drain()
    sizes_at_build = {k: service.engine.stats()[k] for k in ("bytes_on_disk", "bytes_in_ram")}
    # forget document 2 (day 1), then more entries after the build
    assert c.delete(f"/admin/documents/{ids[1]}", headers=ADMIN).status_code == 202
    _ingest(service, [("one more line of the hall", "2017-02-09")])
    service.drain()
    c.portal.call(sync_index, c.app.state.memlm)  # type: ignore[union-attr,attr-defined]

    d = c.get("/admin/stats/history", headers=ADMIN).json()
    with service.sessions() as s:
        docs = s.scalars(select(Document).order_by(Document.id)).all()
    per_day: dict[str, list[int]] = {}
    forgotten_per_day: dict[str, int] = {}
    for x in docs:
        if x.tokens_seen is None:
            continue
        day = x.published_at.isoformat()
        acc = per_day.setdefault(day, [0, 0, 0])
        acc[0] += 1
        acc[1] += x.tokens_seen
        acc[2] += x.tokens_stored or 0
        if x.status == "forgotten":
            forgotten_per_day[day] = forgotten_per_day.get(day, 0) + (x.tokens_stored or 0)
    assert (
        [p["day"] for p in d["days"]]
        == sorted(per_day)
        == ["2017-02-07", "2017-02-08", "2017-02-09"]
    )
    seen_c = stored_c = live_c = 0
    for p in d["days"]:
        n, seen, stored = per_day[p["day"]]
        seen_c, stored_c = seen_c + seen, stored_c + stored
        live_c += stored - forgotten_per_day.get(p["day"], 0)
        assert (p["documents"], p["tokens_seen"], p["tokens_stored"]) == (n, seen, stored)
        assert p["memrate"] == pytest.approx(stored / seen)
        assert p["cumulative_memrate"] == pytest.approx(stored_c / seen_c)
        assert p["cumulative_entries"] == live_c
        assert p["policies"] == ["monim"]
    assert d["days"][0]["entries_forgotten"] == forgotten_per_day["2017-02-07"] > 0
    # the live entries of the last day are the engine's live entries
    assert live_c == d["stats"]["entries"] == service.engine.stats()["entries"]
    # MemRate differs between days (MoNIM skips pairs it has): the chart has a shape
    assert len({round(p["memrate"], 6) for p in d["days"]}) > 1

    # memory size: the build (its entries and sizes as the engine reported them), then now
    [at_build, now] = d["memory"]
    assert at_build["label"] == "index v1" and at_build["entries"] == build_entries(c, build)
    assert {k: at_build[k] for k in sizes_at_build} == sizes_at_build
    assert now["label"] == "now"
    assert (now["entries"], now["bytes_on_disk"]) == (
        service.engine.stats()["entries"],
        service.engine.stats()["bytes_on_disk"],
    )

    # queue and failures
    with service.sessions() as s:
        counts: dict[str, int] = {}
        for x in s.scalars(select(Document)):
            counts[x.status] = counts.get(x.status, 0) + 1
    assert {k: v for k, v in d["queue"]["counts"].items() if v} == counts
    assert counts == {"done": 4, "failed": 1, "forgotten": 1}
    [failed] = d["failed"]["documents"]
    assert d["failed"]["total"] == 1 and failed["id"] == ids[4]
    assert failed["error"] == "EngineInputError: cannot encode the word 'zzz'"
    assert failed["source"] == "s4" and failed["attempts"] == 1

    # worker speed: every processed document's tokens, once
    tp = d["throughput"]
    processed = [x for x in docs if x.status in ("done", "forgotten")]
    assert tp["documents"] == len(processed) == 5
    assert sum(p["tokens"] for p in tp["points"]) == pytest.approx(
        sum(x.tokens_seen for x in processed)
    )
    busy = sum((x.processed_at - x.claimed_at).total_seconds() for x in processed)
    assert sum(p["busy_seconds"] for p in tp["points"]) == pytest.approx(busy)

    # builds: the API's own record of build 1
    [b] = d["builds"]
    rec = c.get(f"/admin/builds/{build['id']}", headers=ADMIN).json()
    assert (b["version"], b["status"], b["entries"], b["seconds"]) == (
        rec["version"],
        "done",
        rec["entries"],
        rec["seconds"],
    )
    assert b["sizes"] == rec["sizes"] == sizes_at_build
    # the page's first paint holds the same data
    page = c.get("/dashboard", headers=ADMIN)
    assert page.status_code == 200 and 'id="dashboard-data"' in page.text
    assert f'"tokens_seen": {d["stats"]["tokens_seen"]}' in page.text


def build_entries(c: TestClient, build: dict[str, Any]) -> int:
    return int(c.get(f"/admin/builds/{build['id']}", headers=ADMIN).json()["entries"])


def test_throughput_spreads_each_document_over_its_processing_time() -> None:
    t0 = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)
    s = dt.timedelta(seconds=1)
    rows = [  # (claimed, processed, tokens)
        (t0, t0 + 2 * s, 100),
        (t0 + 2 * s, t0 + 4 * s, 300),
        (t0 + 4 * s, t0 + 9 * s, 100),  # 1 s in the first 5-s bucket, 4 s in the second
        (t0 + 20 * s, t0 + 21 * s, 50),
    ]
    assert history.throughput(rows).bucket_seconds == 1  # 21 s: 1-s buckets stay under 48
    tp = history.throughput([*rows, (t0 + 100 * s, t0 + 110 * s, 0)])  # 110 s span
    assert tp.bucket_seconds == 5 and tp.documents == 5
    # buckets start at multiples of 5 s since the epoch; t0 is one
    got = [
        ((p.start - t0).total_seconds(), p.documents, p.tokens, p.busy_seconds, p.tokens_per_s)
        for p in tp.points
    ]
    assert got == [
        (0, 2, 420, 5, 84),
        (5, 1, 80, 4, 20),
        (20, 1, 50, 1, 50),
        (100, 0, 0, 5, 0),
        (105, 0, 0, 5, 0),
        (110, 1, 0, 0, None),  # finished exactly at the bucket's start
    ]
    assert [p.throughput for p in tp.points] == [84, 16, 10, 0, 0, 0]
    assert sum(p.tokens for p in tp.points) == 550
    assert history.throughput([]).points == []


def test_calibrator_summary_names_the_retrain_reason() -> None:
    f = history.calibrator_summary
    assert f(None) is None
    assert (
        f({"trained": False, "reason": "no new held-out tokens", "carried_from": 3})
        == "no new held-out tokens; kept the calibrator of v3"
    )
    assert (
        f(
            {
                "trained": True,
                "new_tokens": 10,
                "training_tokens": 50,
                "calibrator": {"warm_start": True},
            }
        )
        == "trained on 10 new held-out tokens (50 in all, warm start)"
    )


# --- the session ---------------------------------------------------------------------------


def _login(c: TestClient, token: str, **headers: str) -> Any:
    return c.post(
        "/dashboard/login",
        content=f"token={token}",
        headers={"content-type": "application/x-www-form-urlencoded", **headers},
        follow_redirects=False,
    )


def test_login_sets_a_strict_httponly_cookie_that_opens_only_the_dashboard(
    service: Service,
) -> None:
    c = service.client
    assert c.get("/admin/stats/history").status_code == 401
    assert c.get("/admin/stats/history", headers=INGEST).status_code == 401
    page = c.get("/dashboard")
    assert page.status_code == 200 and 'action="/dashboard/login"' in page.text
    assert 'method="post"' in page.text and "dashboard-data" not in page.text
    # a token in the address logs nobody in
    assert "dashboard-data" not in c.get(f"/dashboard?token={ADMIN_TOKEN}").text

    bad = _login(c, "not-the-token")
    assert bad.status_code == 401 and "not the admin token" in bad.text
    assert COOKIE not in bad.headers.get("set-cookie", "")
    # the ingest token is not the admin token
    assert _login(c, INGEST["Authorization"].split()[1]).status_code == 401

    r = _login(c, ADMIN_TOKEN)
    assert r.status_code == 303 and r.headers["location"] == "/dashboard"
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}=")
    attrs = {a.strip().split("=")[0].lower() for a in cookie.split(";")[1:]}
    assert {"httponly", "samesite", "path", "max-age"} <= attrs
    assert "samesite=strict" in cookie.lower() and "path=/" in cookie.lower()
    assert ADMIN_TOKEN not in cookie

    # the cookie (kept by the client now) opens the page and its data ...
    assert "dashboard-data" in c.get("/dashboard").text
    assert c.get("/admin/stats/history").status_code == 200
    # ... and nothing else: every other admin or ingest route wants the bearer token
    assert c.get("/admin/stats").status_code == 401
    assert c.post("/admin/rebuild").status_code == 401
    assert c.put("/admin/policy", json={"policy": "fullmem"}).status_code == 401
    assert c.get("/documents/1").status_code == 401
    assert c.post("/ingest", json={"documents": [doc("a b c")]}).status_code == 401

    out = c.post("/dashboard/logout", follow_redirects=False)
    assert out.status_code == 303 and f'{COOKIE}=""' in out.headers["set-cookie"]
    assert c.get("/admin/stats/history").status_code == 401


def test_cross_site_posts_are_refused(service: Service) -> None:
    c = service.client
    for headers in (
        {"origin": "https://evil.example"},
        {"origin": "null"},
        {"sec-fetch-site": "cross-site"},
    ):
        r = _login(c, ADMIN_TOKEN, **headers)
        assert r.status_code == 403 and COOKIE not in r.headers.get("set-cookie", "")
    # the page's own origin is fine
    assert _login(c, ADMIN_TOKEN, origin="http://testserver").status_code == 303
    assert (
        c.post("/dashboard/logout", headers={"origin": "https://evil.example"}).status_code == 403
    )


def test_session_values_expire_and_belong_to_one_token() -> None:
    v = session_value("tok-a", 60, now=1000)
    assert valid_session(v, "tok-a", now=1059)
    assert not valid_session(v, "tok-a", now=1061)  # expired
    assert not valid_session(v, "tok-b", now=1000)  # another admin token: all sessions end
    expiry, sig = v.split(".")
    assert not valid_session(f"{int(expiry) + 3600}.{sig}", "tok-a", now=1000)  # forged expiry
    for junk in ("", "x", "1.2.3", "abc.def", ".", f"{expiry}.", None):
        assert not valid_session(junk, "tok-a", now=1000)


def test_pages_set_a_strict_content_security_policy(service: Service) -> None:
    for r in (service.client.get("/dashboard"), service.client.get("/dashboard", headers=ADMIN)):
        csp = r.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert r.headers["cache-control"] == "no-store"
        # no inline script runs: the only inline <script> holds JSON data
        scripts = re.findall(r"<script([^>]*)>", r.text)
        assert all("src=" in a or 'type="application/json"' in a for a in scripts)
    js = service.client.get("/dashboard/static/plotly.min.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert b"plotly" in js.content[:2000].lower() and len(js.content) > 1_000_000
    assert service.client.get("/dashboard/static/dashboard.js").status_code == 200
    assert service.client.get("/dashboard/static/../app.py").status_code == 404
    assert service.client.get("/dashboard/static/other.js").status_code == 404


def test_document_titles_are_not_markup(service: Service) -> None:
    """A title is data: the page's JSON escapes it, so it cannot close the script tag."""
    r = service.client.post(
        "/ingest",
        headers=INGEST,
        json={"documents": [doc("zzz x", title="</script><script>alert(1)</script>")]},
    )
    assert r.status_code == 202
    service.drain()
    page = service.client.get("/dashboard", headers=ADMIN).text
    assert "</script><script>alert(1)" not in page


# --- held-out perplexity against the worker's records ----------------------------------------


@pytest.fixture(scope="module")
def tiny() -> Any:
    from memlm.encoder import Encoder

    return Encoder.load("tiny-llama", threads=1)


def _expected_days(rows: dict[str, np.ndarray], params: KnnParams) -> dict[str, tuple[float, ...]]:
    out: dict[str, tuple[float, ...]] = {}
    for day in sorted(set(rows["day"].tolist())):
        m = rows["day"] == day
        vals = rows["values"][m][:, : params.k]
        ids = np.where(vals >= 0, 0, -1)
        knn = knn_logprob(
            rows["distances"][m][:, : params.k],
            ids,
            vals,
            rows["gold"][m][:, None],
            params.temperature,
        )[:, 0]
        lm = rows["target_lm_logprob"][m].astype(np.float64)
        aug = interpolate(lm, knn, params.lmbda, has_neighbours(ids))
        date = (dt.date(1970, 1, 1) + dt.timedelta(days=int(day))).isoformat()
        out[date] = (int(m.sum()), math.exp(-lm.mean()), math.exp(-aug.mean()))
    return out


def test_heldout_perplexity_per_day_matches_the_records(
    tmp_path: Path, sqlite_url: str, tiny: Any
) -> None:
    from memlm.engine import open_engine, policy_factory
    from tests.test_calibrator_service import TEXTS

    params = KnnParams(k=8, temperature=1.0, lmbda=0.5)
    settings = make_settings(
        tmp_path,
        sqlite_url,
        model="tiny-llama",
        knn_k=params.k,
        knn_temperature=params.temperature,
        knn_lambda=params.lmbda,
        calibrator_sample=1.0,  # every document recorded
    )
    engine = open_engine(settings, encoder=tiny)
    app = create_app(settings, engine=engine, run_worker=False, poll=False)
    with TestClient(app) as c:
        worker = IngestWorker(
            engine, app.state.memlm.sessions, settings, policy_factory=policy_factory
        )
        worker.start(timeout=5)
        try:
            items = [(t, "2017-02-07" if i < 4 else "2017-02-08") for i, t in enumerate(TEXTS)]
            body = {"documents": [doc(t, day=d, source=f"s{i}") for i, (t, d) in enumerate(items)]}
            assert c.post("/ingest", headers=INGEST, json=body).status_code == 202
            while worker.step() is not None:
                pass
            rec = HeldOutRecorder(settings.datastore_dir / "calibrator-pending", None)  # type: ignore[arg-type]
            rows = HeldOutRecorder.load(rec.pending().paths)
            want = _expected_days(rows, params)
            assert len(want) == 2 and all(n > 0 for n, _, _ in want.values())

            def got() -> dict[str, tuple[float, ...]]:
                h = c.get("/admin/stats/history", headers=ADMIN).json()["heldout"]
                assert h["recording"] and h["interpolation"]["lambda"] == params.lmbda
                assert h["tokens"] == sum(n for n, _, _ in want.values())
                return {d["day"]: (d["tokens"], d["lm_ppl"], d["augmented_ppl"]) for d in h["days"]}

            before = got()
            assert before.keys() == want.keys()
            for day, (n, lm, aug) in want.items():
                assert before[day][0] == n
                assert before[day][1] == pytest.approx(lm, rel=1e-6)
                assert before[day][2] == pytest.approx(aug, rel=1e-6)
            # day 2's documents found day 1's entries: the memory changed their perplexity
            assert before["2017-02-08"][2] != pytest.approx(before["2017-02-08"][1], rel=1e-9)
            # a build merges the records into the training set: the same tokens, same figures
            c.post("/admin/rebuild", headers=ADMIN)
            while worker.step() is not None:
                pass
            c.portal.call(sync_index, app.state.memlm)  # type: ignore[union-attr]
            assert rec.pending().paths == ()
            after = got()
            assert after.keys() == want.keys()
            for day in want:
                assert after[day] == pytest.approx(before[day], rel=1e-6)
        finally:
            worker.lock.release()


def test_a_model_that_failed_to_load_still_shows_the_database(
    tmp_path: Path, sqlite_url: str
) -> None:
    def broken(settings: Any) -> Any:
        raise RuntimeError("no weights here")

    settings = make_settings(tmp_path, sqlite_url)
    app = create_app(settings, engine_factory=broken, run_worker=False, poll=False)
    with TestClient(app) as c:
        _ = c.post("/ingest", headers=INGEST, json={"documents": [doc("a b c")]})
        deadline = dt.datetime.now() + dt.timedelta(seconds=30)
        while app.state.memlm.load_error is None:  # the first try fails at once
            assert dt.datetime.now() < deadline
            time.sleep(0.05)

        d = c.get("/admin/stats/history", headers=ADMIN).json()
        assert d["model"] == "failed" and d["stats"] is None
        assert d["queue"]["counts"]["pending"] == 1 and d["memory"] == []
        assert d["heldout"]["note"] == "the model failed to load (see the server log)"
        assert c.get("/dashboard", headers=ADMIN).status_code == 200
