"""Evaluating a trained model: per-token outputs of segments and TRIME-memory log-probs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from memlm.research.data import Segments
from memlm.research.transformer_train.model import forward_with_keys


@dataclass
class SegmentOutputs:
    """Per position of an evaluated corpus, documents in order."""

    keys: torch.Tensor  # (N, d)
    targets: torch.Tensor  # (N,)
    gold_logit: torch.Tensor  # (N,)
    lse: torch.Tensor  # (N,)
    doc: np.ndarray  # (N,) document index
    pos: np.ndarray  # (N,) position of the input within its document
    seg_start: np.ndarray  # (N,) document position where the position's segment starts


@torch.inference_mode()
def encode_segments(model: nn.Module, segs: Segments, batch: int = 16) -> SegmentOutputs:
    """Run the model over non-overlapping segments; keep what the memory needs per token."""
    model.eval()
    keys, gold, lse, tgt = [], [], [], []
    for a in range(0, len(segs), batch):
        x = torch.from_numpy(segs.x[a : a + batch])
        y = torch.from_numpy(segs.y[a : a + batch])
        logits, k = forward_with_keys(model, x)
        v = torch.from_numpy(segs.valid[a : a + batch])
        keys.append(k[v])
        gold.append(logits.gather(2, y.unsqueeze(-1)).squeeze(-1)[v])
        lse.append(torch.logsumexp(logits, dim=-1)[v])
        tgt.append(y[v])
    valid = segs.valid
    # a position's segment starts where its document's run in the row starts
    t = np.arange(segs.seg_len)[None, :]
    run_start = valid & ((t == 0) | (segs.doc != np.roll(segs.doc, 1, axis=1)))
    first = np.maximum.accumulate(np.where(run_start, t, 0), axis=1)
    seg_start = np.take_along_axis(segs.pos, first, axis=1)[valid]
    doc, pos = segs.doc[valid], segs.pos[valid]
    return SegmentOutputs(
        keys=torch.cat(keys),
        targets=torch.cat(tgt),
        gold_logit=torch.cat(gold),
        lse=torch.cat(lse),
        doc=doc,
        pos=pos,
        seg_start=seg_start,
    )


def memory_logprobs(
    out: SegmentOutputs,
    long_segments: int | None,
    tau: float,
    seg_len: int,
    extra_scores: torch.Tensor | None = None,
    extra_values: torch.Tensor | None = None,
) -> torch.Tensor:
    """log P(target) per position with TRIME memory (Eq. 6), document by document.

    long_segments None: no local/long memory (only ``extra`` entries, if any); 0: local
    memory (earlier tokens of the same segment); S > 0: plus the S previous segments of
    the same document. ``extra_*`` (N, K): retrieved external entries joining Eq. 6.
    """
    from memlm.knnlm.trime import document_gold_logprobs, trime_gold_logprob

    if long_segments is None:
        k = 0 if extra_scores is None else extra_scores.shape[1]
        scores = torch.empty(len(out.targets), 0) if extra_scores is None else extra_scores
        values = (
            torch.empty(len(out.targets), k, dtype=torch.long)
            if extra_values is None
            else extra_values
        )
        return trime_gold_logprob(out.gold_logit, out.lse, scores, values, out.targets)
    res = torch.empty_like(out.lse)
    bounds = np.flatnonzero(np.diff(out.doc)) + 1
    for a, b in zip(
        np.concatenate([[0], bounds]), np.concatenate([bounds, [len(out.doc)]]), strict=True
    ):
        # inputs are contiguous within a document, so the document slice index is pos - pos[a]
        start = torch.from_numpy(out.seg_start[a:b] - out.pos[a]).long()
        res[a:b] = document_gold_logprobs(
            out.keys[a:b],
            out.targets[a:b],
            out.gold_logit[a:b],
            out.lse[a:b],
            start,
            long_segments * seg_len,
            tau,
            extra_scores=None if extra_scores is None else extra_scores[a:b],
            extra_values=None if extra_values is None else extra_values[a:b],
        )
    return res


def perplexity(logprobs: torch.Tensor) -> float:
    """exp of the mean negative log-likelihood."""
    return float(torch.exp(-logprobs.double().mean()))
