"""The report of a streaming evaluation: tuning on dev, test perplexities, markdown, plots."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from memlm.calibrator.constant import ppl, token_logprobs, tune
from memlm.evaluate.bootstrap import ci
from memlm.evaluate.cache import TokenCache
from memlm.evaluate.config import EvalConfig, fixed_grid, served_grid
from memlm.evaluate.markdown import extra_plots, sections
from memlm.evaluate.memories import describe_memory
from memlm.evaluate.paired import KEY_STRIDE, PairedScores
from memlm.evaluate.plan import EPOCH, DayPlan, day_number
from memlm.evaluate.run import PolicyRun
from memlm.knnlm import KnnParams, has_neighbours


def build_report(
    cfg: EvalConfig,
    plans: Sequence[DayPlan],
    runs: dict[str, PolicyRun],
    seconds: float,
    cache: TokenCache,
) -> tuple[dict[str, Any], PairedScores]:
    """The report's settings, results and per-day rows; and every policy's test log-probs,
    for paired comparisons with systems scored later (the fine-tuning baseline)."""
    results: dict[str, Any] = {}
    per_day: dict[str, list[dict[str, Any]]] = {}
    test_months = np.array([plans_day_month(d) for d in runs["bare"].test["day"]])
    constant_lps: dict[str, np.ndarray] = {}
    doc_keys = _doc_keys(runs["bare"].test)
    scores = PairedScores(doc_keys)
    for name, run in runs.items():
        tau = _apply_trime(run, cfg) if cfg.trime is not None else None
        if name == "bare":
            params, dev_ppl = KnnParams(lmbda=0.0), ppl(run.dev["target_lm_logprob"])
            test_lp = run.test["target_lm_logprob"]
        else:
            params, dev_ppl = tune(run.dev, fixed_grid(cfg.grid, cfg))
            test_lp = token_logprobs(run.test, params)
            if cfg.lambda_mode == "calibrated":
                test_lp, calibrated = _calibrated_test(run, params, cfg)
            elif cfg.lambda_mode == "evidence":
                test_lp, calibrated = _evidence_test(run, params)
            elif cfg.lambda_mode == "served":
                test_lp, calibrated = _served_test(run, params, cfg, plans, cache)
        scores.add(name, test_lp)
        constant_lps[name] = token_logprobs(run.test, params) if name != "bare" else test_lp
        results[name] = {
            **(calibrated if name != "bare" and cfg.lambda_mode != "constant" else {}),
            "test_ppl": ppl(test_lp),
            "test_ppl_ci95": _ci(test_lp, doc_keys, cfg),
            "dev_ppl": dev_ppl,
            "memrate": run.memrate,
            "entries": run.entries,
            "tokens_seen": run.tokens_seen,
            "lambda": params.lmbda,
            "temperature": params.temperature if name != "bare" else None,
            "k": params.k if name != "bare" else None,
            "tau": tau,
            "test_tokens": int(test_lp.size),
            "dev_tokens": int(run.dev["target_lm_logprob"].size),
            "test_ppl_per_month": {
                m: ppl(test_lp[test_months == m]) for m in sorted(set(test_months.tolist()))
            },
        }
        rows = []
        cum_seen = cum_stored = 0
        for ds_ in run.days:
            cum_seen += ds_.tokens_seen
            cum_stored += ds_.tokens_stored
            dnum = day_number(dt.date.fromisoformat(ds_.day))
            sofar = test_lp[run.test["day"] <= dnum]
            rows.append(
                {
                    "day": ds_.day,
                    "tokens_seen": ds_.tokens_seen,
                    "stored": ds_.tokens_stored,
                    "entries": ds_.entries,
                    "memrate_cumulative": cum_stored / cum_seen if cum_seen else 0.0,
                    "memrate_day": ds_.tokens_stored / ds_.tokens_seen if ds_.tokens_seen else 0.0,
                    "test_ppl_so_far": ppl(sofar),
                    "seconds": round(ds_.seconds, 2),
                    "ingest_knn": ds_.ingest or None,
                }
            )
            if ds_.consolidation is not None:  # a +cons / +budget policy's night
                rows[-1]["consolidation"] = ds_.consolidation
                rows[-1]["usage_seconds"] = ds_.usage_seconds
                # the share of the tokens seen so far that the memory holds now
                rows[-1]["entries_share"] = ds_.entries / cum_seen if cum_seen else 0.0
            if ds_.stored_lm_alone is not None:
                rows[-1]["stored_lm_alone"] = ds_.stored_lm_alone
                rows[-1]["memrate_day_lm_alone"] = (
                    ds_.stored_lm_alone / ds_.tokens_seen if ds_.tokens_seen else 0.0
                )
            if ds_.searched is not None:  # --pointers: queries the index got, of how many
                rows[-1]["searched"] = dict(ds_.searched)
        per_day[name] = rows
    for name, r in results.items():
        if cfg.lambda_mode == "calibrated" and name != "bare":
            r["constant_lambda_test_ppl_ci95"] = _ci(constant_lps[name], doc_keys, cfg)
        r["bytes"] = _memory_bytes(r["entries"], cache)
        rows_ = per_day[name]
        if rows_ and all("stored_lm_alone" in row for row in rows_) and r["tokens_seen"]:
            r["memrate_lm_alone"] = sum(row["stored_lm_alone"] for row in rows_) / r["tokens_seen"]
        r["win_share"] = scores.win_shares(
            name, ("fullmem", "randmem"), resamples=cfg.bootstrap_resamples
        )
    report = {
        "settings": {
            "model": cfg.model,
            "corpus": cfg.corpus,
            "slice": {
                "days": len(plans),
                "first_day": plans[0].day.isoformat() if plans else None,
                "last_day": plans[-1].day.isoformat() if plans else None,
                "max_docs_per_day": cfg.max_docs_per_day,
                "max_eval_docs_per_day": cfg.max_eval_docs_per_day,
                "train_documents": sum(len(p.train) for p in plans),
                "dev_documents": sum(len(p.dev) for p in plans),
                "test_documents": sum(len(p.test) for p in plans),
            },
            "window": asdict(cfg.window),
            "k_max": cfg.k_max,
            "ingest_knn": "served" if cfg.ingest is None else asdict(cfg.ingest),
            "fixed": {"k": cfg.k, "temperature": cfg.temperature, "lambda": cfg.lmbda},
            "split_file": cfg.split_file,
            # the cache keeps the encoder's float32 keys: held-out and ingest queries are
            # float32, as the service's; the datastore stores float16 keys
            "query_precision": "float32",
            "delta": cfg.delta,
            "kl_delta": cfg.kl_delta,
            "rand_rate": runs["randmem"].memrate if "randmem" in runs else None,
            "seeds": {"split": cfg.seed, "randmem": cfg.seed},
            "index_kind": cfg.index_kind,
            "memory": describe_memory(cfg.memory_url, [n for n in runs if n != "bare"]),
            # None: the index's default, max(4 k, 1024) candidates re-ranked
            "rerank_depth": {"heldout": cfg.rerank_depth, "ingest": cfg.ingest_rerank_depth},
            "pointers": None if cfg.pointers is None else asdict(cfg.pointers),
            "tuning": "k, temperature, lambda: grid search on dev tokens (all days), applied to "
            "test; values fixed by --k/--temperature/--lambda-value are not tuned",
            "lambda_mode": cfg.lambda_mode,
            "trime": None if cfg.trime is None else asdict(cfg.trime),
            "gate_theta": cfg.gate_theta if cfg.lambda_mode == "calibrated" else None,
            "seconds": round(seconds, 1),
            "bootstrap": f"{cfg.bootstrap_resamples} resamples of test documents, seed 0",
            "encoded_tokens_this_run": cache.encoded_tokens,
        },
        "results": results,
        "per_day": per_day,
    }
    return report, scores


def _doc_keys(split: dict[str, np.ndarray]) -> np.ndarray:
    """One key per held-out document: (day number, index of the document that day)."""
    return split["day"].astype(np.int64) * KEY_STRIDE + split["doc"]


def _ci(lp: np.ndarray, keys: np.ndarray, cfg: EvalConfig) -> list[float] | None:
    if not lp.size:
        return None
    lo, hi = ci(lp, keys, resamples=cfg.bootstrap_resamples)
    return [lo, hi]


def _memory_bytes(entries: int, cache: TokenCache) -> int:
    """Bytes of the datastore's entries: float16 key, int32 value, provenance (doc, pos, day)."""
    return entries * (2 * cache.encoder.dim + 4 + 8 + 4 + 4)


