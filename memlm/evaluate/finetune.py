"""The parametric baseline: the same LM fine-tuned day by day on each day's ingested documents.

A float32 copy of the frozen model is trained, full weights, for one epoch over each day's
ingested documents (non-overlapping windows of the evaluation's context, one window per
AdamW step, a small learning rate), then scores that day's test documents in the evening,
as the memory policies do.  Scoring runs in the evaluation encoder's precision (a
bfloat16 evaluation scores a bfloat16 cast of the trained weights, as its bare model is a
bfloat16 cast of the original ones), so the baseline and the policies share one bare
model; training stays float32 (CPU autocast to bfloat16 measured 15x slower per step
here).  At the end of every month all test documents of the plan are
scored again (the learning and forgetting table), and out-of-domain documents after the
stream.  Cost: CPU seconds (``time.process_time``) and wall seconds of training per day.
"""

from __future__ import annotations

import copy
import datetime as dt
import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from memlm.calibrator.constant import ppl
from memlm.corpus import Document
from memlm.encoder import Encoder, WindowConfig
from memlm.encoder.loading import load_model
from memlm.evaluate.bootstrap import ci
from memlm.evaluate.plan import DayPlan


@dataclass(frozen=True)
class FinetuneConfig:
    lr: float = 1e-5  # small: one epoch a day for months must not wreck the model
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 0


def _month(d: dt.date) -> str:
    return f"{d.year:04d}-{d.month:02d}"


def _score(enc: Encoder, docs: Sequence[Document], window: WindowConfig) -> list[np.ndarray]:
    """log p(gold) of every scored token of each document, with the model as it is now."""
    if not docs:
        return []
    outs = enc.encode_many([enc.tokenize(d.text) for d in docs], window)
    return [o.target_logprob.astype(np.float64) for o in outs]


def _master(encoder: Encoder) -> Any:
    """The float32 weights to train: the encoder's own model when it runs in float32, else
    the model loaded again (a half-precision or int8 cast cannot take small updates)."""
    if encoder.precision == "float32":
        return copy.deepcopy(encoder.model)
    model, _ = load_model(encoder.name)
    return model.to(encoder.device)


def _scorer(encoder: Encoder, master: Any, name: str) -> Encoder:
    """An encoder over the trained weights, in ``encoder``'s precision: float32 shares
    ``master``; any other precision scores a cast copy, leaving ``master`` float32."""
    if encoder.precision == "float32":
        return Encoder(
            master, encoder.tokenizer, name, threads=encoder.threads, device=encoder.device
        )
    return Encoder(
        copy.deepcopy(master).eval(),
        encoder.tokenizer,
        name,
        threads=encoder.threads,
        precision=encoder.precision,
        device=encoder.device,
    )


def _train_day(
    model: Any, opt: torch.optim.Optimizer, ids: list[list[int]], context: int, cfg: FinetuneConfig
) -> int:
    """One epoch over the day's documents; returns the tokens trained on."""
    model.train()
    device = next(model.parameters()).device
    n = 0
    for doc in ids:
        for start in range(0, max(1, len(doc) - 1), context):
            chunk = doc[start : start + context]
            if len(chunk) < 2:
                continue
            x = torch.tensor([chunk], dtype=torch.long, device=device)  # (1, T)
            loss = model(input_ids=x, labels=x).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            opt.step()
            n += len(chunk) - 1
    model.eval()
    return n


def continual_finetune(
    encoder: Encoder,
    plans: Sequence[DayPlan],
    window: WindowConfig,
    cfg: FinetuneConfig = FinetuneConfig(),
    *,
    ood: Mapping[str, Sequence[Document]] | None = None,
    resamples: int = 1000,
) -> tuple[dict[str, Any], np.ndarray]:
    """Fine-tune a copy of ``encoder``'s model over the plan: the report section, and
    log p(gold) of every test token (plan order, as the memory policies score them) for
    paired comparisons."""
    torch.manual_seed(cfg.seed)
    model = _master(encoder)
    name = f"{encoder.name}-finetuned"
    # float32: one scorer sharing ``model`` (made before the weights take gradients again);
    # any other precision: a cast of the day's weights, made each evening
    enc = _scorer(encoder, model, name) if encoder.precision == "float32" else None
    for p in model.parameters():
        p.requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    tests = [d for p in plans for d in p.test]
    test_month = [_month(p.day) for p in plans for _ in p.test]
    lps: list[np.ndarray] = []
    keys: list[np.ndarray] = []
    days: list[dict[str, Any]] = []
    forgetting: dict[str, dict[str, float]] = {}
    day_ids = [[encoder.tokenize(d.text) for d in plan.train] for plan in plans]
    bar = tqdm(total=sum(map(len, itertools.chain(*day_ids))), unit="tok", desc="finetune")
    for i, plan in enumerate(plans):
        bar.set_postfix_str(plan.day.isoformat())
        c0, w0 = time.process_time(), time.perf_counter()
        n = _train_day(model, opt, day_ids[i], window.context, cfg)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        if enc is None or encoder.precision != "float32":
            enc = _scorer(encoder, model, name)
        day_lps = _score(enc, plan.test, window)
        for j, lp in enumerate(day_lps):
            lps.append(lp)
            keys.append(np.full(len(lp), i * 100_000 + j, np.int64))
        days.append(
            {
                "day": plan.day.isoformat(),
                "train_tokens": n,
                "cpu_seconds": round(cpu, 2),
                "wall_seconds": round(wall, 2),
                "test_ppl": ppl(np.concatenate(day_lps)) if day_lps else None,
            }
        )
        bar.update(sum(map(len, day_ids[i])))
        if i + 1 == len(plans) or _month(plans[i + 1].day) != _month(plan.day):
            scored = _score(enc, tests, window)
            forgetting[_month(plan.day)] = {
                m: ppl(
                    np.concatenate(
                        [lp for lp, tm in zip(scored, test_month, strict=True) if tm == m]
                    )
                )
                for m in sorted(set(test_month))
            }
    bar.close()
    lp_all = np.concatenate(lps) if lps else np.zeros(0)
    key_all = np.concatenate(keys) if keys else np.zeros(0, np.int64)
    out: dict[str, Any] = {
        "settings": {
            **asdict(cfg),
            "epochs": 1,
            "weights": "full",
            "optimizer": "AdamW",
            "trained_in": "float32",
            "scored_in": encoder.precision,
        },
        "test_ppl": ppl(lp_all),
        "test_ppl_ci95": list(ci(lp_all, key_all, resamples=resamples)) if lp_all.size else None,
        "test_tokens": int(lp_all.size),
        "per_day": days,
        "cpu_seconds_per_day": round(float(np.mean([d["cpu_seconds"] for d in days])), 2)
        if days
        else None,
        "forgetting": forgetting,
    }
    if ood:
        enc = enc or _scorer(encoder, model, name)
        out["ood"] = {
            src: ppl(np.concatenate(_score(enc, docs, window)) if docs else np.zeros(0))
            for src, docs in ood.items()
        }
    return out, lp_all
