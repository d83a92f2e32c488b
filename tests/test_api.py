"""The HTTP API in-process over the exact fake engine: flow, validation, auth, errors."""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from memlm.db.repositories import SpanRepository
from memlm.memory import IndexParams
from service.app import create_app, sync_index
from tests.fakes import VOCAB, FakeEngine
from tests.service_helpers import ADMIN, INGEST, READ, doc, make_settings
from workers.ingest import IngestWorker


def by_name(name: str, delta: float | None, params: dict[str, Any]) -> str:
    return name


class Env:
    def __init__(self, client: TestClient, engine: FakeEngine, worker: IngestWorker) -> None:
        self.client, self.engine, self.worker = client, engine, worker

    def sync(self) -> None:
        self.client.portal.call(sync_index, self.client.app.state.memlm)  # type: ignore[union-attr,attr-defined]

    def drain(self) -> int:
        n = 0
        while self.worker.step() is not None:
            n += 1
        return n


def _env(tmp_path: Path, url: str, **over: Any) -> Iterator[Env]:
    settings = make_settings(tmp_path, url, **over)
    engine = FakeEngine()
    app = create_app(settings, engine=engine, policy_factory=by_name, run_worker=False, poll=False)
    with TestClient(app, raise_server_exceptions=False) as client:
        worker = IngestWorker(engine, app.state.memlm.sessions, settings, policy_factory=by_name)
        worker.start(timeout=5)
        try:
            yield Env(client, engine, worker)
        finally:
            worker.lock.release()


@pytest.fixture
def env(tmp_path: Path, sqlite_url: str) -> Iterator[Env]:
    yield from _env(tmp_path, sqlite_url)


def test_full_flow_ingest_worker_rebuild_predict_score_stats_forget(env: Env) -> None:
    c = env.client
    before = c.post("/predict", headers=READ, json={"context": "we saw the", "neighbours": 5})
    before = before.json()
    assert before["lambda"] == 0.0
    assert before["neighbours"] == []
    assert {s["token"]: s["prob"] for s in before["suggestions"]}["the"] == pytest.approx(1 / 6)

    r = c.post(
        "/ingest",
        headers=INGEST,
        json={"documents": [doc("the cat sat on the mat", title="Cats", external_id="a1")]},
    )
    assert r.status_code == 202
    [accepted] = r.json()["documents"]
    assert accepted["status"] == "pending"
    assert c.get(f"/documents/{accepted['id']}", headers=INGEST).json()["status"] == "pending"

    assert env.drain() == 1
    d = c.get(f"/documents/{accepted['id']}", headers=INGEST).json()
    assert (d["status"], d["tokens_seen"], d["tokens_stored"]) == ("done", 5, 5)
    assert (d["entry_start"], d["entry_end"], d["policy"]) == (0, 5, "monim")

    r = c.post("/admin/rebuild", headers=ADMIN)
    assert r.status_code == 202 and r.json()["status"] == "queued"
    assert env.drain() == 1
    env.sync()
    build = c.get(f"/admin/builds/{r.json()['id']}", headers=ADMIN).json()
    assert (build["status"], build["version"], build["entries"]) == ("done", "1", 5)
    # the fake's index parameters and its build record (memlm.index.BuildInfo's defaults)
    assert build["params"] == {
        **IndexParams.exact().to_json(),
        "build": {
            "mode": "full",
            "reason": "",
            "base_version": None,
            "trained_entries": 0,
            "added": 0,
            "removed": 0,
            "train_seconds": 0.0,
            "add_seconds": 0.0,
            "remove_seconds": 0.0,
        },
    }
    assert build["calibrator"] is None and build["started_at"] <= build["finished_at"]

    after = c.post("/predict", headers=READ, json={"context": "we saw the", "neighbours": 5}).json()
    assert after["lambda"] == 0.5
    assert after["index_version"] == "1"
    probs = {s["token"]: s for s in after["suggestions"]}
    assert probs["cat"]["knn_prob"] == 0.5 and probs["cat"]["lm_prob"] == 0.0
    assert probs["cat"]["prob"] == pytest.approx(0.25)
    assert probs["the"]["prob"] == pytest.approx(0.5 / 6)
    nbrs = after["neighbours"]
    assert [(n["document_id"], n["token"], n["position"]) for n in nbrs] == [
        (accepted["id"], "cat", 1),
        (accepted["id"], "mat", 5),
    ]
    assert nbrs[0]["title"] == "Cats" and nbrs[0]["published_at"] == "2017-02-07"
    # the spans stored at ingest mark the very word; the engine tokenised nothing here
    assert [n["snippet"] for n in nbrs] == [
        "the [[cat]] sat on the mat",
        "the cat sat on the [[mat]]",
    ]
    assert env.engine.span_calls == []

    s = c.post("/score", json={"text": "the cat ran"}).json()
    assert s["tokens"] == ["the", "cat", "ran"]
    assert s["would_store"] == [False, True]  # (the, cat) is in memory, (cat, ran) is not
    assert s["lm_logprobs"][0] == pytest.approx(math.log(1e-6))
    assert s["logprobs"][0] == pytest.approx(math.log(0.5 * 1e-6 + 0.25))
    assert s["policy"] == "monim"

    st = c.get("/admin/stats", headers=ADMIN).json()
    assert (st["entries"], st["tokens_seen"], st["tokens_stored"]) == (5, 5, 5)
    assert st["memrate"] == 1.0 and st["documents"] == {"done": 1}
    assert [(p["day"], p["tokens_stored"], p["memrate"]) for p in st["per_day"]] == [
        ("2017-02-07", 5, 1.0)
    ]
    assert st["index"]["version"] == "1" and st["index"]["served_version"] == "1"

    r = c.delete(f"/admin/documents/{accepted['id']}", headers=ADMIN)
    assert r.status_code == 202 and r.json()["status"] == "forgetting"
    assert env.drain() == 1
    assert c.get(f"/documents/{accepted['id']}", headers=INGEST).json()["status"] == "forgotten"
    st = c.get("/admin/stats", headers=ADMIN).json()
    assert (st["entries"], st["tokens_stored"], st["entries_forgotten"]) == (0, 5, 5)
    assert st["entries"] == st["tokens_stored"] - st["entries_forgotten"]
    gone = c.post("/predict", headers=READ, json={"context": "the", "neighbours": 5}).json()
    assert gone["neighbours"] == [] and gone["lambda"] == 0.0
    again = c.delete(f"/admin/documents/{accepted['id']}", headers=ADMIN)
    assert again.status_code == 409 and again.json()["error"] == "conflict"


