"""The TRIME training objective with in-batch memories (Zhong et al. 2022, Eq. 5, §4).

A batch holds B segments of L tokens, flattened to N = B * L positions. Every position
i has an LM output f(c_i) (through the logits), a memory key g(c_i) (the input of the
last MLP, DESIGN.md) and a target x_{i+1}. The training memory of position i is a set of
other positions j of the same batch, given by a boolean (N, N) visibility matrix:

- ``local`` (TrimeLM): earlier positions of the same segment (§4.1);
- ``long`` (TrimeLM_long): earlier positions of the same segment and every position of
  earlier segments of the same document in the batch (§4.2);
- ``ext`` (TrimeLM_ext): every position of the other segments of the batch, plus the
  local memory unless it is dropped for this batch (probability p = 0.9, §4.3).

Eq. 5: P(w | c) ∝ exp(E_w f(c)) + sum_{j visible, x_j = w} exp(g(c) . g(c_j) / sqrt(d)).
The loss is -log P(x_{i+1} | c_i). Keys are not detached, so the gradient reaches the
memory representations of the other positions too. With no visible entry the loss is
exactly the cross-entropy of the LM.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

MemoryKind = Literal["local", "long", "ext"]
NEG_INF = float("-inf")


def memory_mask(
    seg_doc: torch.Tensor,
    seg_order: torch.Tensor,
    seg_len: int,
    kind: MemoryKind,
    drop_local: bool = False,
) -> torch.Tensor:
    """Visibility (N, N), N = B * seg_len: True where position i may use position j.

    seg_doc (B,): document of each segment row; seg_order (B,): index of the segment in
    its document (only ``long`` uses it). Positions are row-major: i = b * seg_len + t.
    """
    b = seg_doc.shape[0]
    assert seg_order.shape == (b,) and seg_len >= 1
    n = b * seg_len
    row = torch.arange(n, device=seg_doc.device) // seg_len  # (N,)
    tok = torch.arange(n, device=seg_doc.device) % seg_len  # (N,)
    same_row = row.view(-1, 1) == row.view(1, -1)  # (N, N)
    local = same_row & (tok.view(1, -1) < tok.view(-1, 1))
    if kind == "local":
        return local
    if kind == "long":
        doc, order = seg_doc[row], seg_order[row]
        earlier = (doc.view(-1, 1) == doc.view(1, -1)) & (order.view(1, -1) < order.view(-1, 1))
        return local | earlier
    if kind == "ext":
        other = ~same_row
        return other if drop_local else other | local
    raise ValueError(f"unknown memory kind {kind!r}")


def trime_token_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor,
    valid: torch.Tensor | None = None,
    tau: float = 1.0,
) -> torch.Tensor:
    """Per-position TRIME loss -log P(target | c) (Eq. 5), 0 on invalid positions.

    logits (N, V), targets (N,), keys (N, d) (not detached), visible (N, N), valid (N,):
    real targets; padding positions are neither scored nor used as memory entries.
    """
    n, _ = logits.shape
    assert targets.shape == (n,) and keys.shape[0] == n and visible.shape == (n, n)
    if valid is None:
        valid = torch.ones(n, dtype=torch.bool, device=logits.device)
    safe_t = torch.where(valid, targets, 0)
    lm_lse = torch.logsumexp(logits, dim=1)  # (N,)
    lm_gold = logits.gather(1, safe_t.view(-1, 1)).squeeze(1)  # (N,)
    sim = (keys @ keys.T) / (math.sqrt(keys.shape[1]) * tau)  # (N, N) scaled dot product
    vis = visible & valid.view(1, -1)
    mem = sim.masked_fill(~vis, NEG_INF)
    mem_gold = mem.masked_fill(safe_t.view(1, -1) != safe_t.view(-1, 1), NEG_INF)
    num = torch.logaddexp(lm_gold, torch.logsumexp(mem_gold, dim=1))
    den = torch.logaddexp(lm_lse, torch.logsumexp(mem, dim=1))
    return torch.where(valid, den - num, 0.0)


def lm_token_loss(
    logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-position vanilla LM loss (Eq. 1), 0 on invalid positions."""
    if valid is None:
        valid = torch.ones_like(targets, dtype=torch.bool)
    loss = F.cross_entropy(logits, torch.where(valid, targets, 0), reduction="none")
    return torch.where(valid, loss, 0.0)
