"""The whole evaluation: plan, encode once, run every policy, write the report."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from memlm.corpus import Document
from memlm.encoder import Encoder
from memlm.evaluate.cache import TokenCache
from memlm.evaluate.config import EvalConfig, fixed_grid
from memlm.evaluate.plan import plan_from_split, plan_stream, split_of
from memlm.evaluate.report import build_report, plots, render_markdown
from memlm.evaluate.run import PolicyRun, run_policy
from memlm.interpolation import SERVED_DEFAULT, SERVED_GRID
from memlm.knnlm import KnnParams
from memlm.policy import Policy, make_policy


def evaluate(
    cfg: EvalConfig,
    docs: Sequence[Document],
    out: Path,
    *,
    encoder: Encoder | None = None,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run every policy over the stream slice and write report.json, report.md and plots."""
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    encoder = encoder or Encoder.load(cfg.model, threads=cfg.threads)
    if "monim-kl" in cfg.policies:
        encoder.compute_key_ce = True
    if cfg.split is not None:
        plans = plan_from_split(docs, cfg.split, days=cfg.days, start=cfg.start)
    else:
        plans = plan_stream(
            docs,
            days=cfg.days,
            start=cfg.start,
            max_docs_per_day=cfg.max_docs_per_day,
            max_eval_docs_per_day=cfg.max_eval_docs_per_day,
            dev_share=cfg.dev_share,
            test_share=cfg.test_share,
            seed=cfg.seed,
        )
    (out / "split.json").write_text(json.dumps(split_of(plans), indent=1))
    cache = TokenCache(encoder, cfg.window, root=None)
    if encoder.compute_key_ce:
        cache.root = cache.root.with_name(cache.root.name + "-kce")
        cache.root.mkdir(parents=True, exist_ok=True)
    n_train = sum(len(p.train) for p in plans)
    echo(
        f"{len(plans)} days, {n_train} ingested documents, "
        f"{sum(len(p.dev) for p in plans)} dev / {sum(len(p.test) for p in plans)} test documents"
    )
    # Encode everything once (cached across runs), with a progress bar.
    all_texts = [d.text for p in plans for d in (*p.train, *p.dev, *p.test)]
    cache.get_many(all_texts, progress=True)
    echo(f"encoded {cache.encoded_tokens} new tokens in {cache.encode_seconds:.0f} s (rest cached)")

    order = [
        p for p in ("fullmem", "monim", "monim-amt", "monim-kl", "randmem") if p in cfg.policies
    ]
    unknown = set(cfg.policies) - set(order) - {"bare"}
    if unknown:
        raise ValueError(f"unknown policies: {sorted(unknown)}")
    runs: dict[str, PolicyRun] = {}
    workroot = out / "work"
    for name in ["bare", *order]:
        if name == "randmem":
            rate = cfg.rand_rate
            if rate is None:
                rate = runs["monim"].memrate if "monim" in runs else 0.5
            policy: Policy | None = make_policy("randmem", rate=rate, seed=cfg.seed)
        elif name == "bare":
            policy = None
        else:
            policy = make_policy(name, delta=cfg.kl_delta if name == "monim-kl" else cfg.delta)
        t0 = time.perf_counter()
        run = run_policy(
            policy,
            plans,
            cache,
            workroot / name,
            ingest_params=cfg.ingest,
            k_max=cfg.k_max,
            index_kind=cfg.index_kind,
            trime=cfg.trime,
            served_grid=fixed_grid(SERVED_GRID, cfg),
            served_default=KnnParams(
                k=cfg.k or SERVED_DEFAULT.k,
                temperature=cfg.temperature or SERVED_DEFAULT.temperature,
                lmbda=SERVED_DEFAULT.lmbda if cfg.lmbda is None else cfg.lmbda,
            ),
        )
        runs[name] = run
        echo(
            f"{name:10s} memrate {run.memrate:6.1%} entries {run.entries:8d} ({time.perf_counter() - t0:.0f} s)"
        )
        if not cfg.keep_stores:
            shutil.rmtree(workroot / name, ignore_errors=True)

    report = build_report(cfg, plans, runs, time.perf_counter() - t_start, cache)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(render_markdown(report))
    plots(report, out)
    return report
