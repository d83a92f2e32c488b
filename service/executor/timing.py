"""How long the model thread takes per unit of cost, by kind of job (admission's clock)."""

from __future__ import annotations

# The kind under which whole requests are timed (seconds per request, ``request()``).
REQUEST = "request"

# Weight of the newest timing: the estimate follows a change of load (another process
# taking the cores) within about five batches, and one slow outlier moves it by 20%.
ALPHA = 0.2


class ServiceTimes:
    """Seconds per unit of cost of each kind of job, exponentially weighted.

    A ratio of weighted sums (seconds / cost), so a large job counts for its size.
    Not locked itself: the executor calls it under its lock.
    """

    def __init__(self, alpha: float = ALPHA) -> None:
        assert 0 < alpha <= 1
        self.alpha = alpha
        self._seconds: dict[str, float] = {}
        self._cost: dict[str, float] = {}

    def observe(self, kind: str, cost: int, seconds: float) -> None:
        if cost <= 0:
            return
        a = self.alpha
        if kind not in self._cost:
            self._seconds[kind], self._cost[kind] = seconds, float(cost)
        else:
            self._seconds[kind] = (1 - a) * self._seconds[kind] + a * seconds
            self._cost[kind] = (1 - a) * self._cost[kind] + a * cost

    def per_cost(self, kind: str) -> float | None:
        """Seconds per unit of cost, None before the first timing of this kind."""
        if kind not in self._cost:
            return None
        return self._seconds[kind] / self._cost[kind]
