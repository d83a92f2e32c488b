"""The model executor: admission by expected wait (429 + Retry-After), micro-batching.

The admission tests run on an injected clock and seeded service times: every number is
exact, nothing depends on how fast this machine is.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio.to_thread
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.errors import Overloaded
from service.executor import REQUEST, ModelExecutor, ServiceTimes
from service.routes.inference import BASE_COST, INLINE_CHARS
from tests.fakes import FakeEngine, Prediction
from tests.service_helpers import make_settings


class Clock:
    """A clock that moves only when told."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Blocker:
    """A job that holds the model thread until released."""

    def __init__(self) -> None:
        self.gate, self.started = threading.Event(), threading.Event()
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        self.started.set()
        assert self.gate.wait(10)
        return "done"


async def _until(cond: Callable[[], bool]) -> None:
    for _ in range(1000):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def _refused(ex: ModelExecutor, fn: Callable[..., Any], **kw: Any) -> Overloaded:
    async def main() -> None:
        await ex.call(fn, **kw)

    with pytest.raises(Overloaded) as info:
        asyncio.run(main())
    return info.value


# --- the service-time estimate ---------------------------------------------------------------


def test_service_times_are_a_ratio_of_weighted_sums_per_kind() -> None:
    t = ServiceTimes(alpha=0.25)
    assert t.per_cost("predict") is None
    t.observe("predict", 100, 2.0)
    assert t.per_cost("predict") == 2.0 / 100
    t.observe("predict", 300, 6.0)  # seconds 0.75*2 + 0.25*6 = 3; cost 75 + 75 = 150
    assert t.per_cost("predict") == 3.0 / 150.0
    t.observe("predict", 0, 100.0)  # internal jobs (cost 0) are not timed
    assert t.per_cost("predict") == 3.0 / 150.0
    assert t.per_cost("score") is None  # each kind has its own


# --- admission -------------------------------------------------------------------------------


def test_admission_by_expected_wait_and_retry_after_from_the_drain_time() -> None:
    clock = Clock()
    ex = ModelExecutor(queue_size=64, max_batch=1, budget_s=2.0, clock=clock)
    ex.observe("p", 128, 1.0)  # 1/128 s per unit of cost (exact in binary)
    block = Blocker()

    async def main() -> None:
        running = asyncio.ensure_future(ex.call(block, kind="p", cost=64))  # 0.5 s expected
        await _until(block.started.is_set)
        a = asyncio.ensure_future(ex.call(len, "a" * 5, kind="p", cost=128))  # 0.5 + 1.0
        b = asyncio.ensure_future(ex.call(len, "b" * 7, kind="p", cost=64))  # 1.5 + 0.5 = 2.0
        await _until(lambda: ex.depth() == 2)
        assert ex.retry_after() == 2  # ceil(2.0)
        with pytest.raises(Overloaded) as info:  # 2.0 + 1/128 > 2.0
            await ex.call(len, "c", kind="p", cost=1)
        assert info.value.retry_after == 2
        assert str(info.value) == (
            "the server is busy: this request would wait about 2.0 s, over the 2 s budget; "
            "retry in 2 s"
        )
        clock.t = 0.25  # the running job is half done: 1.75 s ahead
        c = asyncio.ensure_future(ex.call(len, "c" * 3, kind="p", cost=32))  # 1.75 + 0.25
        await _until(lambda: ex.depth() == 3)
        with pytest.raises(Overloaded):
            ex.check("p", 1)
        ex.check("p", 0)  # exactly the budget still fits
        clock.t = 1.25  # the running job overran its estimate: it counts as 0
        assert ex.retry_after() == 2  # ceil(1.0 + 0.5 + 0.25)
        clock.t = 1.5
        block.gate.set()
        assert await running == "done"
        assert [await a, await b, await c] == [5, 7, 3]

    try:
        asyncio.run(main())
    finally:
        ex.close()