def test_stats_match_datastore_over_several_documents_and_days(env: Env) -> None:
    texts = ["a b c d", "a b x y z", "q a b c", "the of and"]
    days = ["2017-02-07", "2017-02-07", "2017-02-08", "2017-02-09"]
    docs = [doc(t, day) for t, day in zip(texts, days, strict=True)]
    env.client.post("/ingest", headers=INGEST, json={"documents": docs})
    assert env.drain() == 4
    st = env.client.get("/admin/stats", headers=ADMIN).json()
    # MoNIM in the fake stores new (key, value) pairs: 3 + 3 + 1 + 2 entries.
    assert [p["tokens_stored"] for p in st["per_day"]] == [6, 1, 2]
    assert [p["tokens_seen"] for p in st["per_day"]] == [7, 3, 2]
    assert (
        st["entries"] == len(env.engine.entries) == sum(p["tokens_stored"] for p in st["per_day"])
    )
    assert st["per_day"][1]["cumulative_memrate"] == pytest.approx(7 / 10)
    assert st["memrate"] == pytest.approx(9 / 12)


def test_documents_are_processed_in_publication_order(env: Env) -> None:
    docs = [doc("late one", "2017-03-01"), doc("early one", "2017-01-01"), doc("mid", "2017-02-01")]
    ids = [
        d["id"]
        for d in env.client.post("/ingest", headers=INGEST, json={"documents": docs}).json()[
            "documents"
        ]
    ]
    env.drain()
    assert env.engine.processed == [ids[1], ids[2], ids[0]]


def test_deduplication_by_external_id_and_by_content(env: Env) -> None:
    c = env.client
    first = c.post(
        "/ingest", headers=INGEST, json={"documents": [doc("one two", external_id="x")]}
    ).json()["documents"][0]
    again = c.post(
        "/ingest",
        headers=INGEST,
        json={
            "documents": [
                doc("other text", external_id="x"),  # same (source, external id)
                doc("one two"),  # same content
                doc("one two three"),
                doc("one two three"),  # duplicate inside the batch
            ]
        },
    ).json()["documents"]
    assert [(d["id"], d["duplicate"]) for d in again[:2]] == [(first["id"], True)] * 2
    assert again[2]["duplicate"] is False and again[3] == {**again[2], "duplicate": True}


def test_policy_get_put_applies_to_next_documents(env: Env) -> None:
    c = env.client
    assert c.get("/admin/policy", headers=ADMIN).json()["policy"] == "monim"
    r = c.put("/admin/policy", headers=ADMIN, json={"policy": "monim-amt", "delta": -2.0})
    assert r.status_code == 200 and r.json()["delta"] == -2.0
    r = c.put("/admin/policy", headers=ADMIN, json={"policy": "fullmem"})
    assert r.status_code == 200 and r.json()["delta"] is None
    bad = c.put("/admin/policy", headers=ADMIN, json={"policy": "everything"})
    assert bad.status_code == 422
    assert (
        "'everything' found using 'policy' does not match any of the expected tags"
        in (bad.json()["detail"])
    )
    c.post("/ingest", headers=INGEST, json={"documents": [doc("a b a b")]})
    env.drain()
    st = c.get("/admin/stats", headers=ADMIN).json()
    # FullMem keeps the repeated pair (a, b) twice: 3 of 3 tokens.
    assert [(p["policy"], p["tokens_stored"]) for p in st["per_day"]] == [("fullmem", 3)]


def test_failed_document_is_marked_and_does_not_stop_the_queue(env: Env) -> None:
    env.engine.fail_on = "poison"
    c = env.client
    ids = [
        d["id"]
        for d in c.post(
            "/ingest", headers=INGEST, json={"documents": [doc("a poison b"), doc("c d e")]}
        ).json()["documents"]
    ]
    assert env.drain() == 2
    bad, good = (c.get(f"/documents/{i}", headers=INGEST).json() for i in ids)
    assert bad["status"] == "failed"
    assert bad["error"] == "EngineInputError: cannot encode the word 'poison'"
    assert good["status"] == "done"


def test_rebuild_requests_coalesce_and_keys_are_idempotent(env: Env) -> None:
    c = env.client
    a = c.post("/admin/rebuild", headers=ADMIN).json()
    b = c.post("/admin/rebuild", headers=ADMIN).json()
    assert a["id"] == b["id"]
    k1 = c.post("/admin/rebuild", headers=ADMIN, json={"key": "2017-02-07"}).json()
    k2 = c.post("/admin/rebuild", headers=ADMIN, json={"key": "2017-02-07"}).json()
    assert k1["id"] == k2["id"] != a["id"]
    assert env.drain() == 2
    assert env.engine.built_version == 2
    assert (
        c.post("/admin/rebuild", headers=ADMIN, json={"key": "2017-02-07"}).json()["status"]
        == "done"
    )


def test_rebuild_retrain_option_reaches_the_engine_and_the_record(env: Env) -> None:
    """``retrain`` joins a queued request (which then retrains); a plain request after
    it joins that one; the record says it retrained; a plain build does not."""
    c = env.client
    plain = c.post("/admin/rebuild", headers=ADMIN).json()
    forced = c.post("/admin/rebuild", headers=ADMIN, json={"retrain": True}).json()
    assert forced["id"] == plain["id"]
    assert c.post("/admin/rebuild", headers=ADMIN, json={"retrain": "maybe"}).status_code == 422
    assert env.drain() == 1
    assert env.engine.retrained is True
    done = c.get(f"/admin/builds/{plain['id']}", headers=ADMIN).json()
    assert done["status"] == "done" and done["params"]["retrain"] is True
    again = c.post("/admin/rebuild", headers=ADMIN).json()
    assert env.drain() == 1 and env.engine.retrained is False
    assert "retrain" not in c.get(f"/admin/builds/{again['id']}", headers=ADMIN).json()["params"]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def any_env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Env]:
    url = request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")
    yield from _env(tmp_path, url)


