"""The whole evaluation: plan, encode once, run every policy, write the report."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from memlm.corpus import Document
from memlm.encoder import Encoder
from memlm.evaluate import checkpoint
from memlm.evaluate.cache import TokenCache
from memlm.evaluate.config import (
    EvalConfig,
    consolidation_of,
    fixed_grid,
    policy_parts,
    served_grid,
)
from memlm.evaluate.dedup import dedup_stream, screen_held_out
from memlm.evaluate.extras import add_forgetting, name_tokens, ood_table, timing
from memlm.evaluate.finetune import FinetuneConfig, continual_finetune
from memlm.evaluate.forgetting import Rescore
from memlm.evaluate.memories import FAISS, identity_of, run_memory
from memlm.evaluate.ood import load_ood
from memlm.evaluate.paired import write_test_documents
from memlm.evaluate.plan import DayPlan, plan_from_split, plan_stream, split_of
from memlm.evaluate.report import build_report, plots, render_markdown
from memlm.evaluate.run import PolicyRun, run_policy
from memlm.knnlm.policy import Policy, make_policy


def _plan(
    cfg: EvalConfig, docs: Sequence[Document], echo: Callable[[str], None]
) -> tuple[list[DayPlan], dict[str, Any] | None]:
    """The days of the run, deduplicated and screened for leakage unless ``--no-dedup``."""
    if cfg.split is not None:  # an explicit split is taken as given
        return plan_from_split(docs, cfg.split, days=cfg.days, start=cfg.start), None
    leakage: dict[str, Any] | None = None
    if cfg.dedup:
        res = dedup_stream(docs, near_threshold=cfg.near_dup_threshold)
        docs = res.kept
        leakage = {"near_dup_threshold": cfg.near_dup_threshold, **res.summary()}
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
    if leakage is not None:
        plans, rows = screen_held_out(plans, threshold=cfg.eval_overlap_threshold)
        excluded = [r for r in rows if r["excluded"]]
        leakage |= {
            "eval_overlap_threshold": cfg.eval_overlap_threshold,
            "held_out_documents": len(rows),
            "held_out_excluded": len(excluded),
            "held_out_max_overlap_kept": max(
                (float(r["overlap"]) for r in rows if not r["excluded"]),  # type: ignore[arg-type]
                default=0.0,
            ),
            "held_out": rows,
        }
        echo(
            f"dedup: dropped {leakage['dropped_exact']} exact and {leakage['dropped_near']} "
            f"near duplicates; {len(excluded)} of {len(rows)} held-out documents overlap the "
            f"memory by > {cfg.eval_overlap_threshold:.0%} of their 13-grams and are excluded"
        )
    return plans, leakage


def _policy(name: str, cfg: EvalConfig, runs: dict[str, PolicyRun]) -> Policy | None:
    name = policy_parts(name)[0]
    if name == "bare":
        return None
    if name == "randmem":
        rate = cfg.rand_rate
        if rate is None:
            rate = runs["monim"].memrate if "monim" in runs else 0.5
        return make_policy("randmem", rate=rate, seed=cfg.seed)
    return make_policy(name, delta=cfg.kl_delta if name == "monim-kl" else cfg.delta)


class ResumeMismatch(ValueError):
    """--resume into a directory whose run had other settings or another plan."""


# Settings that do not change what a policy's checkpoints hold.
_NOT_IDENTITY = {
    "resume",
    "crash_at",
    "keep_stores",
    "threads",
    "encode_shard",
    "merge_from",
    "follow_encode",
    "memory_url",  # its host and port may change between runs: ``identity_of`` instead
}
# ...and those that may differ between runs merged into one report (--merge).
_MERGEABLE = {"policies", "rand_rate"}


def _identity(cfg: EvalConfig, plans: Sequence[DayPlan]) -> dict[str, str]:
    what = {k: repr(v) for k, v in vars(cfg).items() if k not in _NOT_IDENTITY}
    what["plan"] = repr(split_of(plans))
    memory = identity_of(cfg.memory_url)
    if memory is not None:  # (none on the faiss files: earlier runs stay resumable)
        what["memory"] = memory
    return what


def _check_resume(cfg: EvalConfig, plans: Sequence[DayPlan], workroot: Path) -> None:
    """Record what the run is; a resumed run must be the same run."""
    what = _identity(cfg, plans)
    path = workroot / "run.json"
    if cfg.resuming and path.exists():
        before = json.loads(path.read_text())
        diff = sorted(k for k in set(before) | set(what) if before.get(k) != what.get(k))
        if diff:
            raise ResumeMismatch(f"--resume: {workroot} holds a run with other {', '.join(diff)}")
    workroot.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(what, indent=1))


def _merge(
    cfg: EvalConfig,
    plans: Sequence[DayPlan],
    workroot: Path,
    names: Sequence[str],
    echo: Callable[[str], None],
) -> None:
    """Copy each policy's checkpoint from the ``--merge`` outputs into ``workroot``.

    The sources are earlier outputs of the same run (same plan and settings) that ran
    other ``--policies``, e.g. one process per core.  For each policy the checkpoint with
    the most finished days wins, this run's own included; an unfinished one resumes here.
    """
    what = _identity(cfg, plans)
    best: dict[str, tuple[int, Path]] = {}
    for name in names:
        own = checkpoint.load(workroot / name)
        best[name] = (len(own.days) if own else -1, workroot / name)
    for src in map(Path, cfg.merge_from):
        run_json = src / "work" / "run.json"
        if not run_json.exists():
            raise ResumeMismatch(f"--merge: {src} holds no run (no work/run.json)")
        theirs = json.loads(run_json.read_text())
        diff = sorted(
            k for k in (set(theirs) | set(what)) - _MERGEABLE if theirs.get(k) != what.get(k)
        )
        if diff:
            raise ResumeMismatch(f"--merge: {src} holds a run with other {', '.join(diff)}")
        for name in names:
            state = checkpoint.load(src / "work" / name)
            if state is not None and len(state.days) > best[name][0]:
                best[name] = (len(state.days), src / "work" / name)
    for name, (days, path) in best.items():
        if path == workroot / name or days < 0:
            continue
        shutil.rmtree(workroot / name, ignore_errors=True)
        shutil.copytree(path, workroot / name)
        echo(f"--merge: {name} from {path} ({days} of {len(plans)} days)")


def _encode_shard(
    cache: TokenCache, texts: Sequence[str], shard: int, shards: int, echo: Callable[[str], None]
) -> dict[str, Any]:
    """Encode every ``shards``-th text from the ``shard``-th into the cache and stop: N
    processes of one thread each fill the cache side by side before the run itself."""
    mine = list(dict.fromkeys(texts))[shard::shards]  # a text repeated is encoded once
    cache.lengths(mine, progress=True)  # encodes what is missing, one chunk held at a time
    echo(
        f"shard {shard}/{shards}: {len(mine)} documents, encoded {cache.encoded_tokens} new "
        f"tokens in {cache.encode_seconds:.0f} s (rest cached)"
    )
    return {
        "encode_shard": [shard, shards],
        "documents": len(mine),
        "encoded_tokens": cache.encoded_tokens,
        "encode_seconds": round(cache.encode_seconds, 1),
    }


def evaluate(
    cfg: EvalConfig,
    docs: Sequence[Document],
    out: Path,
    *,
    encoder: Encoder | None = None,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run every policy over the stream slice and write report.json, report.md and plots."""
    encoder = encoder or Encoder.load(cfg.model, threads=cfg.threads)
    before = encoder.compute_key_ce
    try:  # MoNIM(KL) needs the key cross-entropy; the caller's encoder is left as it was
        encoder.compute_key_ce = before or "monim-kl" in cfg.policies
        return _evaluate(cfg, docs, out, encoder, echo)
    finally:
        encoder.compute_key_ce = before


