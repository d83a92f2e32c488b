"""The model executor: bounded queue (429 + Retry-After), micro-batching, no blocking."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.errors import Overloaded
from service.executor import ModelExecutor
from tests.fakes import FakeEngine, Prediction
from tests.service_helpers import make_settings


def test_waiting_items_of_one_key_run_as_one_batch() -> None:
    ex = ModelExecutor(queue_size=16, max_batch=8, retry_after=1)
    gate, started = threading.Event(), threading.Event()
    calls: list[list[int]] = []

    def block() -> None:
        started.set()
        gate.wait(10)

    def batch(items: Sequence[int]) -> list[int]:
        calls.append(list(items))
        return [i * 10 for i in items]

    async def main() -> list[Any]:
        blocker = asyncio.ensure_future(ex.call(block))
        while not started.is_set():  # the thread took the blocker and waits on the gate
            await asyncio.sleep(0.01)
        jobs = [asyncio.ensure_future(ex.batched(batch, (batch, "k"), i)) for i in range(5)]
        other = asyncio.ensure_future(ex.batched(batch, (batch, "other"), 7))
        await asyncio.sleep(0.05)
        gate.set()
        await blocker
        return [*await asyncio.gather(*jobs), await other]

    try:
        assert asyncio.run(main()) == [0, 10, 20, 30, 40, 70]
    finally:
        ex.close()
    assert calls == [[0, 1, 2, 3, 4], [7]]
    assert ex.batches[-2:] == [5, 1]


def test_full_queue_raises_overloaded_and_errors_reach_the_caller() -> None:
    ex = ModelExecutor(queue_size=2, max_batch=4, retry_after=3)
    gate, started = threading.Event(), threading.Event()

    def block() -> None:
        started.set()
        gate.wait(10)

    def fail() -> None:
        raise ValueError("bad input")

    async def main() -> None:
        running = asyncio.ensure_future(ex.call(block))
        while not started.is_set():
            await asyncio.sleep(0.01)
        queued = [asyncio.ensure_future(ex.call(fail)), asyncio.ensure_future(ex.call(len, "ab"))]
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded) as info:
            await ex.call(len, "abc")
        assert info.value.retry_after == 3
        gate.set()
        await running
        with pytest.raises(ValueError, match="bad input"):
            await queued[0]
        assert await queued[1] == 2

    try:
        asyncio.run(main())
    finally:
        ex.close()


class SlowEngine(FakeEngine):
    """predict waits for a gate so the test controls when the model thread is busy."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()

    def predict(self, context: str, *, top_n: int = 10, neighbours: int = 0) -> Prediction:
        self.entered.set()
        self.gate.wait(10)
        return super().predict(context, top_n=top_n, neighbours=neighbours)


def test_http_429_with_retry_after_when_the_queue_is_full(tmp_path: Path, sqlite_url: str) -> None:
    settings = make_settings(tmp_path, sqlite_url, queue_size=1, max_batch=1, retry_after_seconds=2)
    engine = SlowEngine()
    app = create_app(settings, engine=engine, run_worker=False, poll=False)
    with TestClient(app) as client:
        results: list[int] = []

        def call() -> None:
            results.append(client.post("/predict", json={"context": "a"}).status_code)

        first = threading.Thread(target=call)
        first.start()
        assert engine.entered.wait(10)  # the model thread is busy with the first request
        second = threading.Thread(target=call)
        second.start()
        ex = app.state.memlm.executor
        while ex.depth() < 1:  # the second request waits in the queue
            threading.Event().wait(0.01)
        r = client.post("/predict", json={"context": "a"})
        assert r.status_code == 429
        assert r.headers["Retry-After"] == "2"
        assert r.json() == {"error": "overloaded", "detail": "the server is busy; retry shortly"}
        assert client.get("/healthz").status_code == 200  # the event loop is free
        engine.gate.set()
        first.join(10)
        second.join(10)
        assert sorted(results) == [200, 200]