def test_admin_retry_queues_a_failed_document_again(any_env: Env) -> None:
    env, c = any_env, any_env.client
    env.engine.fail_on = "poison"
    [bad, good] = [
        d["id"]
        for d in c.post(
            "/ingest", headers=INGEST, json={"documents": [doc("a poison b"), doc("c d")]}
        ).json()["documents"]
    ]
    assert env.drain() == 2
    failed = c.get(f"/documents/{bad}", headers=ADMIN).json()
    assert (failed["status"], failed["attempts"]) == ("failed", 1)
    # posting it again answers the document as it is; only the admin retry queues it
    again = c.post("/ingest", headers=INGEST, json={"documents": [doc("a poison b")]}).json()
    assert again["documents"] == [{"id": bad, "status": "failed", "duplicate": True}]
    assert c.post(f"/admin/documents/{bad}/retry", headers=INGEST).status_code == 401
    r = c.post(f"/admin/documents/{bad}/retry", headers=ADMIN)
    assert r.status_code == 202
    body = r.json()
    assert (body["status"], body["attempts"], body["error"], body["processed_at"]) == (
        "pending",
        0,
        None,
        None,
    )
    conflict = c.post(f"/admin/documents/{bad}/retry", headers=ADMIN)
    assert conflict.status_code == 409 and conflict.json() == {
        "error": "conflict",
        "detail": f"document {bad} is pending; only a failed one is retried",
    }
    done = c.post(f"/admin/documents/{good}/retry", headers=ADMIN)
    assert done.status_code == 409 and "is done" in done.json()["detail"]
    missing = c.post("/admin/documents/999999/retry", headers=ADMIN)
    assert missing.status_code == 404 and missing.json()["error"] == "not_found"
    env.engine.fail_on = None  # the cause is fixed: the retry memorises it
    assert env.drain() == 1
    out = c.get(f"/documents/{bad}", headers=ADMIN).json()
    assert (out["status"], out["attempts"], out["tokens_seen"]) == ("done", 0, 2)


def test_every_timestamp_in_responses_is_utc_with_z(any_env: Env) -> None:
    """SQLite keeps no zone and PostgreSQL answers in its session zone; the API says UTC."""
    c = any_env.client
    t0 = dt.datetime.now(dt.UTC).replace(microsecond=0)  # server defaults: whole seconds
    [accepted] = c.post("/ingest", headers=INGEST, json={"documents": [doc("a b c")]}).json()[
        "documents"
    ]
    build_id = c.post("/admin/rebuild", headers=ADMIN).json()["id"]
    before_put = c.get("/admin/policy", headers=ADMIN).json()
    assert any_env.drain() == 2
    after_put = c.put("/admin/policy", headers=ADMIN, json={"policy": "fullmem"}).json()
    d = c.get(f"/documents/{accepted['id']}", headers=INGEST).json()
    b = c.get(f"/admin/builds/{build_id}", headers=ADMIN).json()
    st = c.get("/admin/stats", headers=ADMIN).json()
    t1 = dt.datetime.now(dt.UTC)
    stamps = {
        "created_at": d["created_at"],
        "processed_at": d["processed_at"],
        "requested_at": b["requested_at"],
        "started_at": b["started_at"],
        "finished_at": b["finished_at"],
        "built_at": st["index"]["built_at"],
        "updated_at (default)": before_put["updated_at"],
        "updated_at (put)": after_put["updated_at"],
        "updated_at (stats)": st["policy"]["updated_at"],
    }
    for name, value in stamps.items():
        assert isinstance(value, str) and value.endswith("Z"), (name, value)
        parsed = dt.datetime.fromisoformat(value)
        assert parsed.utcoffset() == dt.timedelta(0), name
        assert t0 <= parsed <= t1, name
    assert st["index"]["built_at"] == b["finished_at"]


# --- validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"documents": [doc("")]}, 422, "documents.0.text"),
        ({"documents": [doc("   \n ")]}, 422, "text is empty"),
        ({"documents": [doc("ok", day="2017-13-45")]}, 422, "documents.0.published_at"),
        ({"documents": [doc("ok", day="yesterday")]}, 422, "published_at"),
        ({"documents": [{"text": "no date", "source": "s"}]}, 422, "published_at: Field required"),
        ({"documents": [{**doc("ok"), "colour": "red"}]}, 422, "colour"),
        ({"documents": []}, 422, "documents"),
        ({"docs": []}, 422, "documents: Field required"),
    ],
)
def test_bad_ingest_bodies_get_4xx_with_clear_message(
    env: Env, body: dict[str, Any], status: int, needle: str
) -> None:
    r = env.client.post("/ingest", headers=INGEST, json=body)
    assert r.status_code == status
    assert set(r.json()) == {"error", "detail"}
    assert needle in r.json()["detail"]


@pytest.mark.parametrize(
    ("policy", "needle"),
    [
        # one body model per policy (the OpenAPI states each): the detail names its field
        ({"policy": "monim", "params": {"rate": 0.5}}, "monim.params.rate: Extra inputs"),
        ({"policy": "randmem", "params": {"speed": 1}}, "randmem.params.speed: Extra inputs"),
        ({"policy": "randmem", "params": {"rate": 1.5}}, "rate: Input should be less than or"),
        ({"policy": "randmem", "params": {"rate": "high"}}, "rate: Input should be a valid number"),
        ({"policy": "randmem", "params": {"rate": True}}, "rate: Input should be a valid number"),
        ({"policy": "randmem", "params": {"seed": -1}}, "seed: Input should be greater than or"),
        ({"policy": "randmem", "params": {"seed": "7"}}, "seed: Input should be a valid integer"),
        ({"policy": "fullmem", "delta": -1.0}, "fullmem.delta: Input should be None"),
        ({"policy": "monim", "delta": 3.0}, "delta: Input should be less than or equal to 0"),
        ({"policy": "monim", "delta": -1e9}, "delta: Input should be greater than or equal"),
        ({"policy": "monim", "params": {"k\u0000": 1}}, "monim.params.k\x00: Extra inputs"),
    ],
)
def test_policy_is_validated_against_its_schema(
    env: Env, policy: dict[str, Any], needle: str
) -> None:
    """Unknown params used to stop every ingest; a refused policy changes nothing."""
    c = env.client
    before = c.get("/admin/policy", headers=ADMIN).json()
    r = c.put("/admin/policy", headers=ADMIN, json=policy)
    assert r.status_code == 422 and r.json()["error"] == "validation_error"
    assert needle in r.json()["detail"], r.json()
    assert c.get("/admin/policy", headers=ADMIN).json() == before


@pytest.mark.parametrize("raw", [b"NaN", b"Infinity", b"-Infinity"])
def test_policy_delta_must_be_finite(env: Env, raw: bytes) -> None:
    """Python's JSON reader accepts NaN; a NaN delta made every document store 0 tokens."""
    c = env.client
    r = c.put(
        "/admin/policy",
        headers={**ADMIN, "Content-Type": "application/json"},
        content=b'{"policy": "monim", "delta": ' + raw + b"}",
    )
    assert r.status_code == 422
    assert r.json() == {
        "error": "validation_error",
        "detail": "monim.delta: Input should be a finite number",
    }
    c.post("/ingest", headers=INGEST, json={"documents": [doc("a b c")]})
    assert env.drain() == 1
    st = c.get("/admin/stats", headers=ADMIN).json()
    assert [(p["policy"], p["tokens_stored"]) for p in st["per_day"]] == [("monim", 2)]