def test_an_idle_executor_takes_a_request_over_the_budget_alone() -> None:
    clock = Clock()
    ex = ModelExecutor(queue_size=64, max_batch=1, budget_s=2.0, clock=clock)
    ex.observe("p", 1, 1.0)  # 1 s per unit
    block = Blocker()

    async def main() -> None:
        running = asyncio.ensure_future(ex.call(block, kind="p", cost=10))  # 10 s, idle: taken
        await _until(block.started.is_set)
        with pytest.raises(Overloaded) as info:
            await ex.call(len, "x", kind="p", cost=1)
        assert info.value.retry_after == 10
        clock.t = 9.0
        with pytest.raises(Overloaded) as info:  # 1 s left + 2 s of its own
            await ex.call(len, "x", kind="p", cost=2)
        assert info.value.retry_after == 1
        fits = asyncio.ensure_future(ex.call(len, "x", kind="p", cost=1))  # 1 s + 1 s
        await _until(lambda: ex.depth() == 1)
        block.gate.set()
        assert (await running, await fits) == ("done", 1)

    try:
        asyncio.run(main())
    finally:
        ex.close()


def test_a_kind_never_timed_is_admitted_one_job_at_a_time() -> None:
    ex = ModelExecutor(queue_size=64, max_batch=1, budget_s=2.0, min_retry_after=3)
    block = Blocker()

    async def main() -> None:
        running = asyncio.ensure_future(ex.call(block, kind="p", cost=100))  # idle: taken
        await _until(block.started.is_set)
        assert ex.per_cost("p") is None
        with pytest.raises(Overloaded) as info:
            await ex.call(len, "x", kind="p", cost=1)
        assert info.value.retry_after == 3
        assert str(info.value) == "the server is timing its first requests; retry shortly"
        other = asyncio.ensure_future(ex.call(len, "xy", kind="s", cost=50))  # first of its kind
        await _until(lambda: ex.depth() == 1)
        with pytest.raises(Overloaded):
            await ex.call(len, "x", kind="s", cost=1)
        block.gate.set()
        assert (await running, await other) == ("done", 2)

    try:
        asyncio.run(main())
    finally:
        ex.close()
    assert ex.per_cost("p") is not None and ex.per_cost("s") is not None  # both timed now


class StallingClock:
    """The real clock, but the model thread stalls on it (as a loaded machine may
    deschedule it) once armed: between a job's end and the books that say so."""

    def __init__(self) -> None:
        self.armed = threading.Event()
        self.model_thread: int | None = None

    def __call__(self) -> float:
        if self.armed.is_set() and threading.get_ident() == self.model_thread:
            self.armed.clear()
            threading.Event().wait(0.3)
        return time.monotonic()


def test_a_caller_is_answered_only_once_the_executor_is_idle_again() -> None:
    """A sequential client's next request must not find the thread still busy with the
    one just answered (CI saw a dashboard read refused 429 "timing its first requests")."""
    clock = StallingClock()
    ex = ModelExecutor(queue_size=64, max_batch=1, budget_s=2.0, clock=clock)

    def job() -> str:
        clock.model_thread = threading.get_ident()
        clock.armed.set()  # the stall comes after the job, when it is timed
        return "done"

    async def main() -> None:
        for kind in ("first", "second"):  # an untimed kind, then one timed once
            assert await ex.call(job, kind=kind) == "done"
            assert ex.depth() == 0
            ex.check(kind)  # idle: admitted, not "busy" or "timing its first requests"
            assert ex.per_cost(kind) is not None

    try:
        asyncio.run(main())
    finally:
        ex.close()


def test_full_queue_raises_overloaded_and_errors_reach_the_caller() -> None:
    ex = ModelExecutor(queue_size=2, max_batch=4, budget_s=1000.0, min_retry_after=3)
    ex.observe("call", 1, 0.0)
    block = Blocker()

    def fail() -> None:
        raise ValueError("bad input")

    async def main() -> None:
        running = asyncio.ensure_future(ex.call(block))
        await _until(block.started.is_set)
        queued = [asyncio.ensure_future(ex.call(fail)), asyncio.ensure_future(ex.call(len, "ab"))]
        await _until(lambda: ex.depth() == 2)
        with pytest.raises(Overloaded) as info:
            await ex.call(len, "abc")
        assert info.value.retry_after == 3
        assert str(info.value) == "the model queue is full (2 requests); retry in 3 s"
        block.gate.set()
        await running
        with pytest.raises(ValueError, match="bad input"):
            await queued[0]
        assert await queued[1] == 2

    try:
        asyncio.run(main())
    finally:
        ex.close()


