"""Consolidation's test: would a stored entry still be stored if it arrived today?

MoNIM stores x_t when log p(x_t | x_<t) < delta under the augmented model over the memory
served then (docs/memory.md, DESIGN "MoNIM policy"). Consolidation asks the same question
of an entry already stored, against today's memory with the entry itself left out: its
key is the query, its value the token, and the neighbours are today's, less its own id.

p(v) = (1 - lambda) p_LM(v) + lambda p_kNN(v). The entry's p_LM is known where the memory
kept it (the harness keeps the LM's log-probability of every stored token); where it is
not (the service's memories store keys and values only) it is taken as 0, a lower bound
on p(v): the test then retires only entries that certainly fail MoNIM's test today (their
neighbours alone give v a probability of at least exp(delta) / lambda), never one that
would still be stored.
"""

from __future__ import annotations

from typing import Final, Literal

import numpy as np

from memlm.knnlm.mixture import KnnParams, knn_logprob

# What a memory budget may retire first (memlm.memory.consolidation), the default, and the
# share of the budget that keeps the newest entries whole: for the service (Settings), the
# harness (EvalConfig, memlm eval) and ConsolidationConfig alike. Spread with no recent
# share measured best (docs/results/slice14d-spread, docs/results/stream57-spread).
Criterion = Literal["usage", "redundancy", "age", "random", "spread"]
DEFAULT_BUDGET_CRITERION: Final = "spread"
DEFAULT_BUDGET_RECENT: Final = 0.0


def leave_one_out(
    own: np.ndarray, ids: np.ndarray, dist: np.ndarray, vals: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The first ``k`` neighbours of each row once the entry's own id is dropped.

    own (n,) entry ids; ids, dist, vals (n, K) with K > k (searched with one extra
    neighbour). Returns (ids, dist, vals) of shape (n, k), padded with (-1, inf, -1).
    """
    assert ids.shape == dist.shape == vals.shape and ids.shape[0] == own.shape[0]
    keep = ids != own[:, None]
    order = np.argsort(~keep, axis=1, kind="stable")[:, :k]  # kept ones first, in order
    out_ids = np.take_along_axis(np.where(keep, ids, -1), order, 1)
    out_d = np.take_along_axis(np.where(keep, dist, np.inf), order, 1)
    out_v = np.take_along_axis(np.where(keep, vals, -1), order, 1)
    return out_ids, out_d, out_v


def todays_logprob(
    values: np.ndarray,
    ids: np.ndarray,
    dist: np.ndarray,
    vals: np.ndarray,
    params: KnnParams,
    lm_logprob: np.ndarray | None = None,
) -> np.ndarray:
    """(n,) log p(value) under the augmented model over the neighbours given (already
    without the entry itself). ``lm_logprob``: (n,) log p_LM(value), NaN or None where
    unknown (then p_LM is taken as 0: a lower bound)."""
    n = values.shape[0]
    knn = knn_logprob(dist, ids, vals, values.reshape(n, 1), params.temperature)[:, 0]
    lm = np.full(n, -np.inf) if lm_logprob is None else np.asarray(lm_logprob, np.float64)
    lm = np.where(np.isnan(lm), -np.inf, lm)
    with np.errstate(divide="ignore"):
        a = np.log1p(-params.lmbda) + lm
        b = np.log(params.lmbda) + knn
    return np.logaddexp(a, b)


def fails_today(logprob_today: np.ndarray, delta: float) -> np.ndarray:
    """(n,) bool: the entry would not be stored today (MoNIM stores when log p < delta)."""
    return np.asarray(logprob_today >= delta)


def retire_in_turn(
    own: np.ndarray,
    values: np.ndarray,
    ids: np.ndarray,
    dist: np.ndarray,
    vals: np.ndarray,
    params: KnnParams,
    delta: float,
    lm_logprob: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Test a window of entries one after the other, each against today's memory less
    itself and less the entries of the window already retired: near-copies of one
    context then retire all but one, not all of them (each would pass the test thanks to
    the others). ``ids, dist, vals``: (n, K) neighbours, K > k (a margin for the ones
    dropped). Returns (fails (n,) bool, log p today (n,)) in the given order."""
    n = own.shape[0]
    fails = np.zeros(n, dtype=bool)
    lp = np.empty(n)
    gone: list[int] = []
    lm = None if lm_logprob is None else np.asarray(lm_logprob, np.float64)
    for i in range(n):
        row_ids = ids[i : i + 1]
        if gone:
            drop = np.isin(row_ids, np.asarray(gone, np.int64))
            row_ids = np.where(drop, own[i], row_ids)  # dropped like the entry itself
        r_ids, r_d, r_v = leave_one_out(
            own[i : i + 1], row_ids, dist[i : i + 1], vals[i : i + 1], params.k
        )
        lp[i] = todays_logprob(
            values[i : i + 1], r_ids, r_d, r_v, params, None if lm is None else lm[i : i + 1]
        )[0]
        if lp[i] >= delta:
            fails[i] = True
            gone.append(int(own[i]))
    return fails, lp