def test_randmem_params_reach_the_policy(env: Env) -> None:
    seen: list[tuple[str, float | None, dict[str, Any]]] = []

    def record(name: str, delta: float | None, params: dict[str, Any]) -> str:
        seen.append((name, delta, params))
        return name

    env.worker.policy_factory = record
    body = {"policy": "randmem", "params": {"rate": 0.25, "seed": 7}}
    assert env.client.put("/admin/policy", headers=ADMIN, json=body).status_code == 200
    env.client.post("/ingest", headers=INGEST, json={"documents": [doc("a b")]})
    assert env.drain() == 1
    assert seen == [("randmem", None, {"rate": 0.25, "seed": 7})]


def test_iso_datetime_is_accepted_as_its_date(env: Env) -> None:
    r = env.client.post(
        "/ingest", headers=INGEST, json={"documents": [doc("ok", day="2017-02-07T23:10:00Z")]}
    )
    doc_id = r.json()["documents"][0]["id"]
    assert (
        env.client.get(f"/documents/{doc_id}", headers=INGEST).json()["published_at"]
        == "2017-02-07"
    )


def test_invalid_utf8_and_invalid_json(env: Env) -> None:
    raw = b'{"documents": [{"text": "caf\xe9", "published_at": "2017-02-07", "source": "s"}]}'
    r = env.client.post(
        "/ingest", headers={**INGEST, "Content-Type": "application/json"}, content=raw
    )
    assert r.status_code == 400
    assert r.json() == {
        "error": "bad_request",
        "detail": f"the body is not valid UTF-8 (byte {raw.index(0xE9)})",
    }
    r = env.client.post(
        "/ingest", headers={**INGEST, "Content-Type": "application/json"}, content=b"{nope"
    )
    assert r.status_code == 422 and "not valid JSON" in r.json()["detail"]


MAX_ID = 2**31 - 1


@pytest.mark.parametrize(
    ("method", "template"),
    [("GET", "/documents/{}"), ("GET", "/admin/builds/{}"), ("DELETE", "/admin/documents/{}")],
)
def test_path_ids_are_bounded_on_both_databases(any_env: Env, method: str, template: str) -> None:
    """Ids >= 2**31 gave 500 on PostgreSQL (INTEGER), >= 2**63 on SQLite: now 422."""
    c = any_env.client
    for bad in (MAX_ID + 1, 2**63, 2**64, 0, -1):
        r = c.request(method, template.format(bad), headers=ADMIN)
        assert r.status_code == 422, (bad, r.text)
        assert r.json()["error"] == "validation_error"
        assert r.json()["detail"].split(": ")[0] in ("path.doc_id", "path.build_id")
    r = c.request(method, template.format(MAX_ID), headers=ADMIN)
    assert r.status_code == 404 and r.json()["error"] == "not_found"


NUL_BODIES = [
    ({"text": "a\x00b"}, "documents.0.text: Value error, text contains a NUL character"),
    ({"title": "t\x00"}, "documents.0.title: Value error, title contains a NUL"),
    ({"source": "s\x00"}, "documents.0.source: Value error, source contains a NUL"),
    ({"external_id": "\x00"}, "documents.0.external_id: Value error, external_id contains a NUL"),
    ({"metadata": {"a": ["ok", "b\x00"]}}, "metadata.a.1 contains a NUL"),
    ({"metadata": {"k\x00": 1}}, "metadata key contains a NUL"),
]


@pytest.mark.parametrize(("extra", "needle"), NUL_BODIES)
def test_text_that_cannot_be_stored_is_refused_on_both_databases(
    any_env: Env, extra: dict[str, Any], needle: str
) -> None:
    """PostgreSQL refuses NUL in text and jsonb (it was a 500): 422, and nothing stored."""
    c = any_env.client
    r = c.post("/ingest", headers=INGEST, json={"documents": [{**doc("fine text"), **extra}]})
    assert r.status_code == 422 and r.json()["error"] == "validation_error"
    assert needle in r.json()["detail"], r.json()
    assert c.get("/admin/stats", headers=ADMIN).json()["documents"] == {}
    r = c.post("/admin/rebuild", headers=ADMIN, json={"key": "k\x00"})
    assert r.status_code == 422 and "key contains a NUL" in r.json()["detail"]


def test_lone_surrogates_are_refused(any_env: Env) -> None:
    """Valid JSON (a "\\ud800" escape) that is no Unicode text: it cannot be stored."""
    head = b'{"documents": [{"published_at": "2017-02-07", "source": "s", '
    for field, needle in [
        (b'"text": "lone \\ud800 half"', "documents.0.text: Input should be a valid string"),
        (
            b'"text": "t", "metadata": {"a": "\\udfff"}',
            "documents.0.metadata: Value error, metadata.a contains a lone surrogate",
        ),
    ]:
        r = any_env.client.post(
            "/ingest",
            headers={**INGEST, "Content-Type": "application/json"},
            content=head + field + b"}]}",
        )
        assert r.status_code == 422
        assert r.json()["detail"].startswith(needle), r.json()
    assert any_env.client.get("/admin/stats", headers=ADMIN).json()["documents"] == {}


def test_non_finite_metadata_is_refused(any_env: Env) -> None:
    raw = b'{"documents": [{"text": "a", "published_at": "2017-02-07", "source": "s", '
    raw += b'"metadata": {"score": NaN}}]}'
    r = any_env.client.post(
        "/ingest", headers={**INGEST, "Content-Type": "application/json"}, content=raw
    )
    assert r.status_code == 422
    assert "metadata.score is nan; only finite numbers can be stored" in r.json()["detail"]


def test_size_limits(tmp_path: Path, sqlite_url: str) -> None:
    for e in _env(
        tmp_path, sqlite_url, max_body_bytes=2048, max_documents_per_request=2, max_text_chars=50
    ):
        c = e.client
        r = c.post("/ingest", headers=INGEST, json={"documents": [doc("x" * 3000)]})
        assert r.status_code == 413 and r.json()["detail"] == "the body exceeds 2048 bytes"
        r = c.post("/ingest", headers=INGEST, json={"documents": [doc(f"d{i}") for i in range(3)]})
        assert r.status_code == 413
        assert r.json()["detail"] == "3 documents in one request; at most 2 are accepted"
        r = c.post("/ingest", headers=INGEST, json={"documents": [doc("y" * 60)]})
        assert r.status_code == 413 and "documents.0.text has 60 characters" in r.json()["detail"]
        assert c.get("/admin/stats", headers=ADMIN).json()["documents"] == {}