def _apply_trime(run: PolicyRun, cfg: EvalConfig) -> float:
    """Pick tau on dev and make its TRIME column the "LM" log-probability of both splits.

    The external memory is then interpolated with that distribution (TRIME App. A).
    """
    assert cfg.trime is not None
    best: tuple[float, int] | None = None
    for c in range(len(cfg.trime.taus)):
        dev = {**run.dev, "target_lm_logprob": run.dev["trime"][:, c]}
        p = tune(dev, cfg.grid)[1] if run.name != "bare" else ppl(dev["target_lm_logprob"])
        if best is None or p < best[0]:
            best = (p, c)
    assert best is not None
    c = best[1]
    run.dev["target_lm_logprob"] = run.dev["trime"][:, c]
    run.test["target_lm_logprob"] = run.test["trime"][:, c]
    return cfg.trime.taus[c]


def _calibrated_test(
    run: PolicyRun, params: KnnParams, cfg: EvalConfig
) -> tuple[np.ndarray, dict[str, Any]]:
    """Test log-probabilities with the calibrator trained day by day on dev (memlm.calibrator)."""
    from memlm.calibrator import calibrate_stream, gate_config

    gate = gate_config() if cfg.gate_theta > 0 else None
    res = calibrate_stream(run.dev, run.test, params, gate=gate, theta=cfg.gate_theta)
    valid = has_neighbours(np.where(run.test["values"] >= 0, 0, -1))
    return res.logprobs, {
        "constant_lambda_test_ppl": ppl(token_logprobs(run.test, params)),
        "mean_calibrated_lambda": float(res.lambdas[valid].mean()) if valid.any() else 0.0,
        "searches_skipped": res.skipped_share,
    }


