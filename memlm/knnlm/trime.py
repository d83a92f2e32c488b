"""TRIME memory at inference: local / long-term memory in the softmax, external interpolation.

Pure torch functions, no I/O (Zhong et al. 2022, Eq. 5/6 and App. A Eq. 8-9):

- Eq. 6: P(w | c) ∝ exp(E_w f(c)) + sum over memory entries (c_j, x_j) with x_j = w of
  exp(sim(g(c), g(c_j)) / tau), sim(q, k) = q . k / sqrt(d) (scaled dot product).
- Eq. 8: P_mem(w | c) ∝ sum over retrieved entries with x_j = w of exp(score_j), the
  external (datastore) neighbours only.
- Eq. 9: P(w | c) = (1 - lambda) P_trime(w | c) + lambda P_mem(w | c).

Everything works in log space. The LM side enters as the gold-token logit and the
log-sum-exp of the logits (`lse`), which the encoder caches per token, so scoring never
materialises a (T, V) distribution; `trime_log_probs` builds the full distribution for
the few positions that need suggestions.

Position convention (the encoder's): position i holds the key g(c_i) of the context
ending at token i and the target x_{i+1}. A memory entry j is usable by query i only
when j < i (its target x_{j+1} is then already known).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

NEG_INF = float("-inf")


def scaled_dot_scores(queries: torch.Tensor, keys: torch.Tensor, tau: float = 1.0) -> torch.Tensor:
    """sim(q, k) / tau with sim the scaled dot product q . k / sqrt(d): (T, d), (M, d) -> (T, M)."""
    assert queries.dim() == 2 and keys.dim() == 2 and queries.shape[1] == keys.shape[1]
    assert tau > 0
    return (queries @ keys.T) / (math.sqrt(queries.shape[1]) * tau)


def l2_scores(distances: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Scores of datastore neighbours from their L2 distances, -d / T (DESIGN's kNN-LM form)."""
    assert temperature > 0
    return -distances / temperature


def window_mask(
    query_pos: torch.Tensor, mem_pos: torch.Tensor, lo: torch.Tensor | int
) -> torch.Tensor:
    """Visibility (T, M): entry j is visible to query i when lo[i] <= mem_pos[j] < query_pos[i].

    Local memory: lo = start of the current input window. Long-term memory: lo = window
    start minus the number of earlier tokens (segments x segment length) kept.
    """
    lo_t = torch.as_tensor(lo, device=query_pos.device).expand_as(query_pos)
    mp = mem_pos.view(1, -1)
    return (mp >= lo_t.view(-1, 1)) & (mp < query_pos.view(-1, 1))


