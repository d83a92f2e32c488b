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
from tests.test_api_executor import SlowEngine


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
