"""What the encoder takes and gives: window cutting, per-token outputs, a decoding state."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class WindowConfig:
    """How a document is cut into LM windows.

    Window i covers tokens ``[i * stride, i * stride + context)`` and scores the targets
    that no earlier window scored. A target t is predicted from the tokens of its window
    before it, so the window must hold position t - 1: consecutive windows overlap by
    ``context - stride`` tokens and every target after the first window keeps at least
    that much left context. ``stride == context`` would leave no overlap, and the first
    target of each later window would be predicted from nothing inside its window; it
    is refused rather than silently turned into ``context - 1`` (the largest legal
    stride), so that a report's "stride" is always the stride that ran.
    """

    context: int = 512  # tokens a window holds; DATA.md's perplexity figures use 512
    stride: int = 256  # a window advances by this much; later tokens keep >= 256 context
    batch_size: int = 4  # windows per forward; 1x512 is already near the CPU's best rate

    def __post_init__(self) -> None:
        if not self.context >= 2:
            raise ValueError("context must be at least 2 tokens")
        if not 1 <= self.stride < self.context:
            raise ValueError(
                f"stride must be in [1, context - 1] = [1, {self.context - 1}] (got "
                f"{self.stride}): windows must overlap by at least one token, so that each "
                f"window's first scored token has its previous token in the window; the "
                f"largest legal stride for context {self.context} is {self.context - 1}"
            )
        if self.batch_size < 1:
            raise ValueError("batch_size must be >= 1")

    @property
    def min_context(self) -> int:
        """Left context every target gets at least (all of it before position context)."""
        return self.context - self.stride

    def windows(self, n: int) -> list[tuple[int, int, int]]:
        """(begin, end, first_scored) for a document of n tokens; targets 1..n-1 once each.

        Window (b, e, f) scores targets f..e-1 with b < f: target t is predicted from
        tokens b..t-1, at least ``min(t, context - stride)`` of them.
        """
        out: list[tuple[int, int, int]] = []
        scored_to = 1  # next target position not yet scored
        begin = 0
        while scored_to < n:
            end = min(begin + self.context, n)
            assert begin < scored_to < end, (begin, scored_to, end)
            out.append((begin, end, scored_to))
            scored_to = end
            begin += self.stride
        return out


@dataclass
class Decoding:
    """A batch of contexts being extended one token at a time (Encoder.start / extend)."""

    cache: Any  # transformers DynamicCache: attention keys and values of every row
    mask: torch.Tensor  # (R, T) 1 where a real token sits (contexts are right-padded)
    lengths: torch.Tensor  # (R,) real tokens so far, the position id of the next token


@dataclass
class TokenOutputs:
    """Per scored token; every array has the same first dimension n."""

    targets: np.ndarray  # (n,) int64 gold next token
    positions: np.ndarray  # (n,) int32 position of the target in its document
    keys: np.ndarray  # (n, d) float32 kNN keys
    hidden: np.ndarray  # (n, h) float32 input of the LM head
    lse: np.ndarray  # (n,) float32 log-sum-exp of the logits
    target_logprob: np.ndarray  # (n,) float32 log p_LM(target)
    top_id: np.ndarray  # (n,) int64 argmax of p_LM
    top_logprob: np.ndarray  # (n,) float32
    entropy: np.ndarray  # (n,) float32 entropy of p_LM in nats
    key_ce: np.ndarray  # (n,) float32 -log softmax(E key)[target], NaN unless compute_key_ce
    prev_tokens: np.ndarray  # (n,) int64 the last context token (ids[position - 1])

    def __len__(self) -> int:
        return int(self.targets.shape[0])

    @classmethod
    def concat(cls, parts: Sequence[TokenOutputs]) -> TokenOutputs:
        return cls(
            **{f.name: np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(cls)}
        )

    def slice(self, sl: slice) -> TokenOutputs:
        return TokenOutputs(**{f.name: getattr(self, f.name)[sl] for f in fields(self)})


def perplexity(logprobs: np.ndarray) -> float:
    """exp of the mean negative log-likelihood (natural log)."""
    if logprobs.size == 0:
        return float("nan")
    return float(math.exp(-float(np.mean(logprobs, dtype=np.float64))))