def test_internal_jobs_are_never_refused_and_abandoned_jobs_are_skipped() -> None:
    ex = ModelExecutor(queue_size=1, max_batch=1, budget_s=1.0)
    ex.observe("call", 1, 10.0)  # every request is over the budget behind anything
    block = Blocker()
    ran: list[str] = []

    async def main() -> None:
        running = asyncio.ensure_future(ex.call(block))
        await _until(block.started.is_set)
        sync = asyncio.ensure_future(ex.call(ran.append, "sync", wait=True))
        again = asyncio.ensure_future(ex.call(ran.append, "stats", wait=True))
        await _until(lambda: ex.depth() == 2)
        with pytest.raises(Overloaded):
            await ex.call(ran.append, "request")
        again.cancel()  # its caller went away: the thread skips it
        await asyncio.sleep(0.05)
        block.gate.set()
        await running
        await sync
        await _until(lambda: ex.depth() == 0)
        assert await ex.call(ran.append, "after") is None

    try:
        asyncio.run(main())
    finally:
        ex.close()
    assert ran == ["sync", "after"]


def test_request_slots_by_requests_in_flight_times_seconds_per_request() -> None:
    clock = Clock()
    ex = ModelExecutor(queue_size=64, max_batch=1, budget_s=2.0, clock=clock)
    try:
        with ex.request():  # never timed, idle: admitted
            clock.t = 0.5
        assert ex.per_cost(REQUEST) == 0.5  # the busy time it took
        clock.t = 10.0  # idle time is not counted
        b, c, d, e = ex.request(), ex.request(), ex.request(), ex.request()
        for n, slot in enumerate((b, c, d, e)):  # (n + 1) x 0.5 s: 0.5, 1.0, 1.5, 2.0
            slot.__enter__()
            assert ex.in_flight() == n + 1
        with pytest.raises(Overloaded) as info, ex.request():  # 5 x 0.5 s
            pass
        assert info.value.retry_after == 2  # 4 x 0.5 s
        assert str(info.value) == (
            "the server is busy: 4 request(s) in flight, about 0.500 s each; retry in 2 s"
        )
        # a failed request frees its slot, untimed (the error goes on: __exit__ is False)
        assert b.__exit__(ValueError, ValueError("x"), None) is False
        assert ex.in_flight() == 3 and ex.per_cost(REQUEST) == 0.5
        clock.t = 10.25
        c.__exit__(None, None, None)  # served: 0.25 s of busy time since the last one
        assert ex.per_cost(REQUEST) == (0.8 * 0.5 + 0.2 * 0.25) / 1.0
        clock.t = 10.5
        d.__exit__(None, None, None)
        e.__exit__(None, None, None)  # 0 s after d: they finished together
        assert ex.in_flight() == 0
    finally:
        ex.close()


# --- requests in parts (a /generate): admitted by their whole cost ---------------------------


def _timed_executor(**kw: Any) -> tuple[ModelExecutor, Clock]:
    """A 2 s budget; "p" costs 1/128 s a unit, "g" (a context) 1/128, "s" (a step) 1/32."""
    clock = Clock()
    ex = ModelExecutor(**{"queue_size": 64, "max_batch": 1, "budget_s": 2.0, "clock": clock, **kw})
    ex.observe("p", 128, 1.0)
    ex.observe("g", 128, 1.0)
    ex.observe("s", 32, 1.0)
    return ex, clock


def _fits(ex: ModelExecutor, kind: str, cost: int, later: tuple[str, int]) -> bool:
    try:
        ex.check(kind, cost, later)
    except Overloaded:
        return False
    return True


