"""What the model thread runs (:class:`_Job`) and what an admitted request holds for its
later parts (:class:`Reservation`); the books are touched only under the executor's lock."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from service.executor.model import ModelExecutor

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
    kind: str = "internal"
    cost: int = 0  # 0: an internal job, never refused and never timed
    # Set by the event loop when the awaiting request was cancelled (the client left);
    # the model thread then skips the job. A plain flag: a late read only runs it anyway.
    abandoned: bool = False
    held: _Held | None = None  # the reservation this job is a part of
    extra: dict[str, Any] = field(default_factory=dict)


def _resolve(fut: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if fut.done():  # the client went away and the awaiting task was cancelled
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


@dataclass(eq=False)
class _Held:
    """The books of one reservation (touched only under the executor's lock)."""

    kind: str
    left: int  # cost reserved and not queued yet
    waiting: int = 0  # its parts in the queue now
    ended: bool = False  # closed by its request, or its Reservation was collected


class Reservation:
    """What an admitted request reserved for the parts it queues later (:meth:`call`);
    :meth:`close` gives back what they did not use (a generation that stops early)."""

    def __init__(self, executor: ModelExecutor, held: _Held) -> None:
        self._executor = executor
        self._held = held
        # A request that never closes it (a stream whose client left before it began:
        # its generator never runs) must not hold the budget for ever. The callback only
        # flags the books: the collector may run while this thread holds the lock.
        weakref.finalize(self, _end, held)

    @property
    def left(self) -> int:
        """The cost still reserved."""
        return self._held.left

    async def call(self, fn: Callable[..., T], *args: Any, cost: int) -> T:
        """Queue ``fn(*args)`` as a part of the request, whatever the load (its cost
        comes out of the reservation; more than is left is queued all the same)."""
        return await self._executor._part(self._held, fn, args, cost)

    def close(self) -> None:
        self._executor._release(self._held)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _end(held: _Held) -> None:
    held.ended = True
