"""Reuse what the last token found: RetoMaton's pointers (Alon et al. 2022) over any memory.

While a document is scored token by token, the entries that followed the previous token's
neighbours in their own documents are candidates for this token: where the memory holds a
text that goes on the way this one does, they are this token's neighbours too. Following
them costs the gather of at most k keys, where a search scans an index. The search runs
only where they fail.

"Fail" is measured, not assumed: a token keeps the pointers' answer when at least
``min_hits`` successors lie within ``slack`` times the running median of the
``min_hits``-th distance that the last full searches found, i.e. when the successors alone
bring as many neighbours as close as a search usually does. Until searches have set that
threshold, every token searches. As in RetoMaton, only the neighbours whose value is the
token that came are followed (the others predicted another token: their text went
elsewhere).

What this costs in recall and perplexity, and what it saves, is measured on the same tokens
against the full search by ``benchmarks/bench_search_depth.py`` (docs/memory.md, "Reuse what
the last token found").
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

# (queries (n, d) float32, k) -> (distances, ids, values), each (n, k), ascending, padded
SearchFn = Callable[
    [npt.NDArray[np.float32], int],
    tuple[npt.NDArray[np.float32], npt.NDArray[np.int64], npt.NDArray[np.int32]],
]
# (queries (n, d), ids (n, m)) -> the successors of ids, as above (n, m)
FollowFn = Callable[
    [npt.NDArray[np.float32], npt.NDArray[np.int64]],
    tuple[npt.NDArray[np.float32], npt.NDArray[np.int64], npt.NDArray[np.int32]],
]


@dataclass(frozen=True)
class PointerConfig:
    """When the previous token's successors stand in for a search."""

    # successors within the threshold a token needs to skip its search: with fewer the
    # pointers' p_kNN rests on too few neighbours (benchmarks/bench_search_depth.py sweeps it)
    min_hits: int = 8
    # the threshold: slack x the running median of the full searches' min_hits-th distance
    slack: float = 1.0
    # full searches that median is taken over (a few documents' worth)
    window: int = 512
    # queries searched together on a miss (the next ones speculatively, used only where
    # their pointers fail too): a batch of 8 searches a flat index through BLAS
    block: int = 1

    def __post_init__(self) -> None:
        if self.min_hits < 1 or self.window < 1 or self.block < 1 or self.slack <= 0:
            raise ValueError("min_hits, window and block must be >= 1 and slack > 0")


@dataclass
class PointerStats:
    tokens: int = 0  # tokens answered
    followed: int = 0  # answered by the pointers, no search
    searched: int = 0  # queries sent to the index (speculative ones of a block included)

    @property
    def saved(self) -> float:
        """The share of searches saved against one search per token."""
        return 1.0 - self.searched / self.tokens if self.tokens else 0.0


@dataclass
class PointerSearch:
    """One caller's pointer state: the threshold learned from its full searches and its
    counters; ``document`` answers a document's tokens in order. Documents may be answered
    from several threads at once (the engine's /score beside its ingest worker)."""

    search: SearchFn
    follow: FollowFn
    k: int
    cfg: PointerConfig = field(default_factory=PointerConfig)
    stats: PointerStats = field(default_factory=PointerStats)

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        self._recent: deque[float] = deque(maxlen=self.cfg.window)
        self._lock = threading.Lock()  # the threshold's window and the counters

    @property
    def threshold(self) -> float | None:
        """The distance ``min_hits`` successors must beat (None: no full search yet)."""
        with self._lock:
            if not self._recent:
                return None
            recent = np.fromiter(self._recent, np.float64, len(self._recent))
        return self.cfg.slack * float(np.median(recent))

    def _learn(self, dist: npt.NDArray[np.float32]) -> None:
        col = dist[:, min(self.cfg.min_hits, dist.shape[1]) - 1]
        with self._lock:
            self._recent.extend(float(x) for x in col[np.isfinite(col)])

    def document(
        self, keys: npt.ArrayLike, targets: npt.ArrayLike
    ) -> tuple[
        npt.NDArray[np.float32], npt.NDArray[np.int64], npt.NDArray[np.int32], npt.NDArray[np.bool_]
    ]:
        """The k neighbours of each token of one document, in order: (distances, ids,
        values) (n, k) as a search returns them, and ``followed`` (n,): True where the
        pointers answered (their rows may hold fewer than k neighbours, padded).

        keys (n, d): the tokens' queries; targets (n,): the token that came after each.
        """
        q = np.ascontiguousarray(keys, dtype=np.float32)
        gold = np.asarray(targets, np.int64)
        n, k = len(q), self.k
        assert gold.shape == (n,), (gold.shape, n)
        dist = np.full((n, k), np.inf, np.float32)
        ids = np.full((n, k), -1, np.int64)
        vals = np.full((n, k), -1, np.int32)
        followed = np.zeros(n, bool)
        ahead = 0  # rows [t, ahead) already hold a (speculative) search
        for t in range(n):
            theta = self.threshold
            if t and theta is not None:
                src = ids[t - 1][(vals[t - 1] == gold[t - 1]) & (ids[t - 1] >= 0)]
                if len(src) >= self.cfg.min_hits:
                    d, i, v = self.follow(q[t : t + 1], src[None, :])
                    if int((d[0] <= theta).sum()) >= self.cfg.min_hits:
                        w = min(k, d.shape[1])
                        dist[t], ids[t], vals[t] = np.inf, -1, -1
                        dist[t, :w], ids[t, :w], vals[t, :w] = d[0, :w], i[0, :w], v[0, :w]
                        followed[t] = True
                        continue
            if t >= ahead:
                stop = min(n, t + self.cfg.block)
                d, i, v = self.search(q[t:stop], k)
                dist[t:stop], ids[t:stop], vals[t:stop] = d, i, v
                with self._lock:
                    self.stats.searched += stop - t
                self._learn(d)
                ahead = stop
        with self._lock:
            self.stats.tokens += n
            self.stats.followed += int(followed.sum())
        return dist, ids, vals, followed
