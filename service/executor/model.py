"""The model executor: one thread runs every LM forward and search, fed by a queue.

The event loop only enqueues and awaits. Admission is by expected wait, not by queue
length: every request carries a cost (the tokens the model will read), the thread times
what it runs per unit of cost, and a request is queued only when the work ahead of it
plus its own fits ``budget_s``. Otherwise :class:`Overloaded` (429) with a Retry-After
of the queue's expected drain time. Jobs that share a ``batch`` key and wait together
are handed to their batch function in one call (micro-batching).

The model thread is not the only place a request waits: under load the event loop
(HTTP, JSON, validation) and the thread pool queue requests too. So the routes also
hold a request slot (:meth:`ModelExecutor.enter_request`, taken by the
``RequestSlots`` middleware) for their whole run, and a new
request is refused when (requests in flight + 1) x the measured seconds per request
exceeds the same budget (Little's law: the wait of a request that joins L others
served at rate mu is about (L + 1) / mu, whatever the bottleneck is).

A request that runs as several jobs (a /generate: its context, then its steps) is
admitted once, by its whole cost: its first job's cost plus a *reservation* for the
parts it will queue later (:meth:`ModelExecutor.start`). Its parts are then never
refused (a refusal half-way would lose the work done), but until it ends it holds one
place under the queue cap, and what it has reserved and not yet queued counts ahead of
every later request that reserves too (nor is such a request taken "because the thread
is idle" while one is open). A /predict still sees only the jobs queued ahead of it:
the parts of a generation are queued one at a time, so it waits for at most one part of
each, and the open generations' whole cost fits the budget they were admitted under.

Thread safety by design: the queue's bookkeeping (costs waiting, the batch running, the
service-time estimates) is touched only under ``self._lock``, by the event loop when it
admits and by the model thread when it takes and finishes jobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from service.errors import Overloaded
from service.executor.jobs import BatchFn, Reservation, T, _Held, _Job, _resolve
from service.executor.timing import ALPHA, REQUEST, ServiceTimes

log = logging.getLogger(__name__)


class ModelExecutor:
    """A single worker thread behind a queue admitted by expected wait.

    ``budget_s``: the longest expected wait (work ahead + the request's own) admitted;
    ``queue_size``: a hard cap on jobs waiting whatever the estimate says;
    ``min_retry_after``: the least Retry-After; ``clock``: injectable for tests.
    """

    def __init__(
        self,
        *,
        queue_size: int,
        max_batch: int,
        budget_s: float,
        min_retry_after: int = 1,
        clock: Callable[[], float] = time.monotonic,
        alpha: float = ALPHA,
    ) -> None:
        assert budget_s > 0 and queue_size >= 1 and max_batch >= 1 and min_retry_after >= 1
        self._q: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.queue_size = queue_size
        self.max_batch = max_batch
        self.budget_s = budget_s
        self.min_retry_after = min_retry_after
        self.clock = clock
        self.times = ServiceTimes(alpha)
        self._lock = threading.Lock()
        # --- guarded by _lock ---
        self._waiting = 0  # jobs in the queue
        self._queued_cost: dict[str, int] = {}  # cost waiting, per kind
        self._unmeasured: set[str] = set()  # kinds with an untimed job queued or running
        self._busy = False
        self._running_s = 0.0  # expected seconds of the jobs on the thread
        self._started = 0.0
        self._in_flight = 0  # requests holding a slot (``request()``)
        self._mark = 0.0  # the last completion, or the start of the busy period
        self._held: list[_Held] = []  # open reservations (see ``_settle``)
        # ---
        self._closing = False
        self.batches: list[int] = []  # sizes of the last batches run (for tests and logs)
        self._thread = threading.Thread(target=self._loop, name="memlm-model", daemon=True)
        self._thread.start()

    def depth(self) -> int:
        return self._waiting

    def observe(self, kind: str, cost: int, seconds: float) -> None:
        """Record that a job of ``kind`` and ``cost`` took ``seconds`` (the thread's timing)."""
        with self._lock:
            self.times.observe(kind, cost, seconds)

    def per_cost(self, kind: str) -> float | None:
        """The current estimate of seconds per unit of cost of ``kind``."""
        with self._lock:
            return self.times.per_cost(kind)

    # --- requests in flight (event loop) ------------------------------------------------

    def _slot_refusal(self, now: float) -> Overloaded | None:
        """Why a new request gets no slot now, or None (lock held)."""
        per = self.times.per_cost(REQUEST)
        if self._in_flight == 0 or per is None:
            return None
        if (self._in_flight + 1) * per <= self.budget_s:
            return None
        retry = max(self.min_retry_after, math.ceil(self._in_flight * per))
        return Overloaded(
            f"the server is busy: {self._in_flight} request(s) in flight, about {per:.3f} s "
            f"each; retry in {retry} s",
            retry_after=retry,
        )

    def enter_request(self) -> None:
        """Take a request slot for the whole of a request; :class:`Overloaded` if refused."""
        with self._lock:
            now = self.clock()
            refusal = self._slot_refusal(now)
            if refusal is not None:
                raise refusal
            if self._in_flight == 0:
                self._mark = now
            self._in_flight += 1

    def leave_request(self, served: bool) -> None:
        """Give the slot back. A request ``served`` is timed: the busy time (some request
        in flight) since the last one served; one refused further on or failed is not."""
        with self._lock:
            if served:
                now = self.clock()
                self.times.observe(REQUEST, 1, now - self._mark)
                self._mark = now
            self._in_flight -= 1

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """``enter_request`` / ``leave_request`` around a block (served unless it raises)."""
        self.enter_request()
        try:
            yield
        except BaseException:
            self.leave_request(served=False)
            raise
        self.leave_request(served=True)

    def in_flight(self) -> int:
        return self._in_flight

    # --- admission to the model queue (event loop) ------------------------------------------

    def _ahead(self, now: float) -> float:
        """Expected seconds until the thread has finished the work queued now (lock held).

        An untimed kind (at most one such job each) counts as 0 until it is timed.
        """
        left = max(0.0, self._running_s - (now - self._started)) if self._busy else 0.0
        for kind, cost in self._queued_cost.items():
            per = self.times.per_cost(kind)
            if cost and per is not None:
                left += cost * per
        return left

    def _settle(self) -> None:
        """Forget the reservations that ended (lock held)."""
        if not any(h.ended for h in self._held):
            return
        for h in self._held:
            if h.ended and self.times.per_cost(h.kind) is None:
                # its kind was let in untimed on its account, and no part of it will run
                # (a part still queued belongs to a request that left: it is skipped)
                self._unmeasured.discard(h.kind)
        self._held = [h for h in self._held if not h.ended]

    def _reserved(self) -> float:
        """Expected seconds of the parts that open reservations will still queue (lock held)."""
        left = 0.0
        for h in self._held:
            per = self.times.per_cost(h.kind)
            if h.left and per is not None:
                left += h.left * per
        return left

    def _places(self) -> int:
        """Places taken under the queue cap (lock held): the jobs waiting, where each open
        reservation counts once, whether a part of it is queued right now or not."""
        return self._waiting - sum(h.waiting for h in self._held) + len(self._held)

    def _refusal(
        self, kind: str, cost: int, now: float, later: tuple[str, int] | None = None
    ) -> Overloaded | None:
        """Why a request of ``cost`` (and ``later``: the kind and cost of the parts it will
        queue afterwards) is not admitted now, or None (lock held)."""
        self._settle()
        if not self._busy and self._waiting == 0 and (later is None or not self._held):
            return None  # idle: any request, however large (the token limits bound it)
        # A request that reserves waits behind the others' reservations too: their parts
        # take turns with its own until they end. One that does not waits only for the
        # jobs queued ahead of it (first in, first out).
        ahead = self._ahead(now) + (0.0 if later is None else self._reserved())
        retry = max(self.min_retry_after, math.ceil(ahead))
        if self._places() >= self.queue_size:
            return Overloaded(
                f"the model queue is full ({self.queue_size} requests); retry in {retry} s",
                retry_after=retry,
            )
        own = 0.0
        for k, c in [(kind, cost)] if later is None else [(kind, cost), later]:
            per = self.times.per_cost(k)
            if per is not None:
                own += c * per
            elif k in self._unmeasured:
                return Overloaded(
                    "the server is timing its first requests; retry shortly",
                    retry_after=retry,
                )
        if later is not None and own > self.budget_s:
            return Overloaded(
                f"the server is busy: this request would take about {own:.1f} s by itself, "
                f"over the {self.budget_s:g} s budget, so it is taken only when the model "
                "has nothing else queued or reserved; ask for fewer tokens or retry in "
                f"{retry} s",
                retry_after=retry,
            )
        if ahead + own > self.budget_s:
            return Overloaded(
                f"the server is busy: this request would wait about {ahead + own:.1f} s, "
                f"over the {self.budget_s:g} s budget; retry in {retry} s",
                retry_after=retry,
            )
        return None

    def retry_after(self) -> int:
        """Whole seconds until the model work queued now is expected to be done (at least
        the minimum)."""
        with self._lock:
            return max(self.min_retry_after, math.ceil(self._ahead(self.clock())))

    def check(self, kind: str, cost: int = 0, later: tuple[str, int] | None = None) -> None:
        """Raise :class:`Overloaded` if a request of ``cost`` (and ``later``, as for
        :meth:`start`) would be refused now.

        Lets a route refuse before it spends time on a request (tokenising it).
        """
        with self._lock:
            refusal = self._refusal(kind, cost, self.clock(), later)
        if refusal is not None:
            raise refusal

    def _enqueue(self, job: _Job) -> None:
        """Put ``job`` in the queue and its books (lock held)."""
        self._waiting += 1
        self._queued_cost[job.kind] = self._queued_cost.get(job.kind, 0) + job.cost
        if job.held is not None:
            job.held.waiting += 1
        self._q.put(job)

    def _put(self, job: _Job, admit: bool, later: tuple[str, int] | None = None) -> None:
        with self._lock:
            if admit:
                refusal = self._refusal(job.kind, job.cost, self.clock(), later)
                if refusal is not None:
                    raise refusal
                for kind in [job.kind] if later is None else [job.kind, later[0]]:
                    if self.times.per_cost(kind) is None:
                        self._unmeasured.add(kind)
            if later is not None:
                job.held = _Held(*later)
                self._held.append(job.held)
            self._enqueue(job)

    async def _part(self, held: _Held, fn: Callable[..., T], args: tuple[Any, ...], cost: int) -> T:
        """Queue a part of a reserved request, never refused (``Reservation.call``)."""
        assert cost >= 1
        loop = asyncio.get_running_loop()
        job = _Job(fn, args, loop, loop.create_future(), kind=held.kind, cost=cost, held=held)
        with self._lock:
            held.left = max(0, held.left - cost)
            self._enqueue(job)
        result: T = await self._await(job)
        return result

    def _release(self, held: _Held) -> None:
        with self._lock:
            held.ended = True
            self._settle()

    def reserved(self) -> int:
        """Open reservations (requests admitted for parts they have not all queued)."""
        with self._lock:
            self._settle()
            return len(self._held)

    async def _await(self, job: _Job) -> Any:
        try:
            return await job.future
        except asyncio.CancelledError:
            job.abandoned = True
            raise

    async def call(
        self,
        fn: Callable[..., T],
        *args: Any,
        kind: str = "call",
        cost: int = 1,
        wait: bool = False,
    ) -> T:
        """Run ``fn(*args)`` on the model thread, admitted by its ``cost``.

        ``wait=True``: an internal job (index sync), queued whatever the load, not timed.
        """
        assert cost >= 1
        loop = asyncio.get_running_loop()
        job = _Job(fn, args, loop, loop.create_future())
        if not wait:
            job.kind, job.cost = kind, cost
        self._put(job, admit=not wait)
        result: T = await self._await(job)
        return result

    async def start(
        self, fn: Callable[..., T], *args: Any, kind: str, cost: int, later: tuple[str, int]
    ) -> tuple[T, Reservation]:
        """Run ``fn(*args)``, the first job of a request that goes on in parts (a
        /generate: its context, then its steps), admitted by its whole cost: ``cost`` of
        ``kind`` now, and ``later`` = (kind, cost) reserved for the parts.

        The parts are queued by :meth:`Reservation.call`, never refused; close the
        reservation when the request ends. :class:`Overloaded` if refused.
        """
        assert cost >= 1 and later[1] >= 0
        loop = asyncio.get_running_loop()
        job = _Job(fn, args, loop, loop.create_future(), kind=kind, cost=cost)
        self._put(job, admit=True, later=later)
        assert job.held is not None
        # the first job is a part of it too: the request holds one place under the cap
        reservation = Reservation(self, job.held)
        try:
            result: T = await self._await(job)
        except BaseException:
            reservation.close()
            raise
        return result, reservation

    async def batched(
        self,
        batch_fn: BatchFn,
        key: tuple[Any, ...],
        item: Any,
        *,
        kind: str = "batch",
        cost: int = 1,
    ) -> Any:
        """Run ``item`` through ``batch_fn`` with other waiting items of the same ``key``."""
        assert cost >= 1
        loop = asyncio.get_running_loop()
        job = _Job(None, (), loop, loop.create_future(), batch=(batch_fn, *key), item=item)
        job.kind, job.cost = kind, cost
        self._put(job, admit=True)
        return await self._await(job)

    def close(self) -> None:
        """Stop after the running job; jobs still queued are dropped (shutdown)."""
        self._closing = True
        self._q.put(None)
        self._thread.join(timeout=30)

    # --- the thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._closing:
            try:
                first = self._q.get(timeout=0.5)
            except queue.Empty:
                continue
            if first is None:
                return
            jobs = [first]
            if first.batch is not None:
                # Take whatever else is already waiting, up to max_batch jobs in all.
                while len(jobs) < self.max_batch:
                    try:
                        nxt = self._q.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is None:
                        self._q.put(None)
                        break
                    jobs.append(nxt)
            self._take(jobs)
            outcomes: list[tuple[_Job, bool, Any]] = []
            try:
                outcomes = self._run([j for j in jobs if not j.abandoned])
            finally:
                with self._lock:
                    self._busy = False
                    self._unmeasured.difference_update(j.kind for j in jobs)
            # Only now are the books settled (idle, timed): a caller woken earlier could
            # send its next request while this thread still looked busy, and be refused.
            for job, ok, value in outcomes:
                job.loop.call_soon_threadsafe(_resolve, job.future, ok, value)

    def _take(self, jobs: list[_Job]) -> None:
        """Move ``jobs`` from the queue's books to the running batch's."""
        with self._lock:
            expected = 0.0
            for j in jobs:
                self._waiting -= 1
                self._queued_cost[j.kind] -= j.cost
                if j.held is not None:
                    j.held.waiting -= 1
                per = self.times.per_cost(j.kind)
                if not j.abandoned and per is not None:
                    expected += j.cost * per
            self._busy, self._running_s, self._started = True, expected, self.clock()

    def _timed(self, kind: str, cost: int, t0: float) -> None:
        self.observe(kind, cost, self.clock() - t0)

    def _run(self, jobs: list[_Job]) -> list[tuple[_Job, bool, Any]]:
        """Run ``jobs`` and time them; their outcomes (job, ok, value or exception), which
        the caller hands to the awaiting requests once the books are settled."""
        outcomes: list[tuple[_Job, bool, Any]] = []
        groups: dict[tuple[Any, ...], list[_Job]] = {}
        for job in jobs:
            if job.batch is None:
                t0 = self.clock()
                outcomes.append(self._run_one(job))
                self._timed(job.kind, job.cost, t0)
            else:
                groups.setdefault(job.batch, []).append(job)
        for key, group in groups.items():
            self.batches = [*self.batches[-99:], len(group)]
            t0 = self.clock()
            try:
                results = key[0]([j.item for j in group])
                assert len(results) == len(group), "batch function returned a wrong count"
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting request
                outcomes.extend((j, False, exc) for j in group)
                continue
            finally:
                self._timed(group[0].kind, sum(j.cost for j in group), t0)
            outcomes.extend((j, True, r) for j, r in zip(group, results, strict=True))
        return outcomes

    def _run_one(self, job: _Job) -> tuple[_Job, bool, Any]:
        assert job.fn is not None
        try:
            return job, True, job.fn(*job.args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting request
            return job, False, exc
