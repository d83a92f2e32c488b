"""memlm.client against the in-process app (the exact fake engine), retries on a scripted
transport, and the async client on httpx's ASGI transport; the live `memlm up` test is
in tests/test_client_up.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from memlm.api import (
    GenerateDone,
    GeneratedTokenOut,
    GenerateResponse,
    PredictResponse,
    StatsResponse,
)
from memlm.client import (
    AsyncClient,
    Client,
    NotFound,
    Overloaded,
    Unauthorized,
    ValidationFailed,
    _core,
)
from tests.service_helpers import doc
from tests.test_api import Env, _env

ADMIN = "admin-secret-for-tests"


@pytest.fixture
def env(tmp_path: Path, sqlite_url: str) -> Iterator[Env]:
    yield from _env(tmp_path, sqlite_url, max_documents_per_request=3)


def client(env: Env, token: str | None = ADMIN, **kw: Any) -> Client:
    return Client(token=token, http=env.client, **kw)


def test_ingest_in_batches_wait_predict_generate_stats_forget(env: Env) -> None:
    c = client(env)
    docs = [doc(f"we saw the {w} of the day", external_id=f"n{i}") for i, w in enumerate("abcde")]
    seen: list[int] = []
    accepted = c.ingest(docs, batch_size=2, progress=seen.append)
    assert seen == [2, 2, 1]  # three requests of at most two documents
    assert [a.id for a in accepted] == [1, 2, 3, 4, 5] and not any(a.duplicate for a in accepted)
    again = c.ingest(docs[:2])  # the same external ids: deduplicated, the same ids
    assert [(a.id, a.duplicate) for a in again] == [(1, True), (2, True)]
    env.drain()
    done = c.wait([a.id for a in accepted], timeout=5)
    assert [d.status for d in done] == ["done"] * 5 and done[0].external_id == "n0"

    pred = c.predict("we saw the", top_n=3, neighbours=2)
    assert isinstance(pred, PredictResponse)
    assert pred.lambda_ == 0.5 and pred.neighbours[0].token == "a"
    gen = c.generate("we saw the", max_tokens=3)
    assert isinstance(gen, GenerateResponse)
    assert gen.finish_reason == "length" and gen.generated_tokens == 3
    events = list(c.generate_stream("we saw the", max_tokens=3))
    assert [type(e) for e in events] == [GeneratedTokenOut] * 3 + [GenerateDone]
    assert [e for e in events[:-1]] == gen.tokens
    assert events[-1] == GenerateDone(**gen.model_dump(exclude={"tokens"}))
    score = c.score("we saw the a")
    assert score.tokens == ["we", "saw", "the", "a"] and len(score.logprobs) == 3

    stats = c.stats()
    assert isinstance(stats, StatsResponse) and stats.documents == {"done": 5}
    assert c.policy().policy == "monim"
    assert c.policy("fullmem").policy == "fullmem"
    build = c.rebuild(key="k1")
    assert build.request_key == "k1" and c.build(build.id).id == build.id
    forgotten = c.forget(1)
    assert forgotten.id == 1 and forgotten.status in ("forgetting", "forgotten")


def test_errors_are_typed_and_carry_the_body(env: Env) -> None:
    with pytest.raises(Unauthorized) as e:
        client(env, token="wrong").stats()
    assert e.value.status == 401 and e.value.error == "unauthorized"
    assert e.value.body == {
        "error": "unauthorized",
        "detail": "a valid admin bearer token is required",
    }
    with pytest.raises(NotFound) as nf:
        client(env).document(999)
    assert nf.value.body["error"] == "not_found"
    with pytest.raises(ValidationFailed) as v:
        client(env).predict("the", top_n=0)
    assert v.value.status == 422 and v.value.detail.startswith("top_n:")
    with pytest.raises(ValidationFailed) as g:  # refused before the stream starts
        list(client(env).generate_stream("the", max_tokens=10_000))
    assert "MEMLM_MAX_GENERATE_TOKENS" in g.value.detail
    with pytest.raises(ValueError):  # the API's own model validates before sending
        client(env).ingest([{"text": "", "published_at": "2017-02-07", "source": "s"}])


def _scripted(statuses: list[int], seen: list[dict[str, Any]]) -> httpx.MockTransport:
    """A transport answering /ingest with the given statuses in turn (then 202s)."""
    left = list(statuses)

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        status = left.pop(0) if left else 202
        if status == 429:
            return httpx.Response(
                429, json={"error": "overloaded", "detail": "busy"}, headers={"Retry-After": "3"}
            )
        if status == 0:
            raise httpx.ReadTimeout("cut", request=request)
        docs = [{"id": i + 1, "status": "pending"} for i in range(len(body["documents"]))]
        return httpx.Response(202, json={"documents": docs})

    return httpx.MockTransport(handle)


def test_ingest_retries_429_after_retry_after_and_a_broken_connection() -> None:
    seen: list[dict[str, Any]] = []
    sleeps: list[float] = []
    http = httpx.Client(base_url="http://memlm", transport=_scripted([429, 0, 429], seen))
    c = Client(http=http, sleep=sleeps.append)
    out = c.ingest([doc("one two three", external_id="x1")])
    assert [a.id for a in out] == [1]
    assert sleeps == [3.0, 1.0, 3.0]  # Retry-After, then backoff 0.5 * 2**1, Retry-After
    assert len(seen) == 4 and all(b == seen[0] for b in seen)  # the same batch each time
    assert seen[0]["documents"][0]["external_id"] == "x1"


def test_retries_give_up_with_the_last_429() -> None:
    sleeps: list[float] = []
    http = httpx.Client(
        base_url="http://memlm", transport=_scripted([429] * (_core.RETRIES + 1), [])
    )
    with pytest.raises(Overloaded) as e:
        Client(http=http, sleep=sleeps.append).ingest([doc("one two")])
    assert e.value.retry_after == 3.0 and len(sleeps) == _core.RETRIES
    # predict is not retried: the caller decides
    http = httpx.Client(base_url="http://memlm", transport=_scripted([429], []))
    with pytest.raises(Overloaded):
        Client(http=http, sleep=sleeps.append).predict("a")


def test_async_client_on_the_asgi_transport(env: Env) -> None:
    app = env.client.app  # started by the TestClient (lifespan ran)
    env.engine.served_version = 0

    async def run() -> tuple[Any, ...]:
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        http = httpx.AsyncClient(transport=transport, base_url="http://memlm")
        async with AsyncClient(token=ADMIN, http=http) as c:
            acc = await c.ingest([doc("we saw the cat"), doc("we saw the dog")], batch_size=1)
            await asyncio.to_thread(env.drain)
            done = await c.wait([a.id for a in acc], timeout=5)
            pred = await c.predict("we saw the", neighbours=1)
            events = [e async for e in c.generate_stream("we saw the", max_tokens=2)]
            with pytest.raises(Unauthorized):
                await AsyncClient(token="bad", http=http).stats()
            return done, pred, events, await c.stats()

    done, pred, events, stats = asyncio.run(run())
    assert [d.status for d in done] == ["done", "done"]
    assert pred.lambda_ == 0.5 and {s.token for s in pred.suggestions[:2]} == {"cat", "dog"}
    assert [type(e).__name__ for e in events] == ["GeneratedTokenOut"] * 2 + ["GenerateDone"]
    assert stats.documents == {"done": 2}