def test_predict_words_and_local_memory(env: Env) -> None:
    c = env.client
    c.post("/ingest", headers=INGEST, json={"documents": [doc("we saw the cat")]})
    assert env.drain() == 1
    r = c.post("/predict", json={"context": "we saw the", "top_n": 2, "words": 3}).json()
    # fake words are its tokens: the same ranking, as whole words
    assert [w["word"] for w in r["words"]] == ["cat", "a", "and"]
    assert r["words"][0] == {
        "word": "cat",
        "tokens": ["cat"],
        "prob": 0.5,
        "lm_prob": 0.0,
        "knn_prob": 1.0,
    }
    assert r["memory"] is None and r["suggestions"][0]["trime_prob"] is None
    assert c.post("/predict", json={"context": "we saw the"}).json()["words"] == []
    # local memory: "the" was followed by "dog" once earlier in the context
    r = c.post("/predict", json={"context": "the dog saw the", "local_memory": True}).json()
    assert r["memory"] == {"local_memory": True, "long_memory": 0, "tau": 2.0}
    best = r["suggestions"][0]
    assert (best["token"], best["trime_prob"], best["knn_prob"]) == ("cat", 0.0, 1.0)
    dog = next(s for s in r["suggestions"] if s["token"] == "dog")
    assert dog["trime_prob"] == pytest.approx(0.5) and dog["prob"] == pytest.approx(0.25)
    r = c.post("/predict", json={"context": "a", "long_memory": 2, "tau": 0.5}).json()
    assert r["memory"] == {"local_memory": True, "long_memory": 2, "tau": 0.5}


def test_predict_reads_the_last_window_and_says_it_truncated(env: Env) -> None:
    env.engine.span = 4
    c = env.client
    context = "the dog saw a cat and a bird saw the"
    body = {"context": context, "local_memory": True}
    r = c.post("/predict", json=body).json()
    assert (r["context_tokens"], r["input_tokens"], r["truncated"]) == (4, 10, True)
    # the model read "a bird saw the": its local memory holds no "the -> dog"
    tail = c.post("/predict", json={**body, "context": "a bird saw the"}).json()
    assert r["suggestions"] == tail["suggestions"]
    assert (tail["context_tokens"], tail["input_tokens"], tail["truncated"]) == (4, 4, False)
    # untruncated, the earlier "the dog" would have ranked "dog" first
    env.engine.span = 512
    full = c.post("/predict", json=body).json()
    assert full["suggestions"][0]["token"] == "dog" != r["suggestions"][0]["token"]
    assert (full["context_tokens"], full["truncated"]) == (10, False)
    # long_memory reads that many windows more
    env.engine.span = 4
    r = c.post("/predict", json={**body, "long_memory": 1}).json()
    assert (r["context_tokens"], r["input_tokens"], r["truncated"]) == (8, 10, True)


def test_score_refuses_more_tokens_than_the_limit(tmp_path: Path, sqlite_url: str) -> None:
    for e in _env(tmp_path, sqlite_url, max_score_tokens=5):
        c = e.client
        r = c.post("/score", json={"text": "the a the a of and"})
        assert r.status_code == 413
        assert r.json() == {
            "error": "payload_too_large",
            "detail": "text has 6 tokens; at most 5 (MEMLM_MAX_SCORE_TOKENS)",
        }
        assert c.post("/score", json={"text": "the a the a of"}).status_code == 200


def test_score_with_local_memory(env: Env) -> None:
    r = env.client.post("/score", json={"text": "the a the a", "local_memory": True}).json()
    lm = math.log(1 / len(VOCAB))
    # "a" after the second "the" sees one earlier ("the" -> "a") entry: (1/6 + 1) / 2
    assert r["trime_logprobs"] == pytest.approx([lm, lm, math.log((1 / 6 + 1) / 2)])
    assert r["logprobs"] == pytest.approx(r["trime_logprobs"])  # empty datastore
    assert r["trime_ppl"] == pytest.approx(math.exp(-sum(r["trime_logprobs"]) / 3))
    assert r["memory"]["tau"] == 2.0
    plain = env.client.post("/score", json={"text": "the a the a"}).json()
    assert plain["trime_logprobs"] is None and plain["memory"] is None


def test_predict_and_score_validation(env: Env) -> None:
    c = env.client
    assert c.post("/predict", json={"context": ""}).status_code == 422
    assert c.post("/predict", json={"context": "a", "top_n": 0}).status_code == 422
    assert c.post("/predict", json={"context": "a", "neighbours": 101}).status_code == 422
    assert c.post("/score", json={}).status_code == 422
    r = c.post("/score", json={"text": "one"})
    assert r.status_code == 422
    assert r.json() == {
        "error": "invalid_input",
        "detail": "the text must hold at least two tokens",
    }
    r = c.post("/predict", json={"context": "   "})
    assert r.status_code == 422 and r.json()["error"] == "invalid_input"
    for bad in ({"words": 51}, {"words": -1}, {"long_memory": 17}, {"tau": 1.0}):
        r = c.post("/predict", json={"context": "a", **bad})
        assert r.status_code == 422, bad
    r = c.post("/score", json={"text": "a b", "tau": 1.0})
    assert r.status_code == 422
    assert "tau applies only with local_memory or long_memory" in r.json()["detail"]
    assert c.post("/score", json={"text": "a b", "local_memory": True, "tau": 0}).status_code == 422
    assert c.get("/documents/999", headers=INGEST).json() == {
        "error": "not_found",
        "detail": "document 999 does not exist",
    }
    assert c.get("/nowhere").json() == {"error": "not_found", "detail": "Not Found"}


def test_every_error_body_is_the_error_model(env: Env) -> None:
    """FastAPI's validation 422, unknown routes (404) and wrong methods (405) included."""
    c = env.client
    answers = {
        "validation 422": c.post("/predict", json={"context": 5}),
        "json 422": c.post("/predict", content=b"{", headers={"Content-Type": "application/json"}),
        "path 422": c.get("/documents/abc", headers=ADMIN),
        "404 route": c.get("/nowhere"),
        "405": c.put("/predict", json={}),
        "401": c.get("/admin/stats"),
        "404 row": c.get("/admin/builds/5", headers=ADMIN),
    }
    statuses = {name: r.status_code for name, r in answers.items()}
    assert statuses == {
        "validation 422": 422,
        "json 422": 422,
        "path 422": 422,
        "404 route": 404,
        "405": 405,
        "401": 401,
        "404 row": 404,
    }
    for name, r in answers.items():
        body = r.json()
        assert set(body) == {"error", "detail"}, name
        assert isinstance(body["error"], str) and isinstance(body["detail"], str), name
        assert r.headers["content-type"] == "application/json", name
    assert answers["405"].json() == {"error": "method_not_allowed", "detail": "Method Not Allowed"}
    assert answers["405"].headers["allow"] == "POST"
    assert answers["path 422"].json()["detail"] == (
        "path.doc_id: Input should be a valid integer, unable to parse string as an integer"
    )


