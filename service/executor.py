"""The model executor: one thread runs every LM forward and search, fed by a bounded queue.

The event loop only enqueues and awaits. A full queue raises :class:`Overloaded` (429
with Retry-After) instead of piling requests up. Jobs that share a ``batch`` key and
wait together are handed to their batch function in one call (micro-batching).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from service.errors import Overloaded

log = logging.getLogger(__name__)

T = TypeVar("T")

BatchFn = Callable[[Sequence[Any]], Sequence[Any]]


@dataclass
class _Job:
    fn: Callable[..., Any] | None
    args: tuple[Any, ...]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    batch: tuple[Any, ...] | None = None  # (batch function, key...) of batchable jobs
    item: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


def _resolve(fut: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if fut.done():  # the client went away and the awaiting task was cancelled
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


class ModelExecutor:
    """A single worker thread behind a bounded queue."""

    def __init__(self, *, queue_size: int, max_batch: int, retry_after: int) -> None:
        self._q: queue.Queue[_Job | None] = queue.Queue(maxsize=queue_size)
        self.max_batch = max_batch
        self.retry_after = retry_after
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="memlm-model", daemon=True)
        self._thread.start()
        self.batches: list[int] = []  # sizes of the last batches run (for tests and logs)

    def depth(self) -> int:
        return self._q.qsize()

    def _put(self, job: _Job, wait: bool) -> None:
        try:
            self._q.put(job, block=wait, timeout=None)
        except queue.Full:
            raise Overloaded(
                "the server is busy; retry shortly", retry_after=self.retry_after
            ) from None

    async def call(self, fn: Callable[..., T], *args: Any, wait: bool = False) -> T:
        """Run ``fn(*args)`` on the model thread; ``wait`` blocks for room (internal jobs)."""
        loop = asyncio.get_running_loop()
        job = _Job(fn, args, loop, loop.create_future())
        if wait:
            await asyncio.to_thread(self._put, job, True)
        else:
            self._put(job, False)
        result: T = await job.future
        return result

    async def batched(self, batch_fn: BatchFn, key: tuple[Any, ...], item: Any) -> Any:
        """Run ``item`` through ``batch_fn`` with other waiting items of the same ``key``."""
        loop = asyncio.get_running_loop()
        job = _Job(None, (), loop, loop.create_future(), batch=(batch_fn, *key), item=item)
        self._put(job, False)
        return await job.future

    def close(self) -> None:
        """Stop after the running job; jobs still queued are dropped (shutdown)."""
        self._closing = True
        with contextlib.suppress(queue.Full):
            self._q.put_nowait(None)
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
            self._run(jobs)

    def _run(self, jobs: list[_Job]) -> None:
        groups: dict[tuple[Any, ...], list[_Job]] = {}
        for job in jobs:
            if job.batch is None:
                self._run_one(job)
            else:
                groups.setdefault(job.batch, []).append(job)
        for key, group in groups.items():
            self.batches = [*self.batches[-99:], len(group)]
            try:
                results = key[0]([j.item for j in group])
                assert len(results) == len(group), "batch function returned a wrong count"
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting request
                for j in group:
                    j.loop.call_soon_threadsafe(_resolve, j.future, False, exc)
                continue
            for j, r in zip(group, results, strict=True):
                j.loop.call_soon_threadsafe(_resolve, j.future, True, r)

    def _run_one(self, job: _Job) -> None:
        assert job.fn is not None
        try:
            value = job.fn(*job.args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting request
            job.loop.call_soon_threadsafe(_resolve, job.future, False, exc)
            return
        job.loop.call_soon_threadsafe(_resolve, job.future, True, value)
