"""Features of one token for the calibrator and the gate (MoNIM App. A.3).

Three categories: the LM's distribution (``conf``, ``entropy``, optionally the ``query``
key), lexical statistics of the stream so far (``log_freq``, ``log_succ``) and the
density of the memory around the query (``knn_dist``, ``knn_distinct``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from memlm.knnlm import KnnParams, knn_logprob

TOP_N = 10  # neighbours described by the density features (App. A.3: i = 1..10)
GROUPS: dict[str, tuple[str, ...]] = {
    "distribution": ("conf", "entropy", "query"),
    "lexical": ("log_freq", "log_succ"),
    "density": ("knn_dist", "knn_distinct"),
}
PRE_SEARCH_GROUPS = ("distribution", "lexical")  # what the gate may use
# The query key is optional (App. A.3 lists it): the evaluation harness does not keep
# the held-out keys, and 576 more inputs learn little from a few thousand tokens.
DEFAULT_FEATURES = ("conf", "entropy", "log_freq", "log_succ", "knn_dist", "knn_distinct")
GATE_FEATURES = ("conf", "entropy", "log_freq", "log_succ")


def features_of_groups(groups: Sequence[str], *, query: bool = False) -> tuple[str, ...]:
    """The feature names of the given groups (the query key only when asked for)."""
    names = [f for g in groups for f in GROUPS[g] if f != "query" or query]
    return tuple(names)


def density_features(distances: np.ndarray, values: np.ndarray, n: int = TOP_N) -> np.ndarray:
    """(m, 2n) float32: L2 distance to the top-i neighbour, log #distinct values in top-i.

    distances: (m, k) squared L2, ascending; values: (m, k) int, -1 for padding.  Missing
    neighbours repeat the last valid distance (0 when the row has none) and add no value.
    """
    assert distances.shape == values.shape and distances.ndim == 2
    m, k = values.shape
    d = np.zeros((m, n), np.float64)
    v = np.full((m, n), -1, np.int64)
    c = min(k, n)
    d[:, :c] = distances[:, :c]
    v[:, :c] = values[:, :c]
    valid = v >= 0
    d = np.where(valid, np.sqrt(np.maximum(np.where(valid, d, 0.0), 0.0)), np.nan)
    # carry the last valid distance forward into the padding
    for i in range(1, n):
        d[:, i] = np.where(np.isnan(d[:, i]), d[:, i - 1], d[:, i])
    d = np.nan_to_num(d, nan=0.0)
    # a value counts at rank i if it is valid and differs from every value before it
    new = valid.copy()
    for i in range(1, n):
        seen_before = (v[:, :i] == v[:, i : i + 1]).any(axis=1)
        new[:, i] &= ~seen_before
    counts = np.cumsum(new, axis=1)
    distinct = np.log(np.maximum(counts, 1))
    return np.concatenate([d, distinct], axis=1).astype(np.float32)


def token_features(
    top_logprob: np.ndarray,
    entropy: np.ndarray,
    lexical: np.ndarray,
    distances: np.ndarray | None = None,
    values: np.ndarray | None = None,
    query: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Every feature of m tokens as {name: (m, width) float32}.

    top_logprob, entropy: (m,) from the encoder; lexical: (m, 2) from
    ``LexicalStats.features``; distances, values: (m, k) search results (None before the
    search); query: (m, d) keys, optional.
    """
    m = len(top_logprob)
    assert entropy.shape == (m,) and lexical.shape == (m, 2)
    out = {
        "conf": np.exp(top_logprob.astype(np.float64)).astype(np.float32)[:, None],
        "entropy": entropy.astype(np.float32)[:, None],
        "log_freq": lexical[:, :1].astype(np.float32),
        "log_succ": lexical[:, 1:2].astype(np.float32),
    }
    if distances is not None and values is not None:
        dens = density_features(distances, values)
        out["knn_dist"], out["knn_distinct"] = dens[:, :TOP_N], dens[:, TOP_N:]
    if query is not None:
        out["query"] = np.asarray(query, np.float32)
    return out


def split_features(split: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Features of the held-out tokens kept by the evaluation harness (EvalTokens.arrays)."""
    return token_features(
        split["top_logprob"],
        split["entropy"],
        split["lexical"],
        split["distances"],
        split["values"],
    )


def gold_knn_logprob(split: dict[str, np.ndarray], params: KnnParams) -> np.ndarray:
    """(m,) log p_kNN(gold) with the first params.k neighbours at params.temperature."""
    k = min(params.k, split["values"].shape[1])
    vals = split["values"][:, :k]
    ids = np.where(vals >= 0, 0, -1)
    return knn_logprob(
        split["distances"][:, :k], ids, vals, split["gold"][:, None], params.temperature
    )[:, 0]