def test_a_request_in_parts_is_admitted_by_its_whole_cost() -> None:
    """Its reservation counts ahead of later requests that reserve, not of a /predict
    (first in, first out: a /predict waits for the parts queued, one per generation)."""
    ex, _ = _timed_executor()
    block = Blocker()

    async def main() -> None:
        running = asyncio.ensure_future(ex.call(block, kind="p", cost=64))  # 0.5 s
        await _until(block.started.is_set)
        # 0.5 ahead + 64/128 s now + 32/32 s of steps later: 2.0 s, admitted
        first = asyncio.ensure_future(ex.start(len, "abc", kind="g", cost=64, later=("s", 32)))
        await _until(lambda: ex.depth() == 1)
        assert ex.reserved() == 1
        with pytest.raises(Overloaded) as info:  # 0.5 + 0.5 + 1.0 reserved, + 1.5 own
            await ex.start(len, "x", kind="g", cost=64, later=("s", 32))
        assert info.value.retry_after == 2  # the queue drains in 1 s; the steps do not wait
        assert str(info.value) == (
            "the server is busy: this request would wait about 3.5 s, over the 2 s budget; "
            "retry in 2 s"
        )
        with pytest.raises(Overloaded):  # refused before any work, as the route does
            ex.check("g", 0, later=("s", 32))
        ex.check("g", 0, later=("s", 0))  # 2.0 s ahead with the reservation: still fits
        predict = asyncio.ensure_future(ex.call(len, "ab", kind="p", cost=64))  # 0.5+0.5+0.5
        await _until(lambda: ex.depth() == 2)
        block.gate.set()
        assert (await running, await predict) == ("done", 2)
        n, steps = await first
        assert n == 3 and steps.left == 32
        assert await steps.call(len, "abcd", cost=8) == 4  # a part: drawn from the 32
        assert steps.left == 24 and ex.reserved() == 1
        steps.close()  # it stopped early: the 24 left are given back
        assert ex.reserved() == 0

    try:
        asyncio.run(main())
    finally:
        ex.close()
    assert ex.per_cost("s") == pytest.approx(ex.per_cost("s") or 0)  # the part was timed


def test_a_request_over_the_budget_by_itself_runs_only_when_nothing_is_reserved() -> None:
    """A dozen long generations cannot pile up: each is taken only by an idle executor,
    and one open generation keeps the next from counting as idle."""
    ex, clock = _timed_executor()
    block = Blocker()

    async def main() -> None:
        running = asyncio.ensure_future(ex.call(block, kind="p", cost=64))
        await _until(block.started.is_set)
        for _ in range(12):  # 64/128 + 256/32 = 8.5 s each
            with pytest.raises(Overloaded) as info:
                await ex.start(len, "x", kind="g", cost=64, later=("s", 256))
            assert str(info.value) == (
                "the server is busy: this request would take about 8.5 s by itself, over "
                "the 2 s budget, so it is taken only when the model has nothing else queued "
                "or reserved; ask for fewer tokens or retry in 1 s"
            )
        assert ex.depth() == 0 and ex.reserved() == 0
        block.gate.set()
        await running
        await _until(lambda: _fits(ex, "g", 64, ("s", 256)))  # the thread has let go
        # idle: taken alone, however long
        _, long = await ex.start(len, "x", kind="g", cost=64, later=("s", 256))
        assert ex.depth() == 0 and ex.reserved() == 1  # between two parts: the thread idles
        clock.t = 10.0  # its first job is long done
        with pytest.raises(Overloaded) as info:  # 8 s reserved ahead
            await ex.start(len, "x", kind="g", cost=1, later=("s", 1))
        assert info.value.retry_after == 8
        assert await ex.call(len, "abc", kind="p", cost=64) == 3  # a /predict is served
        long.close()
        _, short = await ex.start(len, "x", kind="g", cost=1, later=("s", 1))
        short.close()

    try:
        asyncio.run(main())
    finally:
        ex.close()


