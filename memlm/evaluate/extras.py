"""The report's sections beyond the table: forgetting, name tokens, wall time per phase."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from memlm.calibrator.constant import TuneGrid, ppl, token_logprobs
from memlm.evaluate import forgetting
from memlm.evaluate.cache import TokenCache
from memlm.evaluate.config import EvalConfig, served_grid
from memlm.evaluate.names import name_words, pieces_of, summarise, top1_correct
from memlm.evaluate.plan import DayPlan
from memlm.evaluate.records import PolicyRun
from memlm.knnlm import KnnParams

NAME_SYSTEMS = ("bare", "fullmem", "monim")


def _params(report: dict[str, Any], name: str) -> KnnParams:
    r = report["results"][name]
    if name == "bare" or not r["lambda"]:
        return KnnParams(lmbda=0.0)
    return KnnParams(k=r["k"], temperature=r["temperature"], lmbda=r["lambda"])


def _months(run: PolicyRun) -> np.ndarray:
    from memlm.evaluate.report import plans_day_month

    return np.array([plans_day_month(d) for d in run.test["day"]])


def add_forgetting(
    report: dict[str, Any], runs: dict[str, PolicyRun], workroot: Path, grid: TuneGrid
) -> None:
    """report["forgetting"]: {policy: {month-end: {test month: ppl}}} (constant lambda)."""
    out: dict[str, Any] = {}
    for name, run in runs.items():
        if not (workroot / name / "rescore").exists():
            continue
        months = _months(run)
        out[name] = forgetting.table(
            workroot / name, grid, _params(report, name), run.test["target_lm_logprob"], months
        )
        if "bare" in runs and "bare" not in out:
            lm = runs["bare"].test["target_lm_logprob"]
            row = {m: ppl(lm[months == m]) for m in sorted(set(months.tolist()))}
            out["bare"] = {end: row for end in out[name]}
    report["forgetting"] = out or None


def name_tokens(
    cfg: EvalConfig,
    plans: Sequence[DayPlan],
    runs: dict[str, PolicyRun],
    report: dict[str, Any],
    cache: TokenCache,
) -> dict[str, Any] | None:
    """Top-1 accuracy and perplexity on the test set's name tokens (constant lambda)."""
    systems = [s for s in NAME_SYSTEMS if s in runs]
    if cfg.trime is not None or not systems:
        return None
    enc = cache.encoder
    pieces = pieces_of(enc.tokenizer, enc.vocab_size)
    first_seen: dict[str, int] = {}
    is_name, seen, correct = [], [], {s: [] for s in systems}  # type: ignore[var-annotated]
    params = {s: _params(report, s) for s in systems}
    lps = {s: token_logprobs(runs[s].test, params[s]) for s in systems}
    row = 0
    for day_index, p in enumerate(plans):
        for d in p.train:
            for w in name_words(enc.tokenize(d.text), pieces).values():
                first_seen.setdefault(w, day_index)
        for d, o in zip(p.test, cache.get_many([d.text for d in p.test]), strict=True):
            words = name_words(enc.tokenize(d.text), pieces)
            mask = np.array([int(q) in words for q in o.positions], bool)
            is_name.append(mask)
            seen.append(
                np.array(
                    [
                        int(q) in words and first_seen.get(words[int(q)], 1 << 30) <= day_index
                        for q in o.positions
                    ],
                    bool,
                )
            )
            rows = np.arange(len(o))
            sl = slice(row, row + len(o))
            for s in systems:
                t = runs[s].test
                if s == "bare" or params[s].lmbda == 0.0:
                    correct[s].append(o.top_id == o.targets)
                else:
                    correct[s].append(
                        top1_correct(enc, o, rows, t["distances"][sl], t["values"][sl], params[s])
                    )
            row += len(o)
    assert row == len(lps[systems[0]]), (row, len(lps[systems[0]]))
    names = np.concatenate(is_name) if is_name else np.zeros(0, bool)
    seen_m = np.concatenate(seen) if seen else np.zeros(0, bool)
    masks = {"all tokens": np.ones(len(names), bool), "names": names, "names seen": seen_m}
    masks["names unseen"] = names & ~seen_m
    corr = {s: np.concatenate(c) if c else np.zeros(0, bool) for s, c in correct.items()}
    return {
        "definition": "first token of a capitalised word that does not begin a sentence; "
        "'seen': the word occurred as a name in a document ingested on or before the evening "
        "its test document was scored",
        "lambda": "constant (tuned on dev)",
        "subsets": summarise(lps, corr, masks),
    }