def _evaluate(
    cfg: EvalConfig,
    docs: Sequence[Document],
    out: Path,
    encoder: Encoder,
    echo: Callable[[str], None],
) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    plans, leakage = _plan(cfg, docs, echo)
    (out / "split.json").write_text(json.dumps(split_of(plans), indent=1))
    cache = TokenCache(encoder, cfg.window, root=None)
    kce = cache.root.with_name(cache.root.name + "-kce")
    if encoder.compute_key_ce:
        cache.root = kce
        cache.root.mkdir(parents=True, exist_ok=True)
    else:  # a key-CE encode (the default --policies include monim-kl) serves this run too
        cache.also.append(kce)
    n_train = sum(len(p.train) for p in plans)
    echo(
        f"{len(plans)} days, {n_train} ingested documents, "
        f"{sum(len(p.dev) for p in plans)} dev / {sum(len(p.test) for p in plans)} test documents"
    )
    ood = None
    if cfg.ood_dir is not None and plans:
        ood = load_ood(Path(cfg.ood_dir), encoder, cfg.ood_tokens, plans[-1].day)
    # Encode everything once (cached across runs), with a progress bar. Every test set comes
    # first: the month-end re-scoring (forgetting) reads them all, so a run that follows
    # --encode-shard processes (--follow-encode) could not pass the first month's end before
    # the encode's last day. Then the stream in order, day by day, and out of domain last.
    all_texts = [d.text for p in plans for d in p.test]
    all_texts += [d.text for p in plans for d in (*p.train, *p.dev)]
    all_texts += [d.text for docs in (ood or {}).values() for d in docs]
    if cfg.encode_shard is not None:
        return _encode_shard(cache, all_texts, *cfg.encode_shard, echo=echo)
    cache.follow = cfg.follow_encode
    lengths = dict(zip(all_texts, cache.lengths(all_texts, progress=True), strict=True))
    echo(f"encoded {cache.encoded_tokens} new tokens in {cache.encode_seconds:.0f} s (rest cached)")

    _check_resume(cfg, plans, out / "work")
    bases = ("fullmem", "monim", "monim-amt", "monim-kl", "randmem")
    # each base's runs in this order (RandMem last: its rate may be MoNIM's), then as given
    order = sorted(
        (p for p in cfg.policies if policy_parts(p)[0] in bases),
        key=lambda p: (bases.index(policy_parts(p)[0]), cfg.policies.index(p)),
    )
    unknown = set(cfg.policies) - set(order) - {"bare"}
    if unknown:
        raise ValueError(f"unknown policies: {sorted(unknown)}")
    if cfg.merge_from:
        _merge(cfg, plans, out / "work", ["bare", *order], echo)
    runs: dict[str, PolicyRun] = {}
    seconds: dict[str, float] = {}
    workroot = out / "work"
    grid = fixed_grid(cfg.grid, cfg)
    rescore = Rescore(
        tuple(d.text for p in plans for d in p.test),
        replace(grid, ks=tuple(k for k in grid.ks if k <= cfg.k_max) or (cfg.k_max,)),
    )
    names = ["bare", *order]
    if cfg.follow_encode is not None:
        # bare only reads; run last, it never holds a memory policy back to the encode's pace
        names = [*order, "bare"]
    day_tokens = sum(lengths[d.text] for p in plans for d in p.train)
    bar = tqdm(total=day_tokens * len(names), unit="tok", desc="policies", smoothing=0.05)
    for name in names:
        policy = _policy(name, cfg, runs)
        memory = FAISS if policy is None else run_memory(cfg.memory_url, name)  # bare: none
        bar.set_postfix_str(name)
        t0 = time.perf_counter()
        run = run_policy(
            policy,
            plans,
            cache,
            workroot / name,
            ingest_params=cfg.ingest,
            # MoNIM decides with the lambda the report scores with (the service's)
            ingest_evidence=cfg.lambda_mode == "evidence" and cfg.ingest is None,
            ingest_served=cfg.lambda_mode == "served" and cfg.ingest is None,
            calibrator_min_tokens=cfg.calibrator_min_tokens,
            k_max=cfg.k_max,
            index_kind=cfg.index_kind,
            rerank_depth=cfg.rerank_depth,
            ingest_rerank_depth=cfg.ingest_rerank_depth,
            pointers=cfg.pointers,
            trime=cfg.trime,
            served_grid=served_grid(cfg)[0],
            served_default=served_grid(cfg)[1],
            on_day=lambda d: bar.update(d.tokens_seen),
            resume=cfg.resuming,
            rescore=rescore if name in cfg.forgetting_policies else None,
            crash_at=cfg.crash_at[1] if cfg.crash_at and cfg.crash_at[0] == name else None,
            ood=ood,
            name=name,
            consolidation=consolidation_of(name, cfg),
            memory=memory,
        )
        runs[name] = run
        seconds[name] = time.perf_counter() - t0
        bar.n = day_tokens * (names.index(name) + 1)  # a resumed policy skipped its days
        bar.refresh()
        echo(
            f"{name:10s} memrate {run.memrate:6.1%} entries {run.entries:8d} ({seconds[name]:.0f} s)"
        )
        if not cfg.keep_stores:  # the checkpoint and month-end scores stay for --resume
            memory.discard(workroot / name)
    bar.close()
    runs = {name: runs[name] for name in ("bare", *order)}  # report order

    t_report = time.perf_counter()
    report, scores = build_report(cfg, plans, runs, time.perf_counter() - t_start, cache)
    report["leakage"] = leakage
    add_forgetting(report, runs, workroot, grid)
    if ood:
        report["ood"] = ood_table(cfg, runs, report, cache.encoder.vocab_size)
    if cfg.names:
        report["names"] = name_tokens(cfg, plans, runs, report, cache)
    if cfg.finetune_lr is not None:  # the parametric continual-learning baseline
        ft, ft_lp = continual_finetune(
            encoder,
            plans,
            cfg.window,
            FinetuneConfig(lr=cfg.finetune_lr, seed=cfg.seed),
            ood=ood,
            resamples=cfg.bootstrap_resamples,
        )
        scores.add("finetune", ft_lp)
        ft["win_share"] = scores.win_shares("finetune", runs, resamples=cfg.bootstrap_resamples)
        report["finetune"] = ft
        echo(f"finetune   test ppl {ft['test_ppl']:.2f}")
    write_test_documents(out / "test_documents.json", scores, plans)
    report["timing"] = timing(runs, seconds, cache, time.perf_counter() - t_report)
    report["settings"]["seconds"] = round(time.perf_counter() - t_start, 1)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(render_markdown(report))
    plots(report, out)
    return report