def test_open_requests_in_parts_hold_their_places_under_the_queue_cap() -> None:
    ex, _ = _timed_executor(queue_size=2, budget_s=1000.0)
    block = Blocker()

    async def main() -> None:
        running = asyncio.ensure_future(ex.call(block, kind="p", cost=1))
        await _until(block.started.is_set)
        first = [
            asyncio.ensure_future(ex.start(len, x, kind="g", cost=1, later=("s", 8))) for x in "ab"
        ]
        await _until(lambda: ex.depth() == 2)
        with pytest.raises(Overloaded) as info:
            await ex.call(len, "z", kind="p", cost=1)
        assert str(info.value) == "the model queue is full (2 requests); retry in 1 s"
        block.gate.set()
        await running
        (_, a), (_, b) = [await f for f in first]
        with pytest.raises(Overloaded) as info:  # two open, none of their parts queued
            await ex.start(len, "c", kind="g", cost=1, later=("s", 8))
        assert str(info.value) == "the model queue is full (2 requests); retry in 1 s"
        parts = [asyncio.ensure_future(r.call(len, "xy", cost=4)) for r in (a, b)]
        assert [await p for p in parts] == [2, 2]  # parts are queued whatever the cap
        a.close()
        assert await ex.call(len, "z", kind="p", cost=1) == 1  # its place is free again
        b.close()

    try:
        asyncio.run(main())
    finally:
        ex.close()


def test_a_reservation_never_closed_is_given_back_when_collected() -> None:
    """A stream whose client left before it began never runs its generator (nor its
    ``finally``): the reservation must not hold the budget for ever."""
    ex, _ = _timed_executor()

    async def main() -> None:
        _, steps = await ex.start(len, "x", kind="g", cost=1, later=("s", 256))
        assert ex.reserved() == 1
        assert not _fits(ex, "g", 1, ("s", 256))  # 8 s reserved: never idle
        del steps
        gc.collect()
        assert ex.reserved() == 0
        await _until(lambda: _fits(ex, "g", 1, ("s", 256)))  # idle again

    try:
        asyncio.run(main())
    finally:
        ex.close()


def test_a_reserved_kind_never_timed_is_let_in_once_and_freed_by_an_early_end() -> None:
    ex = ModelExecutor(queue_size=64, max_batch=1, budget_s=2.0, min_retry_after=3)
    ex.observe("g", 1, 0.001)
    block = Blocker()

    async def main() -> None:
        running = asyncio.ensure_future(ex.call(block, kind="g", cost=1))
        await _until(block.started.is_set)
        first = asyncio.ensure_future(ex.start(len, "a", kind="g", cost=1, later=("s", 4)))
        await _until(lambda: ex.depth() == 1)
        with pytest.raises(Overloaded) as info:  # "s" untimed and already let in once
            await ex.start(len, "b", kind="g", cost=1, later=("s", 4))
        assert str(info.value) == "the server is timing its first requests; retry shortly"
        block.gate.set()
        await running
        _, steps = await first
        steps.close()  # it ended before any step ran: "s" is still untimed, and free
        ex.check("g", 1, later=("s", 4))

    try:
        asyncio.run(main())
    finally:
        ex.close()
    assert ex.per_cost("s") is None


# --- micro-batching ---------------------------------------------------------------------------


def test_waiting_items_of_one_key_run_as_one_batch() -> None:
    clock = Clock()
    ex = ModelExecutor(queue_size=16, max_batch=8, budget_s=2.0, clock=clock)
    ex.observe("call", 1, 0.5)
    ex.observe("batch", 8, 1.0)  # 1/8 s per item
    block = Blocker()
    calls: list[list[int]] = []

    def batch(items: Sequence[int]) -> list[int]:
        calls.append(list(items))
        clock.t += 0.25 * len(items)  # the batch takes 1/4 s per item
        return [i * 10 for i in items]

    async def main() -> list[Any]:
        blocker = asyncio.ensure_future(ex.call(block))
        await _until(block.started.is_set)
        jobs = [asyncio.ensure_future(ex.batched(batch, (batch, "k"), i)) for i in range(5)]
        other = asyncio.ensure_future(ex.batched(batch, (batch, "other"), 7))
        await _until(lambda: ex.depth() == 6)
        block.gate.set()
        await blocker
        return [*await asyncio.gather(*jobs), await other]

    try:
        assert asyncio.run(main()) == [0, 10, 20, 30, 40, 70]
    finally:
        ex.close()
    assert calls == [[0, 1, 2, 3, 4], [7]]
    assert ex.batches[-2:] == [5, 1]
    # each batch is timed for its total cost: 1.25 s for 5, then 0.25 s for 1
    s, c = 0.8 * 1.0 + 0.2 * 1.25, 0.8 * 8 + 0.2 * 5
    assert ex.per_cost("batch") == pytest.approx((0.8 * s + 0.2 * 0.25) / (0.8 * c + 0.2))


