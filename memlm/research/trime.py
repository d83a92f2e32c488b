"""The TRIME training objective with in-batch memories (Zhong et al. 2022, Eq. 5, §4).

A batch holds B segments of L tokens, flattened to N = B * L positions. Every position
i has an LM output f(c_i) (through the logits), a memory key g(c_i) (the input of the
last MLP, memlm.encoder.keys), a target x_{i+1}, a document and a position in that document (a
training row may end one document and start the next). The training memory of position
i is a set of other positions j of the same batch, given by a boolean (N, N) visibility
matrix:

- ``local`` (TrimeLM): earlier positions of the same segment and document (§4.1);
- ``long`` (TrimeLM_long): every earlier position of the same document in the batch, in
  its own segment or in the earlier segments batched with it (§4.2);
- ``ext`` (TrimeLM_ext): every position of the other segments of the batch, plus the
  local memory unless it is dropped for this batch (probability p = 0.9, §4.3).

Eq. 5: P(w | c) ∝ exp(E_w f(c)) + sum_{j visible, x_j = w} exp(g(c) . g(c_j) / sqrt(d)).
The loss is -log P(x_{i+1} | c_i). Keys are not detached, so the gradient reaches the
memory representations of the other positions too. With no visible entry the loss is
exactly the cross-entropy of the LM.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn.functional as F

MemoryKind = Literal["local", "long", "ext"]
NEG_INF = float("-inf")


def memory_mask(
    doc: torch.Tensor,
    pos: torch.Tensor,
    kind: MemoryKind,
    drop_local: bool = False,
) -> torch.Tensor:
    """Visibility (N, N), N = B * L: True where position i may use position j.

    doc (B, L): document of every position (-1 on padding, never visible through a
    document); pos (B, L): position within the document. Positions are row-major:
    i = b * L + t. ``local`` and ``long`` never cross documents; ``ext`` crosses them on
    purpose (the other segments stand in for retrieved neighbours).
    """
    assert doc.dim() == 2 and pos.shape == doc.shape
    b, seg_len = doc.shape
    n = b * seg_len
    d, p = doc.reshape(n), pos.reshape(n)  # (N,)
    row = torch.arange(n, device=doc.device) // seg_len  # (N,)
    same_row = row.view(-1, 1) == row.view(1, -1)  # (N, N)
    earlier_same_doc = (d.view(-1, 1) == d.view(1, -1)) & (d.view(1, -1) >= 0)
    earlier_same_doc &= p.view(1, -1) < p.view(-1, 1)
    local = same_row & earlier_same_doc
    if kind == "local":
        return local
    if kind == "long":
        return earlier_same_doc
    if kind == "ext":
        other = ~same_row
        return other if drop_local else other | local
    raise ValueError(f"unknown memory kind {kind!r}")


class LseAndGold(torch.autograd.Function):
    """(N, V) logits, (N,) targets -> log-sum-exp (N,) and gold logit (N,), in few passes.

    Same values and gradients as ``torch.logsumexp`` and ``gather``; written out because
    those two make several passes over the (N, V) logits and their gradients (0.9 s
    against 0.5 s for the vanilla cross-entropy at N = 1,024, V = 49,152, one thread).
    The backward is one pass: softmax * g_lse, plus g_gold at the gold entries.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor) -> Any:
        logp = F.log_softmax(logits, dim=1)  # (N, V)
        gold = logits.gather(1, targets.view(-1, 1)).squeeze(1)  # (N,)
        lse = gold - logp.gather(1, targets.view(-1, 1)).squeeze(1)
        ctx.save_for_backward(logp, targets)
        return lse, gold

    @staticmethod
    def backward(ctx: Any, g_lse: torch.Tensor, g_gold: torch.Tensor) -> Any:
        logp, targets = ctx.saved_tensors
        grad = torch.exp(logp).mul_(g_lse.view(-1, 1))  # (N, V) softmax * g_lse
        grad.scatter_add_(1, targets.view(-1, 1), g_gold.view(-1, 1))
        return grad, None


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
    lm_lse, lm_gold = LseAndGold.apply(logits, safe_t)  # (N,), (N,)
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