# --- auth ------------------------------------------------------------------------------


def test_auth(env: Env) -> None:
    c = env.client
    body = {"documents": [doc("a b")]}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}):
        r = c.post("/ingest", headers=headers, json=body)
        assert r.status_code == 401 and r.json()["error"] == "unauthorized"
        assert r.headers["WWW-Authenticate"] == "Bearer"
        assert c.get("/admin/stats", headers=headers).status_code == 401
    assert c.get("/admin/stats", headers=INGEST).status_code == 401  # ingest is not admin
    assert c.post("/ingest", headers=ADMIN, json=body).status_code == 202  # admin may ingest
    assert c.post("/predict", json={"context": "a"}).status_code == 200  # open by default
    assert c.get("/healthz").status_code == 200 and c.get("/metrics").status_code == 200


def _memorise_cats(e: Env) -> int:
    body = {"documents": [doc("the cat sat on the mat", title="Cats")]}
    [accepted] = e.client.post("/ingest", headers=INGEST, json=body).json()["documents"]
    assert e.drain() == 1
    return int(accepted["id"])


PREDICT = {"context": "we saw the", "neighbours": 2}
SNIPPETS = ["the [[cat]] sat on the mat", "the cat sat on the [[mat]]"]


@pytest.mark.parametrize("protect_read", [None, True])
def test_reads_need_a_token_outside_development(
    tmp_path: Path, sqlite_url: str, protect_read: bool | None
) -> None:
    for e in _env(tmp_path, sqlite_url, protect_read=protect_read):  # None: env "test"
        c = e.client
        _memorise_cats(e)
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = c.post("/predict", headers=headers, json=PREDICT)
            assert r.status_code == 401 and r.json() == {
                "error": "unauthorized",
                "detail": "a valid read bearer token is required",
            }
            assert c.post("/score", headers=headers, json={"text": "a b"}).status_code == 401
        for token in (READ, INGEST, ADMIN):
            r = c.post("/predict", headers=token, json=PREDICT)
            assert [n["snippet"] for n in r.json()["neighbours"]] == SNIPPETS
            assert c.post("/score", headers=token, json={"text": "a b"}).status_code == 200


NEIGHBOURS_NEED_READ = {
    "error": "unauthorized",
    "detail": "neighbours name memorised documents and tokens: asking for them needs a "
    "read, ingest or admin bearer token (without one, only suggestions are answered)",
}


def test_open_reads_answer_neighbours_only_to_readers(env: Env) -> None:
    """Where reads are open (MEMLM_PROTECT_READ=false outside development) a caller without
    a token gets suggestions only: a neighbour's token, document and position rebuild what
    was memorised, so asking for neighbours is refused before any model work."""
    c = env.client  # protect_read=False, env "test"
    doc_id = _memorise_cats(env)
    asked: list[int] = []  # neighbours asked of the model, per call
    predict = env.engine.predict

    def counted(context: str, **kw: Any) -> Any:
        asked.append(kw.get("neighbours", 0))
        return predict(context, **kw)

    env.engine.predict = counted  # type: ignore[method-assign]
    wrong = {"Authorization": "Bearer wrong"}
    for headers in ({}, wrong):
        r = c.post("/predict", headers=headers, json=PREDICT)
        assert (r.status_code, r.json()) == (401, NEIGHBOURS_NEED_READ)
        assert r.headers["WWW-Authenticate"] == "Bearer"
        body = {"context": "we saw the", "max_tokens": 2, "neighbour": True}
        for stream in (False, True):
            r = c.post("/generate", headers=headers, json={**body, "stream": stream})
            assert (r.status_code, r.json()) == (401, NEIGHBOURS_NEED_READ)
        anyone = c.post("/predict", headers=headers, json={**PREDICT, "neighbours": 0}).json()
        assert anyone["neighbours"] == [] and anyone["lambda"] == 0.5
        assert anyone["suggestions"][0]["token"] == "cat"  # the model's output stays
        gen = c.post("/generate", headers=headers, json={**body, "neighbour": False}).json()
        assert [t["neighbour"] for t in gen["tokens"]] == [None, None]
    assert asked == [0] * 6  # 1 + 2 per caller: the refused requests never reached the model
    reader = c.post("/predict", headers=READ, json=PREDICT).json()["neighbours"]
    assert [(n["document_id"], n["token"], n["position"], n["title"]) for n in reader] == [
        (doc_id, "cat", 1, "Cats"),
        (doc_id, "mat", 5, "Cats"),
    ]
    assert [n["snippet"] for n in reader] == SNIPPETS
    gen = c.post("/generate", headers=READ, json={**body, "neighbour": True}).json()
    assert [t["neighbour"]["document_id"] for t in gen["tokens"]] == [doc_id, doc_id]


def test_development_reads_are_open_with_snippets(tmp_path: Path, sqlite_url: str) -> None:
    dev = {"env": "development", "ingest_token": "change-me", "admin_token": "change-me"}
    for e in _env(tmp_path, sqlite_url, protect_read=None, read_token=None, **dev):
        body = {"documents": [doc("the cat sat on the mat")]}
        e.client.post("/ingest", headers={"Authorization": "Bearer change-me"}, json=body)
        assert e.drain() == 1
        r = e.client.post("/predict", json=PREDICT)
        assert [n["snippet"] for n in r.json()["neighbours"]] == SNIPPETS


def test_documents_need_the_ingest_or_admin_token(env: Env) -> None:
    c = env.client
    doc_id = _memorise_cats(env)
    for headers in ({}, READ, {"Authorization": "Bearer wrong"}):
        r = c.get(f"/documents/{doc_id}", headers=headers)
        assert r.status_code == 401 and r.json() == {
            "error": "unauthorized",
            "detail": "a valid ingest bearer token is required",
        }
    assert c.get("/documents/999").status_code == 401  # existence is not told either
    for headers in (INGEST, ADMIN):
        assert c.get(f"/documents/{doc_id}", headers=headers).json()["status"] == "done"