def _evidence_test(run: PolicyRun, params: KnnParams) -> tuple[np.ndarray, dict[str, Any]]:
    """Test log-probabilities with the evidence interpolation fitted day by day on dev
    (memlm.calibrator.evidence.stream), at the k tuned on dev."""
    from memlm.calibrator.constant import SERVED_GRID
    from memlm.calibrator.evidence import stream

    temps = tuple(sorted({*SERVED_GRID.temperatures, params.temperature}))
    lp, lam, days = stream(run.dev, run.test, params.k, temps)
    valid = has_neighbours(np.where(run.test["values"][:, : params.k] >= 0, 0, -1))
    return lp, {
        "constant_lambda_test_ppl": ppl(token_logprobs(run.test, params)),
        "mean_evidence_lambda": float(lam[valid].mean()) if valid.any() else 0.0,
        "evidence_last_day": days[-1] if days else None,
    }


def _served_test(
    run: PolicyRun,
    params: KnnParams,
    cfg: EvalConfig,
    plans: Sequence[DayPlan],
    cache: TokenCache,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Test log-probabilities under what the service's builds would serve, evening by
    evening (memlm.evaluate.served); the dev tokens with their seen view are kept on
    ``run`` for the out-of-domain table."""
    from memlm.evaluate.served import served_stream, with_seen_view

    run.dev = with_seen_view(run.dev, plans, cache)
    grid, default = served_grid(cfg)
    lp, lam, days = served_stream(
        run.dev,
        run.test,
        grid,
        default,
        cache.encoder.vocab_size,
        min_tokens=cfg.calibrator_min_tokens,
    )
    valid = has_neighbours(np.where(run.test["values"] >= 0, 0, -1))
    sources = [d["lambda_source"] for d in days]
    return lp, {
        "constant_lambda_test_ppl": ppl(token_logprobs(run.test, params)),
        "mean_served_lambda": float(lam[valid].mean()) if valid.any() else 0.0,
        "served_days": days,
        "served_last_day": sources[-1] if sources else None,
        "combined_days": sources.count("combined"),
    }


def plans_day_month(day_num: int) -> str:
    d = EPOCH + dt.timedelta(days=int(day_num))
    return f"{d.year:04d}-{d.month:02d}"


def _with_ci(p: float, ci_: list[float] | None) -> str:
    return f"{p:.2f}" if not ci_ else f"{p:.2f} ({ci_[0]:.2f}-{ci_[1]:.2f})"


def _share(r: dict[str, Any], other: str) -> str:
    w = r.get("win_share", {}).get(other)
    return "-" if w is None else f"{w:.0%}"


def _memory_sentence(memory: dict[str, Any] | None) -> str:
    """Where the memories lived, when not in the faiss files (the default says nothing)."""
    if not memory or memory.get("backend", "faiss") == "faiss":
        return ""
    index = memory.get("index", "auto")
    return (
        f" Memory: {memory['backend']} ({memory['url']}, index {index}), one collection a policy."
    )


def render_markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    sl = s["slice"]
    lines = [
        f"# memlm eval: {s['corpus']} with {s['model']}",
        "",
        f"{sl['days']} days ({sl['first_day']} .. {sl['last_day']}), {sl['train_documents']} ingested "
        f"documents, {sl['dev_documents']} dev / {sl['test_documents']} test documents; window "
        f"{s['window']['context']} tokens, stride {s['window']['stride']}; k, T, lambda tuned on dev; "
        f"lambda: {s.get('lambda_mode', 'constant')}"
        + (
            f" (NN calibrator, gate theta {s['gate_theta']:g})"
            if s.get("lambda_mode") == "calibrated"
            else ""
        )
        + "."
        + _memory_sentence(s.get("memory")),
        "",
        "| policy | test ppl (95% CI) | dev ppl | MemRate | entries | datastore MB | tokens seen "
        "| lambda | T | k | wins vs FullMem | wins vs RandMem |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in report["results"].items():
        lines.append(
            f"| {name} | {_with_ci(r['test_ppl'], r.get('test_ppl_ci95'))} | {r['dev_ppl']:.2f} "
            f"| {r['memrate']:.1%} | {r['entries']} | {r.get('bytes', 0) / 1e6:.1f} "
            f"| {r['tokens_seen']} | {r['lambda']:g} | {r['temperature'] or '-'} | {r['k'] or '-'} "
            f"| {_share(r, 'fullmem')} | {_share(r, 'randmem')} |"
        )
    alone = {n: r for n, r in report["results"].items() if "memrate_lm_alone" in r}
    if alone:
        cells = [
            f"{n} {r['memrate_lm_alone']:.1%} (the memory spared "
            f"{100 * (r['memrate_lm_alone'] - r['memrate']):.1f} points)"
            for n, r in alone.items()
        ]
        lines += [
            "",
            "MemRate deciding on the LM alone, as with an empty memory: " + "; ".join(cells) + ".",
        ]
    if s.get("lambda_mode") == "calibrated":
        lines += ["", "Constant lambda (tuned on dev) for the same policies:", ""]
        lines += ["| policy | test ppl (95% CI) |", "|---|---:|"]
        for name, r in report["results"].items():
            if "constant_lambda_test_ppl" in r:
                ci_ = r.get("constant_lambda_test_ppl_ci95")
                lines.append(f"| {name} | {_with_ci(r['constant_lambda_test_ppl'], ci_)} |")
    if s.get("trime"):
        t = s["trime"]
        memory = "local" + (
            f" + {t['long_segments']} earlier windows" if t["long_segments"] else ""
        )
        taus = ", ".join(f"{n} {r['tau']:g}" for n, r in report["results"].items())
        lines += ["", f"TRIME memory in the LM's softmax: {memory}; tau tuned on dev: {taus}."]
    months = sorted({m for r in report["results"].values() for m in r["test_ppl_per_month"]})
    if months:
        lines += ["", "Test perplexity per month:", "", "| policy | " + " | ".join(months) + " |"]
        lines.append("|---|" + "---:|" * len(months))
        for name, r in report["results"].items():
            cells = [f"{r['test_ppl_per_month'].get(m, float('nan')):.2f}" for m in months]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += sections(report)
    lines += ["", f"Total time {s['seconds']} s."]
    return "\n".join(lines) + "\n"


def plots(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_day = report["per_day"]
    policies = [p for p in per_day if p != "bare"]
    specs = [
        ("memrate.png", "cumulative MemRate", lambda r: r["memrate_cumulative"], policies),
        ("memory_growth.png", "entries in memory", lambda r: r["entries"], policies),
        ("perplexity.png", "test perplexity so far", lambda r: r["test_ppl_so_far"], list(per_day)),
        (
            "memrate_daily.png",
            "MemRate of the day",
            lambda r: r.get("memrate_day", 0.0),
            [p for p in ("monim", "monim-amt") if p in per_day],
        ),
    ]
    for fname, ylabel, fn, names in specs:
        if not names:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for name in names:
            rows = per_day[name]
            xs = range(1, len(rows) + 1)
            line = ax.plot(xs, [fn(r) for r in rows], marker="o", ms=3, label=name)[0]
            if fname == "memrate_daily.png" and all("memrate_day_lm_alone" in r for r in rows):
                ys = [r["memrate_day_lm_alone"] for r in rows]
                ax.plot(xs, ys, "--", color=line.get_color(), label=f"{name}, LM alone")
        days = [r["day"][5:] for r in per_day[names[0]]] if names else []
        ax.set_xticks(range(1, len(days) + 1), days, rotation=45, fontsize=8)
        ax.set_xlabel("stream day (MM-DD)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
    extra_plots(report, out)
