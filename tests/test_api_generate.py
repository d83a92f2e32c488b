"""POST /generate over HTTP: JSON and server-sent events agree, provenance, clear 4xx, and
admission through the model executor (429 before anything is streamed)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.executor import ModelExecutor
from tests.service_helpers import READ, make_settings
from tests.test_api_engine import TEXT, _env
from tests.test_api_executor import Clock, SlowEngine


@pytest.fixture(scope="module")
def tiny() -> Any:
    from memlm.encoder import Encoder

    return Encoder.load("tiny-llama", threads=1)


@pytest.fixture
def env(tmp_path: Path, sqlite_url: str, tiny: Any) -> Iterator[Any]:
    settings = make_settings(tmp_path, sqlite_url, model="tiny-llama", max_generate_tokens=40)
    for e in _env(settings, tiny):
        r = e.client.post(
            "/ingest",
            json={"documents": [{"text": TEXT, "published_at": "2017-02-07", "source": "t"}]},
            headers={"Authorization": "Bearer ingest-secret-for-tests"},
        )
        assert r.status_code == 202
        e.drain()
        yield e


def sse(body: str) -> list[tuple[str, Any]]:
    """(event, data) of a text/event-stream body."""
    out = []
    for block in body.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        out.append((fields["event"], json.loads(fields["data"])))
    return out


def test_json_and_stream_give_the_same_continuation(env: Any) -> None:
    c = env.client
    body = {"context": "The central bank of Ireland", "max_tokens": 8, "neighbour": True}
    r = c.post("/generate", json=body, headers=READ)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["text"].startswith(" raised its key interest rate")
    assert out["finish_reason"] == "length" and out["generated_tokens"] == 8
    assert out["stop"] is None and out["seed"] is None and out["context_tokens"] > 0
    first = out["tokens"][0]
    assert set(first) == {
        "token", "token_id", "text", "prob", "lm_prob", "knn_prob", "lambda", "neighbour"
    }  # fmt: skip
    assert first["token"] == " raised" and first["knn_prob"] == pytest.approx(1.0, abs=1e-4)
    nb = first["neighbour"]
    assert nb["document_id"] == 1 and nb["token"] == " raised" and "[[ raised]]" in nb["snippet"]
    assert "".join(t["text"] for t in out["tokens"]) == out["text"]

    with c.stream("POST", "/generate", json={**body, "stream": True}, headers=READ) as s:
        assert s.status_code == 200
        assert s.headers["content-type"].startswith("text/event-stream")
        events = sse(s.read().decode())
    names = [e for e, _ in events]
    assert names == ["token"] * 8 + ["done"]
    assert [d for _, d in events[:-1]] == out["tokens"]
    done = events[-1][1]
    assert done == {k: v for k, v in out.items() if k != "tokens"}


def test_sampling_is_replayable_by_its_seed_and_stop_strings_cut(env: Any) -> None:
    c = env.client
    body = {"context": "Heavy snow", "max_tokens": 10, "temperature": 0.8, "top_p": 0.95}
    a = c.post("/generate", json=body).json()
    assert isinstance(a["seed"], int)
    b = c.post("/generate", json={**body, "seed": a["seed"]}).json()
    assert b["tokens"] == a["tokens"] and b["seed"] == a["seed"]
    r = c.post(
        "/generate",
        json={"context": "The central bank of Ireland", "max_tokens": 20, "stop": [" rate"]},
    ).json()
    assert (r["text"], r["finish_reason"], r["stop"]) == (
        " raised its key interest",
        "stop",
        " rate",
    )


@pytest.mark.parametrize(
    ("body", "status", "error", "detail"),
    [
        ({"context": "a", "max_tokens": 41}, 422, "validation_error", "at most 40 (MEMLM_MAX_GENERATE_TOKENS)"),
        ({"context": ""}, 422, "validation_error", "context: String should have at least 1"),
        ({"context": "word " * 1020, "max_tokens": 8}, 413, "payload_too_large", "1024 positions"),
        ({"context": "a", "max_tokens": 0}, 422, "validation_error", "max_tokens"),
        ({"context": "a", "temperature": -1}, 422, "validation_error", "temperature"),
        ({"context": "a", "top_p": 0}, 422, "validation_error", "top_p"),
        ({"context": "a", "stop": [""]}, 422, "validation_error", "stop.0"),
        ({"context": "a", "stream": True, "max_tokens": 99}, 422, "validation_error", "at most 40"),
    ],
)  # fmt: skip
def test_bad_requests_get_a_clear_4xx(
    env: Any, body: dict[str, Any], status: int, error: str, detail: str
) -> None:
    r = env.client.post("/generate", json=body)
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.json()["error"] == error and detail in r.json()["detail"]


def test_generate_is_admitted_by_the_executor_like_predict(tmp_path: Path, sqlite_url: str) -> None:
    """A busy model thread refuses a /generate with 429 + Retry-After, streamed or not;
    once free, the same request streams."""
    settings = make_settings(
        tmp_path, sqlite_url, max_batch=1, queue_budget_s=2.0, overload_delay_seconds=0
    )
    engine = SlowEngine()
    app = create_app(settings, engine=engine, run_worker=False, poll=False)
    with TestClient(app) as client:
        ex: ModelExecutor = app.state.memlm.executor
        ex.observe("predict", 128, 1.0)
        ex.observe("generate", 32, 1.0)  # 1 s a request of 32 tokens' cost
        done: list[int] = []
        first = threading.Thread(
            target=lambda: done.append(client.post("/predict", json={"context": "a"}).status_code)
        )
        first.start()
        try:
            assert engine.entered.wait(10)
            for stream in (False, True):  # cost 32 + 30 = 62: 1.9 s, after 0.26 s ahead
                body = {"context": " ".join(["the"] * 30), "max_tokens": 8, "stream": stream}
                r = client.post("/generate", json=body)
                assert r.status_code == 429, r.text
                assert r.headers["content-type"] == "application/json"
                assert r.json()["error"] == "overloaded" and int(r.headers["Retry-After"]) >= 1
        finally:
            engine.gate.set()
        first.join(10)
        assert done == [200]
        r = client.post("/generate", json={"context": "the a", "max_tokens": 3, "stream": True})
        assert r.status_code == 200
        assert [e for e, _ in sse(r.text)] == ["token", "token", "token", "done"]
        kinds = {k for k in ("generate", "generate-step") if ex.per_cost(k) is not None}
        assert kinds == {"generate", "generate-step"}  # both timed on the model thread


def test_generate_is_priced_by_the_tokens_it_will_produce(tmp_path: Path, sqlite_url: str) -> None:
    """A /generate is admitted by its context and its max_tokens steps: one that cannot
    fit is refused (it used to be priced by its context alone, and its steps queued past
    the budget), an admitted one's reservation counts ahead of the next generation, and a
    /predict waits only for what is queued."""
    settings = make_settings(
        tmp_path, sqlite_url, max_batch=1, queue_budget_s=2.0, overload_delay_seconds=0
    )
    engine = SlowEngine()
    app = create_app(settings, engine=engine, run_worker=False, poll=False)
    with TestClient(app) as client:
        ex: ModelExecutor = app.state.memlm.executor
        ex.clock = Clock()
        ex.observe("predict", 128, 1.0)  # "a": cost 33, 0.258 s
        ex.observe("generate", 32, 1.0)  # "the a": cost 34, 1.0625 s
        ex.observe("generate-step", 8, 1.0)  # 0.125 s a token produced
        answers: dict[str, Any] = {}

        def post(name: str, path: str, body: dict[str, Any]) -> threading.Thread:
            def run() -> None:
                answers[name] = client.post(path, json=body)

            t = threading.Thread(target=run)
            t.start()
            return t

        def until_depth(n: int) -> None:
            for _ in range(1000):
                if ex.depth() == n:
                    return
                threading.Event().wait(0.01)
            raise AssertionError(f"depth {ex.depth()}, not {n}")

        threads = [post("busy", "/predict", {"context": "a"})]
        try:
            assert engine.entered.wait(10)  # the model thread is busy for 0.258 s
            for stream in (False, True):  # 1.0625 + 8 x 0.125 = 2.06 s by itself
                body = {"context": "the a", "max_tokens": 8, "stream": stream}
                r = client.post("/generate", json=body)
                assert r.status_code == 429, r.text
                assert r.headers["Retry-After"] == "1"
                assert r.json() == {
                    "error": "overloaded",
                    "detail": "the server is busy: this request would take about 2.1 s by "
                    "itself, over the 2 s budget, so it is taken only when the model has "
                    "nothing else queued or reserved; ask for fewer tokens or retry in 1 s",
                }
            # 0.258 ahead + 1.0625 + 3 x 0.125: 1.70 s, admitted
            threads.append(post("three", "/generate", {"context": "the a", "max_tokens": 3}))
            until_depth(1)
            assert ex.reserved() == 1
            # 0.258 + 1.0625 queued + 0.375 reserved ahead, 1.1875 its own: 2.88 s
            r = client.post("/generate", json={"context": "the a", "max_tokens": 1})
            assert r.status_code == 429, r.text
            assert r.headers["Retry-After"] == "2"
            assert r.json()["detail"] == (
                "the server is busy: this request would wait about 2.9 s, over the 2 s "
                "budget; retry in 2 s"
            )
            # first in, first out: 0.258 + 1.0625 queued, 0.258 its own
            threads.append(post("predict", "/predict", {"context": "a"}))
            until_depth(2)
        finally:
            engine.gate.set()
            for t in threads:
                t.join(10)
        assert {k: r.status_code for k, r in answers.items()} == {
            "busy": 200,
            "three": 200,
            "predict": 200,
        }
        assert answers["three"].json()["generated_tokens"] == 3
        assert ex.reserved() == 0  # what it reserved went back as its steps ran
