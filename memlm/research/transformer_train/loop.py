"""The training loop: AdamW with warm-up and cosine decay, checkpoints, exact resume."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memlm.research.data import Segments
from memlm.research.transformer_train.checkpoints import (
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    save_final,
    saved_checkpoints,
)
from memlm.research.transformer_train.model import set_threads
from memlm.research.transformer_train.objective import (
    TrainConfig,
    batch_loss,
    batch_plan,
    lr_factor,
)

log = logging.getLogger("memlm.research.transformer_train")


@dataclass
class TrainResult:
    steps_done: int
    resumed_from: int
    seconds: float
    tokens: int
    history: list[dict[str, float]] = field(default_factory=list)


def train(
    model: nn.Module,
    segs: Segments,
    cfg: TrainConfig,
    out_dir: Path,
    *,
    tokenizer: Any = None,
    texts: Sequence[str] | None = None,
    resume: bool = True,
    progress: bool = True,
    stop_after: int | None = None,
    max_seconds: float | None = None,
) -> TrainResult:
    """Train in place; checkpoint every ``save_every`` steps and at the end; resume if asked.

    ``stop_after`` ends the loop early after that many steps and checkpoints there (a time
    limit, or an interruption in tests): a second call with ``resume`` finishes the run.
    ``max_seconds`` does the same after that much wall time. ``resume=False`` starts over
    and deletes the checkpoints already under ``out_dir``.
    """
    from tqdm import tqdm

    set_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    plan = batch_plan(segs, cfg, texts)
    history: list[dict[str, float]]
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.98),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    start, history = 0, []
    if not resume:  # start over: older checkpoints would otherwise outrank the new ones
        for old in saved_checkpoints(out_dir):
            log.warning("resume=False: deleting %s", old)
            shutil.rmtree(old)
    ckpt = latest_checkpoint(out_dir) if resume else None
    if ckpt is not None:
        start, history = load_checkpoint(ckpt, model, opt, sched, cfg)
        log.info("resumed from %s at step %d", ckpt, start)
    model.train()
    t0, tokens = time.time(), 0
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    bar = tqdm(
        range(start, end), initial=start, total=cfg.steps, disable=not progress, desc=cfg.objective
    )
    for step in bar:
        loss, n = batch_loss(model, segs, plan[step], cfg, step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        sched.step()
        tokens += n
        value = float(loss.detach())
        history.append({"step": step + 1, "loss": value, "lr": float(sched.get_last_lr()[0])})
        bar.set_postfix(loss=f"{value:.3f}")
        done = step + 1
        if max_seconds is not None and time.time() - t0 > max_seconds and done < end:
            end = done
        if done % cfg.save_every == 0 or done == end:
            save_checkpoint(
                out_dir / "checkpoints" / f"step-{done}",
                model,
                tokenizer,
                opt,
                sched,
                done,
                cfg,
                history,
            )
            prune_checkpoints(out_dir, cfg.keep_checkpoints)
        if done == end:
            break
    if end == cfg.steps:
        save_final(out_dir, model, tokenizer, cfg, history)
    return TrainResult(
        steps_done=end, resumed_from=start, seconds=time.time() - t0, tokens=tokens, history=history
    )
