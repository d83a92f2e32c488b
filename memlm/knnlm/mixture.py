"""kNN-LM: the neighbour distribution and its interpolation with the LM.

p_kNN(y) is proportional to the sum of exp(-d_i / T) over the retrieved neighbours whose
value is y (d_i squared L2, as FAISS returns it), and
p(y) = (1 - lambda) p_LM(y) + lambda p_kNN(y).
Rows without any neighbour (an empty memory) fall back to the plain LM.
TRIME's local / long-term memory (memlm.knnlm.trime) is chosen per request with
:class:`MemoryOptions`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class KnnParams:
    """Retrieval and interpolation settings."""

    k: int = 64  # neighbours per token; MoNIM used 1024, 64 keeps CPU search cheap
    temperature: float = 5.0  # divides squared-L2 distances; SmolLM2 key distances are ~10-60
    lmbda: float = 0.25  # weight of p_kNN; the usual kNN-LM value on in-domain text

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError("k must be >= 1")
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0")
        if not 0.0 <= self.lmbda <= 1.0:
            raise ValueError("lambda must be in [0, 1]")


# tau of the service's local / long-term memory when a request names none: the value
# `memlm eval --local-memory` tuned on dev for SmolLM2-135M on the news slice (docs/trime.md)
DEFAULT_TAU = 2.0


@dataclass(frozen=True)
class MemoryOptions:
    """TRIME memory of one request: local (same input) and long-term (earlier segments)."""

    local: bool = False
    long_segments: int = 0  # earlier windows of the same text; implies local memory
    tau: float = DEFAULT_TAU

    def __post_init__(self) -> None:
        if self.long_segments < 0 or self.tau <= 0:
            raise ValueError("long_segments must be >= 0 and tau > 0")

    @property
    def active(self) -> bool:
        return self.local or self.long_segments > 0


def neighbour_log_weights(
    distances: np.ndarray, ids: np.ndarray, temperature: float | np.ndarray
) -> np.ndarray:
    """Normalised log-weights log softmax(-d/T) over valid neighbours; -inf for padding.

    distances, ids: (n, k); ids == -1 marks padding; temperature: one T, or (n,) one per
    row (the served combination, memlm.calibrator.combined).  Rows with no valid neighbour
    are all -inf.
    """
    t = np.asarray(temperature, np.float64)
    t = t[:, None] if t.ndim == 1 else t
    logits = np.where(ids >= 0, -distances.astype(np.float64) / t, -np.inf)
    m = logits.max(axis=1, keepdims=True)
    safe_m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.log(np.exp(logits - safe_m).sum(axis=1, keepdims=True)) + safe_m
        return np.where(np.isfinite(m), logits - z, -np.inf)


# elements of the (rows, m, k) comparison knn_logprob builds at a time (~16M: about 150 MB
# of temporaries); each row is computed alone, so the blocks change no bit of the result
_MATCH_ELEMENTS = 1 << 24
# Above this many (candidate, neighbour) pairs a token, p_kNN of every candidate comes
# from the neighbours' weights summed per value (a sort, O(k log k) a token) instead of
# comparing every candidate with every neighbour (O(m k)): MoNIM's k + 2 candidates at
# k = 1,024 are a million comparisons a token. At k <= 64 (the service's) the comparison
# stays, and with it every earlier number to the last bit.
_DENSE_MATCH = 1 << 13


def _summed_by_value(values: np.ndarray, w: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """(n, m) sum of the weights ``w`` (n, k) of the neighbours whose value is
    ``tokens[i, j]``: each row's weights summed per distinct value, then looked up."""
    n, k = values.shape
    span = int(max(values.max(initial=0), tokens.max(initial=0))) + 2  # values >= -1
    keys = (np.arange(n, dtype=np.int64)[:, None] * span + (values + 1)).reshape(-1)
    order = np.argsort(keys, kind="stable")
    sorted_keys, sorted_w = keys[order], w.reshape(-1)[order]
    first = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    uniq, sums = sorted_keys[first], np.add.reduceat(sorted_w, first)
    want = np.arange(n, dtype=np.int64)[:, None] * span + (tokens.astype(np.int64) + 1)
    at = np.minimum(np.searchsorted(uniq, want), len(uniq) - 1)
    return np.where(uniq[at] == want, sums[at], 0.0).astype(w.dtype)