def masked_scores(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Scores with invisible entries set to -inf (they then contribute exp(-inf) = 0)."""
    assert scores.shape == visible.shape
    return scores.masked_fill(~visible, NEG_INF)


def _lse(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    # torch.logsumexp returns -inf for all -inf rows (and for empty rows), which is what
    # "no memory" means here.
    if x.shape[dim] == 0:
        shape = list(x.shape)
        del shape[dim]
        return torch.full(shape, NEG_INF, dtype=x.dtype, device=x.device)
    return torch.logsumexp(x, dim=dim)


def _gold_scores(
    mem_scores: torch.Tensor, mem_values: torch.Tensor, gold: torch.Tensor
) -> torch.Tensor:
    """Memory scores kept only where the entry's next token equals the query's gold token."""
    values = mem_values if mem_values.dim() == 2 else mem_values.view(1, -1)
    return mem_scores.masked_fill(values != gold.view(-1, 1), NEG_INF)


def trime_gold_logprob(
    lm_gold_logit: torch.Tensor,
    lm_lse: torch.Tensor,
    mem_scores: torch.Tensor,
    mem_values: torch.Tensor,
    gold: torch.Tensor,
) -> torch.Tensor:
    """Eq. 6: log P(gold | c) with the memory joining the LM softmax.

    lm_gold_logit (T,): E_gold . f(c); lm_lse (T,): log sum_w exp(E_w . f(c));
    mem_scores (T, M): sim / tau, -inf where not visible; mem_values (M,) or (T, M): the
    entries' next tokens; gold (T,). With no visible entry this is the LM log-prob.
    """
    assert mem_scores.dim() == 2 and mem_scores.shape[0] == gold.shape[0]
    num = torch.logaddexp(lm_gold_logit, _lse(_gold_scores(mem_scores, mem_values, gold)))
    den = torch.logaddexp(lm_lse, _lse(mem_scores))
    return num - den


def trime_log_probs(
    lm_logits: torch.Tensor, mem_scores: torch.Tensor, mem_values: torch.Tensor
) -> torch.Tensor:
    """Eq. 6 as a full distribution: (T, V) logits, (T, M) scores -> (T, V) log-probs."""
    t, v = lm_logits.shape
    assert mem_scores.shape[0] == t
    values = mem_values if mem_values.dim() == 2 else mem_values.view(1, -1).expand_as(mem_scores)
    peak = lm_logits.max(dim=1).values  # (T,)
    if mem_scores.shape[1] > 0:
        peak = torch.maximum(peak, mem_scores.max(dim=1).values)
    mass = torch.exp(lm_logits - peak.view(-1, 1))  # (T, V)
    mass = mass.scatter_add(1, values.long(), torch.exp(mem_scores - peak.view(-1, 1)))
    logp = torch.log(mass)
    return logp - torch.logsumexp(logp, dim=1, keepdim=True)


def memory_gold_logprob(
    mem_scores: torch.Tensor, mem_values: torch.Tensor, gold: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 8: log P_mem(gold | c) over the given entries alone, and which rows had any entry.

    Rows without a visible entry get log-prob -inf and has_memory False.
    """
    den = _lse(mem_scores)
    has_memory = torch.isfinite(den)
    num = _lse(_gold_scores(mem_scores, mem_values, gold))
    logp = torch.where(has_memory, num - torch.where(has_memory, den, 0.0), NEG_INF)
    return logp, has_memory


def interpolate(
    log_p_model: torch.Tensor, log_p_mem: torch.Tensor, lam: float, has_memory: torch.Tensor
) -> torch.Tensor:
    """Eq. 9: log((1 - lambda) P_model + lambda P_mem); rows without memory keep P_model."""
    assert 0.0 <= lam <= 1.0
    if lam == 0.0:
        return log_p_model
    if lam == 1.0:
        return torch.where(has_memory, log_p_mem, log_p_model)
    mixed = torch.logaddexp(log_p_model + math.log1p(-lam), log_p_mem + math.log(lam))
    return torch.where(has_memory, mixed, log_p_model)


def document_gold_logprobs(
    keys: torch.Tensor,
    targets: torch.Tensor,
    lm_gold_logit: torch.Tensor,
    lm_lse: torch.Tensor,
    window_start: torch.Tensor,
    long_span: int,
    tau: float,
    *,
    extra_scores: torch.Tensor | None = None,
    extra_values: torch.Tensor | None = None,
    chunk: int = 512,
) -> torch.Tensor:
    """Eq. 6 for every position of one document, with local and long-term memory.

    keys (N, d): g(c_i) for every position of the document (from the windows that scored
    them); targets (N,): x_{i+1}; lm_gold_logit, lm_lse (N,): the LM side; window_start
    (N,): document position where the input window that scored position i starts. Query i
    sees entries j with window_start[i] - long_span <= j < i: long_span = 0 is local memory
    (the continuous cache of the same input), long_span = SEGMENTS * segment length adds
    long-term memory. extra_scores / extra_values (N, K): further entries per query (the
    retrieved external neighbours of App. A Eq. 7), already divided by their temperature.
    """
    n = keys.shape[0]
    assert targets.shape == (n,) and lm_gold_logit.shape == (n,) and lm_lse.shape == (n,)
    assert window_start.shape == (n,) and long_span >= 0
    pos = torch.arange(n, device=keys.device)
    out = torch.empty(n, dtype=lm_lse.dtype, device=keys.device)
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        lo = window_start[a:b] - long_span
        # only entries in [min lo, b) can be visible to this chunk
        first = max(0, int(lo.min().item()))
        scores = scaled_dot_scores(keys[a:b], keys[first:b], tau)
        scores = masked_scores(scores, window_mask(pos[a:b], pos[first:b], lo))
        values: torch.Tensor = targets[first:b].view(1, -1).expand(b - a, -1)
        if extra_scores is not None:
            assert extra_values is not None and extra_scores.shape == extra_values.shape
            scores = torch.cat([scores, extra_scores[a:b].to(scores.dtype)], dim=1)
            values = torch.cat([values, extra_values[a:b].to(values.dtype)], dim=1)
        out[a:b] = trime_gold_logprob(lm_gold_logit[a:b], lm_lse[a:b], scores, values, targets[a:b])
    return out


def window_begins(positions: np.ndarray, windows: Sequence[tuple[int, int, int]]) -> np.ndarray:
    """Begin of the input window that scored each target position.

    ``windows`` is ``WindowConfig.windows(n)``: (begin, end, first_scored) with targets
    first_scored..end-1 scored by that window.
    """
    out = np.full(len(positions), -1, np.int64)
    for begin, end, first in windows:
        out[(positions >= first) & (positions < end)] = begin
    if (out < 0).any():
        raise ValueError("a position is scored by no window")
    return out


def cached_doc_logprobs(
    keys: np.ndarray,
    targets: np.ndarray,
    target_logprob: np.ndarray,
    lse: np.ndarray,
    positions: np.ndarray,
    windows: Sequence[tuple[int, int, int]],
    long_tokens: int,
    taus: Sequence[float],
) -> np.ndarray:
    """Eq. 6 log p(target) of one document's cached encoder outputs, one column per tau.

    The arrays are the encoder's per-target outputs (``TokenOutputs``: position t holds
    the key of the context ids[:t] and the target ids[t]). Local memory of target t: the
    targets p of the same input window with begin < p < t (their key was computed in that
    window or, for p scored by the previous window, in that one); ``long_tokens`` > 0 also
    admits the targets of the ``long_tokens`` positions before the window.
    Returns (n, len(taus)) float64.
    """
    order = np.argsort(positions, kind="stable")
    assert np.array_equal(order, np.arange(len(positions))), "positions must be ascending"
    begin = window_begins(positions, windows)
    lo = torch.from_numpy(begin + 1 - long_tokens)
    pos = torch.from_numpy(positions.astype(np.int64))
    k = torch.from_numpy(np.asarray(keys, np.float32)).double()
    gold = torch.from_numpy(np.asarray(targets, np.int64))
    lse_t = torch.from_numpy(np.asarray(lse, np.float64))
    gold_logit = torch.from_numpy(np.asarray(target_logprob, np.float64)) + lse_t
    out = np.empty((len(positions), len(taus)), np.float64)
    chunk = 512
    for a in range(0, len(positions), chunk):
        b = min(len(positions), a + chunk)
        first = int(np.searchsorted(positions, int(lo[a:b].min()), side="left"))
        raw = scaled_dot_scores(k[a:b], k[first:b])
        vis = window_mask(pos[a:b], pos[first:b], lo[a:b])
        for c, tau in enumerate(taus):
            scores = masked_scores(raw / tau, vis)
            out[a:b, c] = trime_gold_logprob(
                gold_logit[a:b], lse_t[a:b], scores, gold[first:b], gold[a:b]
            ).numpy()
    return out