def ood_table(
    cfg: EvalConfig, runs: dict[str, PolicyRun], report: dict[str, Any], vocab_size: int
) -> dict[str, Any]:
    """{policy: {corpus: {ppl_constant, ppl_calibrated, vs_bare}}} after the whole stream."""
    from memlm.calibrator import calibrate_stream

    bare = {c: ppl(a["target_lm_logprob"]) for c, a in runs["bare"].ood.items()}
    out: dict[str, Any] = {"bare": {c: {"ppl": p} for c, p in bare.items()}}
    for name, run in runs.items():
        if name == "bare" or not run.ood:
            continue
        params = _params(report, name)
        row: dict[str, Any] = {}
        calibrated = lambdas = None
        both = {k: np.concatenate([a[k] for a in run.ood.values()]) for k in run.test}
        both = {k: v for k, v in both.items() if k != "trime"}
        if cfg.lambda_mode == "calibrated" and params.lmbda > 0:
            dev = {k: v for k, v in run.dev.items() if k != "trime"}
            calibrated = calibrate_stream(dev, both, params).logprobs
        elif cfg.lambda_mode == "evidence":
            # As the test tokens (report._evidence_test): the evidence serves even where the
            # constant tuned to 0, at the k tuned on dev; out-of-domain tokens carry days
            # after the last, so the fit is the one on all dev tokens.
            calibrated, lambdas = _evidence_ood(run, both, report["results"][name])
        elif cfg.lambda_mode == "served":
            calibrated, lambdas = _served_ood(cfg, run, both, report["results"][name], vocab_size)
        start = 0
        for corpus, a in run.ood.items():
            lp = token_logprobs(a, params) if params.lmbda > 0 else a["target_lm_logprob"]
            row[corpus] = {"ppl_constant": ppl(lp), "bare": bare[corpus]}
            row[corpus]["constant_vs_bare"] = row[corpus]["ppl_constant"] / bare[corpus] - 1
            if calibrated is not None:
                mode = "calibrated" if lambdas is None else cfg.lambda_mode
                c = ppl(calibrated[start : start + len(lp)])
                row[corpus] |= {f"ppl_{mode}": c, f"{mode}_vs_bare": c / bare[corpus] - 1}
            if lambdas is not None:
                part = slice(start, start + len(lp))
                found = both["values"][part, 0] >= 0
                row[corpus][f"mean_{cfg.lambda_mode}_lambda"] = (
                    float(lambdas[part][found].mean()) if found.any() else 0.0
                )
            start += len(lp)
        out[name] = row
    return out


def _evidence_ood(
    run: PolicyRun, tokens: dict[str, np.ndarray], result: dict[str, Any]
) -> tuple[np.ndarray, np.ndarray]:
    """Out-of-domain log-probs and lambdas of ``--lambda evidence``."""
    from memlm.calibrator.constant import SERVED_GRID
    from memlm.calibrator.evidence import stream

    temps = tuple(sorted({*SERVED_GRID.temperatures, result["temperature"]}))
    dev = {key: v for key, v in run.dev.items() if key != "trime"}
    lp, lam, _ = stream(dev, tokens, result["k"], temps)
    return lp, lam


def _served_ood(
    cfg: EvalConfig,
    run: PolicyRun,
    tokens: dict[str, np.ndarray],
    result: dict[str, Any],
    vocab_size: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Out-of-domain log-probs and lambdas of ``--lambda served``: the build after the last
    day (its tokens carry later days), from the dev tokens with their seen view."""
    from memlm.evaluate.served import served_stream

    grid, default = served_grid(cfg)
    lp, lam, _ = served_stream(
        run.dev, tokens, grid, default, vocab_size, min_tokens=cfg.calibrator_min_tokens
    )
    return lp, lam


def timing(
    runs: dict[str, PolicyRun], seconds: dict[str, float], cache: TokenCache, report_s: float
) -> dict[str, Any]:
    """Wall time and tokens/s of each phase."""

    def rate(n: float, s: float) -> float | None:
        return round(n / s, 1) if s > 0 else None

    out: dict[str, Any] = {
        "encode": {
            "seconds": round(cache.encode_seconds, 1),
            "tokens": cache.encoded_tokens,
            "tokens_per_s": rate(cache.encoded_tokens, cache.encode_seconds),
            "wait_seconds": round(cache.wait_seconds, 1),
        }
    }
    for name, run in runs.items():
        ingest = sum(d.ingest_seconds for d in run.days)
        held_out = int(run.dev["gold"].size + run.test["gold"].size)
        search = sum(d.search_seconds for d in run.days)
        # A resumed policy's days ran in an earlier process: their own wall time counts.
        days_s = sum(d.seconds for d in run.days)
        out[name] = {
            "seconds": round(max(seconds[name], days_s), 1),
            "ingest_seconds": round(ingest, 1),
            "ingest_tokens_per_s": rate(run.tokens_seen, ingest),
            "build_seconds": round(sum(d.build_seconds for d in run.days), 1),
            "held_out_search_seconds": round(search, 1),
            "held_out_tokens_per_s": rate(held_out, search),
            "encode_wait_seconds": round(sum(d.wait_seconds for d in run.days), 1),
        }
    out["report_seconds"] = round(report_s, 1)
    return out