def test_neighbours_per_request_are_bounded(tmp_path: Path, sqlite_url: str) -> None:
    for e in _env(tmp_path, sqlite_url, max_neighbours=1):
        _memorise_cats(e)
        r = e.client.post("/predict", headers=READ, json=PREDICT)
        assert r.status_code == 422 and r.json() == {
            "error": "validation_error",
            "detail": "neighbours: 2 asked; at most 1 (MEMLM_MAX_NEIGHBOURS)",
        }
        r = e.client.post("/predict", headers=READ, json={**PREDICT, "neighbours": 1})
        assert [n["snippet"] for n in r.json()["neighbours"]] == SNIPPETS[:1]


def test_default_neighbours_bound(env: Env) -> None:
    r = env.client.post("/predict", headers=READ, json={"context": "a", "neighbours": 101})
    assert r.status_code == 422
    assert r.json()["detail"] == "neighbours: 101 asked; at most 100 (MEMLM_MAX_NEIGHBOURS)"
    r = env.client.post("/predict", headers=READ, json={"context": "a", "neighbours": 100})
    assert r.status_code == 200


def test_documents_without_stored_spans_are_tokenised_once_off_the_event_loop(env: Env) -> None:
    c = env.client
    doc_id = _memorise_cats(env)
    state = c.app.state.memlm  # type: ignore[attr-defined]
    with state.sessions.begin() as s:  # as for a document memorised before spans were stored
        SpanRepository(s).delete(doc_id)
    on_loop: list[bool] = []
    tokenise = env.engine.char_spans

    def char_spans(text: str) -> Any:
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return tokenise(text)

    env.engine.char_spans = char_spans  # type: ignore[method-assign]
    state.cached["span_cache"].char_spans = char_spans
    for _ in range(2):
        r = c.post("/predict", headers=READ, json=PREDICT)
        assert [n["snippet"] for n in r.json()["neighbours"]] == SNIPPETS
    # one tokenisation for two neighbours and two requests, in a worker thread
    assert env.engine.span_calls == ["the cat sat on the mat"] and on_loop == [False]


def test_forgetting_a_document_deletes_its_spans(env: Env) -> None:
    doc_id = _memorise_cats(env)
    sessions = env.client.app.state.memlm.sessions  # type: ignore[attr-defined]
    with sessions() as s:
        assert SpanRepository(s).many([doc_id])[doc_id].tolist() == [
            [0, 3],
            [4, 7],
            [8, 11],
            [12, 14],
            [15, 18],
            [19, 22],
        ]
    assert env.client.delete(f"/admin/documents/{doc_id}", headers=ADMIN).status_code == 202
    assert env.drain() == 1
    with sessions() as s:
        assert SpanRepository(s).many([doc_id]) == {}