# --- over HTTP --------------------------------------------------------------------------------


class SlowEngine(FakeEngine):
    """predict and count_tokens wait for gates so the test controls who is busy."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.count_gate = threading.Event()
        self.count_gate.set()

    def predict(self, context: str, *, top_n: int = 10, neighbours: int = 0) -> Prediction:
        self.entered.set()
        assert self.gate.wait(10)
        return super().predict(context, top_n=top_n, neighbours=neighbours)

    def count_tokens(self, text: str) -> int:
        assert self.count_gate.wait(10)
        return super().count_tokens(text)


def _words(n: int) -> str:
    return " ".join(["the"] * n)


@pytest.fixture
def pauses(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The seconds each 429 was held (MEMLM_OVERLOAD_DELAY_SECONDS), recorded, not slept."""
    import service.errors

    seen: list[float] = []

    async def record(seconds: float) -> None:
        seen.append(seconds)

    monkeypatch.setattr(service.errors, "_sleep", record)
    return seen


def test_http_429_body_and_retry_after_from_the_queue(
    tmp_path: Path, sqlite_url: str, pauses: list[float]
) -> None:
    settings = make_settings(tmp_path, sqlite_url, max_batch=1, queue_budget_s=2.0)
    engine = SlowEngine()
    app = create_app(settings, engine=engine, run_worker=False, poll=False)
    clock = Clock()
    with TestClient(app) as client:
        ex: ModelExecutor = app.state.memlm.executor
        ex.clock = clock
        ex.observe("predict", 128, 1.0)
        context = _words(64 - BASE_COST)  # cost 64: 0.5 s
        results: list[int] = []

        def call() -> None:
            results.append(client.post("/predict", json={"context": context}).status_code)

        threads = [threading.Thread(target=call)]
        threads[0].start()
        assert engine.entered.wait(10)  # the model thread is busy with the first request
        for n in range(3):  # 0.5 s ahead each: 1.0, 1.5 and 2.0 s with their own
            threads.append(threading.Thread(target=call))
            threads[-1].start()
            for _ in range(1000):
                if ex.depth() == n + 1:
                    break
                threading.Event().wait(0.01)
        assert ex.depth() == 3
        r = client.post("/predict", json={"context": context})
        assert r.status_code == 429
        assert r.headers["Retry-After"] == "2"
        assert r.json() == {
            "error": "overloaded",
            "detail": "the server is busy: this request would wait about 2.5 s, "
            "over the 2 s budget; retry in 2 s",
        }
        clock.t = 0.75  # the first request overran its estimate: 1.5 s ahead
        r = client.post("/predict", json={"context": _words(65 - BASE_COST)})
        assert r.status_code == 429  # 1.5 + 65 / 128 s
        assert r.headers["Retry-After"] == "2"
        assert client.get("/healthz").status_code == 200  # the event loop is free
        engine.gate.set()
        for t in threads:
            t.join(10)
        assert results == [200, 200, 200, 200]
    assert pauses == [0.5, 0.5]  # both 429s held MEMLM_OVERLOAD_DELAY_SECONDS