def knn_logprob(
    distances: np.ndarray,
    ids: np.ndarray,
    values: np.ndarray,
    tokens: np.ndarray,
    temperature: float | np.ndarray,
) -> np.ndarray:
    """log p_kNN(tokens[i, j]) for row i; distances/ids/values (n, k), tokens (n, m);
    temperature: one T or (n,) one per row."""
    lw = neighbour_log_weights(distances, ids, temperature)  # (n, k)
    w = np.exp(lw)  # zero for padding
    n, m = tokens.shape
    if m * w.shape[1] > _DENSE_MATCH and n:  # many candidates of many neighbours
        with np.errstate(divide="ignore"):
            return np.log(_summed_by_value(values, w, tokens))
    # rows in blocks: the (rows, m, k) comparison is n x (k + 2) x k for MoNIM's
    # candidates, 6.7 GB for one 800-token document at k = 1,024 in one piece
    step = max(1, _MATCH_ELEMENTS // max(1, m * w.shape[1]))
    p = np.empty((n, m), w.dtype)
    for s in range(0, n, step):
        match = values[s : s + step, None, :] == tokens[s : s + step, :, None]  # (rows, m, k)
        p[s : s + step] = (match * w[s : s + step, None, :]).sum(axis=2)
    with np.errstate(divide="ignore"):
        return np.log(p)


def has_neighbours(ids: np.ndarray) -> np.ndarray:
    """(n,) bool: the row has at least one valid neighbour."""
    return np.asarray((ids >= 0).any(axis=1))


def interpolate(
    lm_logprob: np.ndarray, knn_lp: np.ndarray, lmbda: float | np.ndarray, valid: np.ndarray
) -> np.ndarray:
    """log((1 - l) p_LM + l p_kNN), elementwise; rows with valid == False keep the LM.

    lm_logprob, knn_lp: (n, ...) ; lmbda scalar or (n,) ; valid (n,).
    """
    lam = np.asarray(lmbda, dtype=np.float64)
    shape = (-1,) + (1,) * (lm_logprob.ndim - 1)
    if lam.ndim == 1:
        lam = lam.reshape(shape)
    v = valid.reshape(shape)
    lam = np.where(v, lam, 0.0)
    with np.errstate(divide="ignore"):
        a = np.log1p(-lam) + lm_logprob
        b = np.log(lam) + knn_lp
    return np.logaddexp(a, b)


@dataclass
class AugmentedScores:
    """Augmented-model quantities the policies need, per token."""

    target_logprob: np.ndarray  # (n,) log p(x_t) under the augmented model
    max_logprob: np.ndarray  # (n,) max_y log p(y) under the augmented model


def augmented_scores(
    target_lm_logprob: np.ndarray,
    top_lm_logprob: np.ndarray,
    top_id: np.ndarray,
    targets: np.ndarray,
    distances: np.ndarray,
    ids: np.ndarray,
    values: np.ndarray,
    value_lm_logprob: np.ndarray,
    params: KnnParams,
    *,
    lmbda: np.ndarray | None = None,
    temperature: np.ndarray | None = None,
) -> AugmentedScores:
    """Score the gold token and find the augmented model's best token.

    The arg max of (1 - l) p_LM + l p_kNN is either the LM's top-1 or one of the neighbour
    values, so those k + 1 candidates give the exact maximum.  ``value_lm_logprob`` (n, k)
    holds log p_LM of each neighbour value (Encoder.logprobs_for).  ``lmbda``: (n,) lambda
    per token instead of ``params.lmbda`` (a calibrator's; 0 keeps the LM); ``temperature``:
    (n,) T per token instead of ``params.temperature`` (the served combination's).
    """
    valid = has_neighbours(ids)
    cand = np.concatenate([targets[:, None], top_id[:, None], values], axis=1)  # (n, k+2)
    cand_lm = np.concatenate(
        [target_lm_logprob[:, None], top_lm_logprob[:, None], value_lm_logprob], axis=1
    )
    t = params.temperature if temperature is None else temperature
    knn = knn_logprob(distances, ids, values, cand, t)
    aug = interpolate(cand_lm, knn, params.lmbda if lmbda is None else lmbda, valid)
    # padding neighbours (id -1) are not real candidates
    pad = np.concatenate([np.zeros((len(ids), 2), bool), ids < 0], axis=1)
    aug_c = np.where(pad, -np.inf, aug)
    return AugmentedScores(target_logprob=aug[:, 0], max_logprob=aug_c.max(axis=1))
