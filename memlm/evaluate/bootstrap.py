"""Confidence intervals for perplexities: a bootstrap over test documents.

Tokens of one document are not independent, so resampling draws whole documents: a
resample's perplexity is exp(-sum of its documents' log-probabilities / their tokens).
The paired comparison draws the same documents for both systems, so the share of
resamples in which one wins says how often the difference survives the choice of
documents.
"""

from __future__ import annotations

import math

import numpy as np

RESAMPLES = 1000
# Perplexities closer than this (relative) are a tie, not a win: two encodes of the same
# text that batch other documents with it differ by float rounding (~1e-7), which must not
# read as one system beating its own copy; real differences between systems are >= 1e-4.
TIE_RTOL = 1e-6


def doc_sums(logprobs: np.ndarray, doc_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per document (in order of first appearance of its key): sum of log-probs, tokens."""
    assert logprobs.shape == doc_keys.shape, (logprobs.shape, doc_keys.shape)
    _, first, inv = np.unique(doc_keys, return_index=True, return_inverse=True)
    order = np.argsort(first)  # unique() sorts keys; keep first-appearance order
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    idx = rank[inv]
    sums = np.bincount(idx, weights=logprobs.astype(np.float64), minlength=len(order))
    counts = np.bincount(idx, minlength=len(order)).astype(np.float64)
    return sums, counts


def _draws(n_docs: int, resamples: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_docs, size=(resamples, n_docs))


def resampled_ppl(
    logprobs: np.ndarray, doc_keys: np.ndarray, *, resamples: int = RESAMPLES, seed: int = 0
) -> np.ndarray:
    """(resamples,) perplexity of each document resample."""
    sums, counts = doc_sums(logprobs, doc_keys)
    return resampled_ppl_of_sums(sums, counts, resamples=resamples, seed=seed)


def resampled_ppl_of_sums(
    sums: np.ndarray, counts: np.ndarray, *, resamples: int = RESAMPLES, seed: int = 0
) -> np.ndarray:
    """As ``resampled_ppl``, from each document's log-prob sum and token count: the same
    seed draws the same documents whatever the system, which is what pairs them."""
    if not len(sums):
        return np.full(resamples, math.nan)
    idx = _draws(len(sums), resamples, seed)
    return np.exp(-sums[idx].sum(1) / counts[idx].sum(1))


def ci(
    logprobs: np.ndarray,
    doc_keys: np.ndarray,
    *,
    resamples: int = RESAMPLES,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float]:
    """Percentile bootstrap interval of the perplexity over documents."""
    r = resampled_ppl(logprobs, doc_keys, resamples=resamples, seed=seed)
    a = (1 - level) / 2
    return float(np.quantile(r, a)), float(np.quantile(r, 1 - a))


def win_share(
    a: np.ndarray,
    b: np.ndarray,
    doc_keys: np.ndarray,
    *,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> float:
    """Share of paired document resamples in which ``a`` has the lower perplexity (ties,
    within ``TIE_RTOL``, are not wins)."""
    ra = resampled_ppl(a, doc_keys, resamples=resamples, seed=seed)
    rb = resampled_ppl(b, doc_keys, resamples=resamples, seed=seed)  # same draws
    return wins(ra, rb)


def wins(ra: np.ndarray, rb: np.ndarray) -> float:
    """Share of paired resamples in which ``ra`` is lower than ``rb`` beyond a tie."""
    return float(np.mean(ra < rb * (1 - TIE_RTOL)))