def test_a_forget_hides_nothing_until_it_is_committed(
    any_env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On Milvus hiding deletes the entries for good: a forget whose commit fails must
    leave the document done with its entries, and forgettable again; a failure after the
    commit leaves a forget that the worker completes."""
    from sqlalchemy.orm import Session

    env, c = any_env, any_env.client
    doc_id = _memorise_cats(env)
    hidden: list[list[int]] = []
    env.engine.hide_documents = hidden.append  # type: ignore[attr-defined]
    real_commit = Session.commit

    def commit_fails(self: Session) -> None:
        monkeypatch.setattr(Session, "commit", real_commit)
        raise RuntimeError("connection lost at commit")

    monkeypatch.setattr(Session, "commit", commit_fails)
    r = c.delete(f"/admin/documents/{doc_id}", headers=ADMIN)
    assert r.status_code == 500 and r.json()["error"] == "internal_error"
    assert Session.commit is real_commit  # the failure hit the forget's own commit
    assert hidden == []  # nothing left the memory
    d = c.get(f"/documents/{doc_id}", headers=INGEST).json()
    assert (d["status"], d["entry_start"], d["entry_end"]) == ("done", 0, 5)
    ask = {"context": "the", "neighbours": 5}
    served = c.post("/predict", headers=READ, json=ask).json()["neighbours"]
    assert [n["document_id"] for n in served] == [doc_id, doc_id]

    def hide_fails(ids: list[int]) -> None:  # e.g. Milvus unreachable right after the commit
        hidden.append(ids)
        raise RuntimeError("hide failed")

    env.engine.hide_documents = hide_fails  # type: ignore[attr-defined]
    r = c.delete(f"/admin/documents/{doc_id}", headers=ADMIN)
    assert r.status_code == 202 and r.json()["status"] == "forgetting"  # it is committed
    assert hidden == [[doc_id]]
    assert env.drain() == 1  # the worker's forget completes it
    assert c.get(f"/documents/{doc_id}", headers=INGEST).json()["status"] == "forgotten"
    assert c.post("/predict", headers=READ, json=ask).json()["neighbours"] == []


def test_unexpected_errors_never_leak(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("secret path /etc/shadow")

    monkeypatch.setattr(env.engine, "score", boom)
    r = env.client.post("/score", json={"text": "a b"})
    assert r.status_code == 500
    assert r.json() == {"error": "internal_error", "detail": "internal server error"}


# --- health and metrics ----------------------------------------------------------------


def test_health_ready_and_metrics(env: Env) -> None:
    c = env.client
    assert c.get("/healthz").json()["status"] == "ok"
    assert c.get("/readyz").json()["status"] == "ready"
    c.post("/ingest", headers=INGEST, json={"documents": [doc("a b c")]})
    env.drain()
    env.sync()
    text = c.get("/metrics").text
    assert "memlm_entries 2.0" in text
    assert "memlm_memrate 1.0" in text
    assert "memlm_queue_depth 0.0" in text
    assert 'memlm_request_seconds_count{method="POST",route="/ingest",status="202"} 1.0' in text


def test_openapi_lists_every_route_with_examples(env: Env) -> None:
    spec = env.client.get("/openapi.json").json()
    paths = set(spec["paths"])
    assert {
        "/ingest",
        "/documents/{doc_id}",
        "/predict",
        "/score",
        "/generate",
        "/admin/stats",
        "/admin/rebuild",
        "/admin/policy",
        "/admin/documents/{doc_id}",
        "/admin/documents/{doc_id}/retry",
        "/healthz",
        "/readyz",
        "/metrics",
    } <= paths
    assert spec["components"]["schemas"]["IngestRequest"]["examples"][0]["documents"]


def test_openapi_declares_the_error_model_for_every_error_status(env: Env) -> None:
    spec = env.client.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and "ValidationError" not in schemas
    assert schemas["ErrorOut"]["required"] == ["error", "detail"]
    assert schemas["ErrorOut"]["additionalProperties"] is False
    statuses = {}
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            codes = sorted(int(c) for c in op["responses"] if c.isdigit())
            statuses[f"{method.upper()} {path}"] = [c for c in codes if c >= 400]
            # the OpenAI-compatible API answers every error in OpenAI's body, 4XX included
            v1 = path.startswith("/v1/")
            ranges = [c for c in op["responses"] if not c.isdigit()]
            assert ranges == (["4XX"] if v1 else []), path
            model = "OpenAIErrorOut" if v1 else "ErrorOut"
            for code in [str(c) for c in codes if c >= 400] + ranges:
                content = op["responses"][code]["content"]["application/json"]
                assert content["schema"] == {"$ref": f"#/components/schemas/{model}"}
    body, auth = [400, 413], [401]
    assert statuses == {
        "POST /ingest": sorted([*body, *auth, 422, 500, 503]),
        "GET /documents/{doc_id}": [401, 404, 422, 500, 503],
        "POST /predict": sorted([*body, *auth, 422, 429, 500, 503]),
        "POST /score": sorted([*body, *auth, 422, 429, 500, 503]),
        "POST /generate": sorted([*body, *auth, 422, 429, 500, 503]),
        "GET /admin/stats": [401, 429, 500, 503],
        # the model loading: 200, stats null; the database away: 503
        "GET /admin/stats/history": [401, 429, 500, 503],
        "POST /admin/rebuild": sorted([*body, *auth, 422, 500, 503]),
        "GET /admin/builds/{build_id}": [401, 404, 422, 500, 503],
        "GET /admin/policy": [401, 500, 503],
        "PUT /admin/policy": sorted([*body, *auth, 422, 500, 503]),
        "DELETE /admin/documents/{doc_id}": sorted([*body, *auth, 404, 409, 422, 500, 503]),
        "POST /admin/documents/{doc_id}/retry": sorted([*body, *auth, 404, 409, 422, 500, 503]),
        "GET /healthz": [500],
        "GET /readyz": [500, 503],
        "GET /metrics": [500],
        "GET /v1/models": [401, 429, 500, 503],
        "GET /v1/models/{model}": [401, 404, 429, 500, 503],
        "POST /v1/completions": sorted([*body, *auth, 404, 429, 500, 503]),
        "POST /v1/chat/completions": sorted([*body, *auth, 404, 429, 500, 503]),
        "GET /tokenizer_info": [401, 500, 503],
        "POST /tokenize": sorted([*body, *auth, 422, 500, 503]),
        "POST /detokenize": sorted([*body, *auth, 422, 500, 503]),
    }


def _wait_for(client: TestClient, path: str, status: int, detail: str | None) -> dict[str, Any]:
    deadline = time.monotonic() + 20
    while True:
        r = client.get(path)
        if r.status_code == status and (detail is None or r.json().get("detail") == detail):
            return dict(r.json())
        assert time.monotonic() < deadline, (r.status_code, r.text)
        time.sleep(0.02)


def test_engine_that_cannot_open_yet_is_retried_until_ready(
    tmp_path: Path, sqlite_url: str
) -> None:
    """A split API (docker compose) may start before its worker created the datastore."""
    calls: list[int] = []
    failed, release = threading.Event(), threading.Event()

    def factory(settings: Any) -> FakeEngine:
        calls.append(1)
        if len(calls) == 1:
            failed.set()
            raise RuntimeError("no datastore there yet")
        assert release.wait(20)
        return FakeEngine()

    settings = make_settings(tmp_path, sqlite_url, index_poll_seconds=0.05)
    app = create_app(
        settings, engine_factory=factory, policy_factory=by_name, run_worker=False, poll=False
    )
    with TestClient(app, raise_server_exceptions=False) as c:
        assert failed.wait(20)
        _wait_for(c, "/readyz", 503, "model failed to load")
        r = c.post("/predict", json={"context": "the"})
        assert (r.status_code, r.json()["detail"]) == (
            503,
            "the model failed to load; see the server log",
        )
        release.set()
        assert _wait_for(c, "/readyz", 200, None)["status"] == "ready"
        assert len(calls) == 2
        assert c.post("/predict", json={"context": "the"}).status_code == 200


def test_unmigrated_database_refuses_to_start(tmp_path: Path) -> None:
    from memlm.db.errors import DatabaseNotMigrated

    settings = make_settings(tmp_path, f"sqlite:///{tmp_path / 'empty.sqlite'}")
    app = create_app(settings, engine=FakeEngine(), run_worker=False, poll=False)
    with pytest.raises(DatabaseNotMigrated, match="run `memlm db upgrade`"), TestClient(app):
        pass


@pytest.mark.postgres
def test_an_unmigrated_database_leaves_no_connection_to_the_garbage_collector(
    tmp_path: Path, pg_schema_url: str
) -> None:
    """The refused start disposes of its engine: no psycopg connection is left open for
    the garbage collector to find (and warn about) in some later test."""
    import gc
    import warnings

    from memlm.db.errors import DatabaseNotMigrated

    app = create_app(
        make_settings(tmp_path, pg_schema_url), engine=FakeEngine(), run_worker=False, poll=False
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(DatabaseNotMigrated), TestClient(app):
            pass
        del app
        gc.collect()
    leaks = [w for w in caught if "deleted while still open" in str(w.message)]
    assert not leaks, leaks


def test_vocab_is_what_the_fake_promises() -> None:
    assert len(VOCAB) == 6


def test_the_fake_engine_keeps_the_real_engines_shape() -> None:
    """The logic tests above stay meaningful only while the fake mirrors the facade: mypy
    checks both against ``EngineLike`` (``make lint``: tests/fakes.py and facade.py assign
    them to it); here, what types cannot say: the fake returns the real result classes,
    and takes no keyword the engine does not."""
    import inspect

    import memlm.engine as real
    import tests.fakes as fake
    from memlm.engine.protocol import EngineLike

    calls = [
        n for n in dir(EngineLike) if not n.startswith("_") and callable(getattr(EngineLike, n))
    ]
    # 20, the 7 token-id calls of the OpenAI-compatible API and memory_unavailable (the
    # worker asks for the next document's encode through prepare_document's next_text)
    assert len(calls) == 28, calls
    for name in calls:
        real_params = inspect.signature(getattr(real.Engine, name)).parameters
        fake_params = inspect.signature(getattr(fake.FakeEngine, name)).parameters
        assert set(fake_params) <= set(real_params), name
    for cls in ("IngestResult", "Suggestion", "Neighbour", "Prediction", "ScoreResult"):
        assert getattr(fake, cls) is getattr(real, cls), cls
    real_stats = {"entries", "datastore_entries", "bytes_on_disk", "bytes_in_ram", "index_version"}
    assert real_stats <= set(FakeEngine().stats())
