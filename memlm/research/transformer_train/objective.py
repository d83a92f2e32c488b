"""One training run's configuration, its batches and the loss of one batch per objective."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn

from memlm.research.bm25_batching import bm25_neighbours, greedy_chain, random_batches
from memlm.research.data import Segments, consecutive_batches
from memlm.research.transformer_train.model import forward_with_keys
from memlm.research.trime import MemoryKind, lm_token_loss, memory_mask, trime_token_loss

Objective = Literal["vanilla", "trime", "trime-long", "trime-ext"]
OBJECTIVES: tuple[Objective, ...] = ("vanilla", "trime", "trime-long", "trime-ext")
MEMORY_OF: dict[str, MemoryKind | None] = {
    "vanilla": None,
    "trime": "local",
    "trime-long": "long",
    "trime-ext": "ext",
}


@dataclass(frozen=True)
class TrainConfig:
    """One training run; the reason for each default beside it."""

    objective: Objective = "vanilla"
    seg_len: int = 128  # L: attention span of training and evaluation
    batch_segments: int = 8  # B: 1,024 tokens a step and a 1,024-entry in-batch memory
    long_m: int = 4  # m: consecutive segments per document for trime-long
    steps: int = 300
    lr: float = 2e-3  # small models from scratch take a large rate
    min_lr_frac: float = 0.1  # cosine decay to 10% of lr
    warmup_frac: float = 0.05  # linear lr warm-up
    weight_decay: float = 0.01
    clip: float = 1.0
    vanilla_frac: float = 0.05  # §5.2: first 5% of updates with the plain LM loss
    p_drop_local: float = 0.9  # §4.3 / App. H: trime-ext drops local memory this often
    bm25: bool = True  # trime-ext: False is the "without BM25 batching" ablation
    bm25_k: int = 20  # App. B: top-20 neighbours per segment
    tau: float = 1.0  # training uses the plain scaled dot product
    seed: int = 0
    save_every: int = 100
    keep_checkpoints: int = 2  # older step-N folders are deleted (each holds Adam's 2x state)
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, not {self.objective!r}")
        if self.steps < 1 or self.batch_segments < 1 or self.seg_len < 2 or self.long_m < 1:
            raise ValueError("steps, batch_segments, long_m must be >= 1 and seg_len >= 2")
        if not 0 <= self.p_drop_local <= 1 or not 0 <= self.vanilla_frac <= 1:
            raise ValueError("p_drop_local and vanilla_frac must lie in [0, 1]")
        if self.objective == "trime-long" and self.batch_segments % self.long_m:
            raise ValueError(
                f"trime-long needs batch_segments ({self.batch_segments}) to be a multiple "
                f"of long_m ({self.long_m}): a batch holds whole groups of m segments"
            )


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_frac``."""
    warm = max(1, round(cfg.warmup_frac * cfg.steps))
    if step < warm:
        return (step + 1) / warm
    t = (step - warm) / max(1, cfg.steps - warm)
    return cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t))


def drop_local_at(step: int, cfg: TrainConfig) -> bool:
    """The per-batch coin of §4.3, seeded by (seed, step) so that a resumed run agrees."""
    rng = np.random.default_rng([cfg.seed, step, 17])
    return bool(rng.random() < cfg.p_drop_local)


def batch_loss(
    model: nn.Module, segs: Segments, rows: Sequence[int], cfg: TrainConfig, step: int
) -> tuple[torch.Tensor, int]:
    """Mean loss of one batch (TRIME or plain, per objective and step) and its token count."""
    idx = np.asarray(rows)
    x = torch.from_numpy(segs.x[idx])  # (B, L)
    y = torch.from_numpy(segs.y[idx]).reshape(-1)  # (N,)
    valid = torch.from_numpy(segs.valid[idx]).reshape(-1)  # (N,)
    logits, keys = forward_with_keys(model, x)
    logits = logits.reshape(y.shape[0], -1)  # (N, V)
    kind = MEMORY_OF[cfg.objective]
    plain = kind is None or step < round(cfg.vanilla_frac * cfg.steps)
    if plain:
        per_tok = lm_token_loss(logits, y, valid)
    else:
        assert kind is not None
        vis = memory_mask(
            torch.from_numpy(segs.doc[idx]),
            torch.from_numpy(segs.pos[idx]),
            kind,
            drop_local=kind == "ext" and drop_local_at(step, cfg),
        )
        per_tok = trime_token_loss(logits, y, keys.reshape(y.shape[0], -1), vis, valid, cfg.tau)
    n = int(valid.sum())
    return per_tok.sum() / max(n, 1), n


def segment_texts(segs: Segments, decode: Callable[[Sequence[int]], str]) -> list[str]:
    """Decoded text of every segment (the BM25 corpus)."""
    return [decode([int(t) for t in segs.x[i][segs.valid[i]]]) for i in range(len(segs))]


def batch_plan(
    segs: Segments,
    cfg: TrainConfig,
    texts: Sequence[str] | None = None,
) -> list[list[int]]:
    """Segment rows of every step, epoch after epoch, deterministic in ``cfg.seed``.

    Every epoch uses each row once. Over :func:`stream_segments` rows cut to a multiple
    of ``cfg.batch_segments``, every batch of every objective holds exactly B full rows.
    """
    plan: list[list[int]] = []
    neighbours: list[list[int]] | None = None
    if cfg.objective == "trime-ext" and cfg.bm25:
        if texts is None:
            raise ValueError("BM25 batching needs the segment texts")
        neighbours = bm25_neighbours(texts, cfg.bm25_k)
    epoch = 0
    while len(plan) < cfg.steps:
        seed = cfg.seed * 1000 + epoch
        if cfg.objective == "trime-long":
            batches = consecutive_batches(len(segs), cfg.batch_segments, cfg.long_m, seed)
        elif neighbours is not None:
            order = greedy_chain(neighbours, seed)
            b = cfg.batch_segments
            batches = [order[i : i + b] for i in range(0, len(order), b)]
        else:
            batches = random_batches(len(segs), cfg.batch_segments, seed)
        plan.extend(batches)
        epoch += 1
    return plan[: cfg.steps]