@pytest.mark.parametrize(("delay", "held"), [(0.5, [0.5]), (5.0, [2.0]), (0.0, [])])
def test_http_429_from_the_request_slots(
    tmp_path: Path, sqlite_url: str, pauses: list[float], delay: float, held: list[float]
) -> None:
    """A refused request is held the overload delay, never longer than its Retry-After."""
    settings = make_settings(tmp_path, sqlite_url, queue_budget_s=2.0, overload_delay_seconds=delay)
    engine = SlowEngine()
    app = create_app(settings, engine=engine, run_worker=False, poll=False)
    with TestClient(app) as client:
        ex: ModelExecutor = app.state.memlm.executor
        ex.observe(REQUEST, 1, 1.5)
        done: list[int] = []
        first = threading.Thread(
            target=lambda: done.append(client.post("/predict", json={"context": "a"}).status_code)
        )
        first.start()
        assert engine.entered.wait(10)
        assert ex.in_flight() == 1
        r = client.post("/score", json={"text": "the a"})  # (1 + 1) x 1.5 s > 2 s
        assert (r.status_code, r.headers["Retry-After"]) == (429, "2")
        assert r.json() == {
            "error": "overloaded",
            "detail": "the server is busy: 1 request(s) in flight, about 1.500 s each; "
            "retry in 2 s",
        }
        assert client.get("/healthz").status_code == 200  # not a model request
        engine.gate.set()
        first.join(10)
        assert done == [200] and ex.in_flight() == 0
    assert pauses == held


def test_score_cost_counts_its_tokens(tmp_path: Path, sqlite_url: str) -> None:
    settings = make_settings(tmp_path, sqlite_url, max_batch=1, queue_budget_s=2.0)
    engine = SlowEngine()
    app = create_app(settings, engine=engine, run_worker=False, poll=False)
    with TestClient(app) as client:
        ex: ModelExecutor = app.state.memlm.executor
        ex.clock = Clock()
        ex.observe("predict", 128, 1.0)
        ex.observe("score", 128, 1.0)
        done: list[int] = []

        def post(path: str, body: dict[str, str]) -> None:
            done.append(client.post(path, json=body).status_code)

        first = threading.Thread(
            target=post, args=("/predict", {"context": _words(64 - BASE_COST)})
        )
        first.start()
        assert engine.entered.wait(10)  # 64 / 128 = 0.5 s ahead
        r = client.post("/score", json={"text": _words(193 - BASE_COST)})
        assert r.status_code == 429  # 0.5 s + 193 / 128 s
        assert r.json()["detail"] == (
            "the server is busy: this request would wait about 2.0 s, over the 2 s budget; "
            "retry in 1 s"
        )
        second = threading.Thread(target=post, args=("/score", {"text": _words(192 - BASE_COST)}))
        second.start()  # 0.5 + 1.5 s: fits
        for _ in range(1000):
            if ex.depth() == 1:
                break
            threading.Event().wait(0.01)
        assert ex.depth() == 1
        engine.gate.set()
        first.join(10)
        second.join(10)
        assert done == [200, 200]


def test_healthz_answers_while_the_thread_pool_and_the_model_are_busy(
    tmp_path: Path, sqlite_url: str
) -> None:
    settings = make_settings(tmp_path, sqlite_url)
    engine = SlowEngine()
    engine.count_gate.clear()  # /score requests hold their thread-pool thread here
    app = create_app(settings, engine=engine, run_worker=False, poll=False)
    with TestClient(app) as client:
        assert client.portal is not None

        def small_pool() -> None:
            anyio.to_thread.current_default_thread_limiter().total_tokens = 2

        client.portal.call(small_pool)
        long = _words(INLINE_CHARS // 4 + 1)  # tokenised in the pool
        busy = [
            threading.Thread(target=client.post, args=("/score",), kwargs={"json": {"text": long}})
            for _ in range(2)
        ]
        for t in busy:
            t.start()
        limiter: Any = client.portal.call(anyio.to_thread.current_default_thread_limiter)
        for _ in range(1000):
            if limiter.borrowed_tokens == 2:
                break
            threading.Event().wait(0.01)
        assert limiter.borrowed_tokens == 2  # no thread left for a sync route
        got: list[int] = []
        probe = threading.Thread(target=lambda: got.append(client.get("/healthz").status_code))
        probe.start()
        probe.join(5)
        answered = list(got)  # while the pool is still full: a sync route has none
        engine.count_gate.set()
        for t in [*busy, probe]:
            t.join(10)
        assert answered == [200]
