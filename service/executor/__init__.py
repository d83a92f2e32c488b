"""The model executor: one thread runs every LM forward and search, fed by a queue, with
admission by expected wait (the whole design: :mod:`service.executor.model`).

- :mod:`~service.executor.model`: :class:`ModelExecutor` (admission, the queue, the
  model thread, micro-batching);
- :mod:`~service.executor.jobs`: a queued job and a request's :class:`Reservation`;
- :mod:`~service.executor.timing`: :class:`ServiceTimes`, seconds per unit of cost.
"""

from service.executor.jobs import Reservation
from service.executor.model import ModelExecutor
from service.executor.timing import REQUEST, ServiceTimes

__all__ = ["REQUEST", "ModelExecutor", "Reservation", "ServiceTimes"]
