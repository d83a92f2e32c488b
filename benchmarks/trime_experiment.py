"""TRIME on the news stream: vanilla vs TrimeLM vs TrimeLM_long vs TrimeLM_ext (+ w/o BM25).

Same model (LlamaConfig, hidden 128, 8 layers, SmolLM2 tokenizer, tied embeddings), same
training slice cut into full rows of the document stream, same steps and seed for every
run; only the objective and the batching differ. Each model is then evaluated (Table 7 of
the paper) with no memory, local memory, local + long-term memory, and local + long-term
+ external memory (a datastore of the model's own keys over a slice of the training split,
FullMem or MoNIM), with tau, the number of long-term segments, the external temperature
and lambda tuned on dev. docs/trime.md has the commands and the results.

    python benchmarks/trime_experiment.py train --run vanilla   # one run per call
    python benchmarks/trime_experiment.py eval --run vanilla    # writes OUT/RUN/eval.json
    python benchmarks/trime_experiment.py table                 # the tables, from eval.json
    python benchmarks/trime_experiment.py diagnose              # loss curves, memory share

Runs: vanilla, trime, trime-long, trime-ext, trime-ext-random (the "w/o BM25" ablation).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from _common import markdown_table

from memlm.knnlm.trime import interpolate, memory_gold_logprob
from memlm.research.data import (
    EncodedCorpus,
    EncodedSplits,
    load_encoded_splits,
    make_segments,
    stream_segments,
)
from memlm.research.transformer_train import (
    ModelConfig,
    SegmentOutputs,
    TrainConfig,
    build_model,
    encode_segments,
    memory_logprobs,
    parameter_counts,
    perplexity,
    segment_texts,
    set_threads,
    train,
)

RUNS: dict[str, dict[str, Any]] = {
    "vanilla": {"objective": "vanilla"},
    "trime": {"objective": "trime"},
    "trime-long": {"objective": "trime-long"},
    "trime-ext": {"objective": "trime-ext"},
    "trime-ext-random": {"objective": "trime-ext", "bm25": False},
}
# The memory each model is meant for (paper Table 1).
MEANT_FOR = {
    "vanilla": "none",
    "trime": "local",
    "trime-long": "local+long",
    "trime-ext": "local+long+ext(FullMem)",
    "trime-ext-random": "local+long+ext(FullMem)",
}

TAUS = [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0]
LONG_SEGMENTS = [1, 2, 4, 8, 16]
EXT_TEMPS = [0.5, 1.0, 2.0, 4.0]
LAMBDAS = [0.05, 0.1, 0.2, 0.3, 0.5]
TAU_EXT6 = [None, 1.0, 2.0, 4.0, 8.0]  # None: retrieved entries only in Eq. 8-9
MONIM_DELTA = -1.5  # MoNIM's default threshold (memlm.knnlm.policy.DEFAULT_DELTA)


@dataclass(frozen=True)
class Setup:
    # 825k targets: 6,440 rows of 128, one epoch of 805 batches of 8 (800 steps use 99%)
    train_tokens: int = 825_000
    dev_tokens: int = 20_000
    test_tokens: int = 40_000
    datastore_tokens: int = 100_000  # external memory: this much of the training slice
    k: int = 64  # retrieved external neighbours per query
    seg_len: int = 128
    batch_segments: int = 8
    steps: int = 800  # about 1,400 CPU-seconds a run on one thread (docs/trime.md)
    lr: float = 2e-3
    hidden: int = 128
    layers: int = 8  # the paper's 7M ablation model: 8 layers, hidden 128, 4 heads, FFN 512
    heads: int = 4
    seed: int = 0
    vanilla_frac: float = 0.05  # §5.2: the first 5% of the updates use the plain LM loss

    def model_config(self) -> ModelConfig:
        return ModelConfig(
            hidden=self.hidden, layers=self.layers, heads=self.heads, ffn=4 * self.hidden
        )


def load_data(s: Setup) -> tuple[EncodedSplits, EncodedCorpus, EncodedCorpus, EncodedCorpus]:
    splits = load_encoded_splits(corpus="news", tokenizer="subword", seed=s.seed)
    return (
        splits,
        splits.train.truncate_tokens(s.train_tokens),
        splits.dev.truncate_tokens(s.dev_tokens),
        splits.test.truncate_tokens(s.test_tokens),
    )


def train_run(name: str, out: Path, s: Setup) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from memlm.encoder import bundled_tokenizer_path

    splits, train_c, _, _ = load_data(s)
    cfg = TrainConfig(
        seg_len=s.seg_len,
        batch_segments=s.batch_segments,
        steps=s.steps,
        lr=s.lr,
        seed=s.seed,
        save_every=100,
        vanilla_frac=s.vanilla_frac,
        **RUNS[name],
    )
    model = build_model(
        s.model_config(), splits.tokenizer.vocab_size, splits.tokenizer.boundary_id, s.seed
    )
    # full rows of the document stream, a multiple of B: every batch holds B * L targets
    segs = stream_segments(train_c, cfg.seg_len, rows_multiple=cfg.batch_segments)
    t0 = time.process_time()
    texts = (
        segment_texts(segs, splits.tokenizer.decode)
        if cfg.objective == "trime-ext" and cfg.bm25
        else None
    )
    result = train(
        model,
        segs,
        cfg,
        out / name,
        tokenizer=AutoTokenizer.from_pretrained(bundled_tokenizer_path()),
        texts=texts,
    )
    last = result.history[-max(1, len(result.history) // 10) :]
    info = {
        "run": name,
        "setup": asdict(s),
        "parameters": parameter_counts(model),
        "segments": len(segs),
        "epochs": round(s.steps * s.batch_segments / len(segs), 3),
        "train_tokens_seen": result.tokens,
        "wall_seconds": round(result.seconds, 1),
        # BM25 packing (trime-ext) and the training loop; not loading the data
        "cpu_seconds": round(time.process_time() - t0, 1),
        "process_cpu_seconds": round(time.process_time(), 1),
        "resumed_from": result.resumed_from,
        "final_loss": result.history[-1]["loss"],
        # mean over the last 10% of the steps (TRIME losses include the memory)
        "loss_last_10pct": round(sum(h["loss"] for h in last) / len(last), 4),
    }
    (out / name / "train_info.json").write_text(json.dumps(info, indent=2))
    return info


# --- evaluation -----------------------------------------------------------------------------


def retrieve(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, k: int, chunk: int = 2048
):
    """Exact top-k by scaled dot product: (N, k) raw scores q.k/sqrt(d) and their values."""
    d = queries.shape[1]
    sc, vs = [], []
    for a in range(0, len(queries), chunk):
        s = queries[a : a + chunk] @ keys.T / math.sqrt(d)
        top = torch.topk(s, min(k, keys.shape[0]), dim=1)
        sc.append(top.values)
        vs.append(values[top.indices])
    return torch.cat(sc), torch.cat(vs)


def eq6_with_ext(
    o: SegmentOutputs,
    long_s: int | None,
    tau: float,
    seg_len: int,
    raw: torch.Tensor,
    vals: torch.Tensor,
    tau_ext: float | None,
) -> torch.Tensor:
    """Eq. 6 over local + long memory, plus the retrieved entries (Eq. 7) at tau_ext.

    tau_ext None leaves the retrieved entries out of Eq. 6 (they then enter only
    through Eq. 8-9); tuned on dev, since the retrieved similarities are distributed
    differently from the in-batch ones the model was trained with (App. A).
    """
    if tau_ext is None:
        return memory_logprobs(o, long_s, tau, seg_len)
    return memory_logprobs(o, long_s, tau, seg_len, extra_scores=raw / tau_ext, extra_values=vals)


def eq89(
    o: SegmentOutputs,
    p6: torch.Tensor,
    raw: torch.Tensor,
    vals: torch.Tensor,
    et: float,
    lam: float,
) -> torch.Tensor:
    """Eq. 8 over the retrieved entries at temperature et, interpolated with p6 (Eq. 9)."""
    p8, has = memory_gold_logprob(raw / et, vals, o.targets)
    return interpolate(p6, p8, lam, has)


def evaluate_model(name: str, out: Path, s: Setup, data: tuple) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    _, train_c, dev_c, test_c = data
    model = AutoModelForCausalLM.from_pretrained(out / name / "model")
    dev = encode_segments(model, make_segments(dev_c, s.seg_len))
    test = encode_segments(model, make_segments(test_c, s.seg_len))
    store = encode_segments(
        model, make_segments(train_c.truncate_tokens(s.datastore_tokens), s.seg_len)
    )
    store_lp = store.gold_logit - store.lse
    monim = store_lp < MONIM_DELTA  # MoNIM(loss) with the model itself as the scorer
    stores = {
        "FullMem": (store.keys, store.targets),
        "MoNIM": (store.keys[monim], store.targets[monim]),
    }
    res: dict[str, Any] = {"run": name, "memrate_monim": float(monim.float().mean())}
    ppl: dict[str, float] = {"none": perplexity(test.gold_logit - test.lse)}
    tuned: dict[str, Any] = {}
    # local memory: tau on dev
    tau_l = min(TAUS, key=lambda t: perplexity(memory_logprobs(dev, 0, t, s.seg_len)))
    ppl["local"] = perplexity(memory_logprobs(test, 0, tau_l, s.seg_len))
    tuned["local"] = {"tau": tau_l}
    # local + long: (segments, tau) on dev
    best = min(
        itertools.product(LONG_SEGMENTS, TAUS),
        key=lambda st: perplexity(memory_logprobs(dev, st[0], st[1], s.seg_len)),
    )
    ppl["local+long"] = perplexity(memory_logprobs(test, best[0], best[1], s.seg_len))
    tuned["local+long"] = {"segments": best[0], "tau": best[1]}
    for store_name, (keys, vals) in stores.items():
        d_raw, d_val = retrieve(dev.keys, keys, vals, s.k)
        t_raw, t_val = retrieve(test.keys, keys, vals, s.k)
        # the external memory alone on top of the bare model (kNN-LM style, Eq. 8-9)
        grid = list(itertools.product(EXT_TEMPS, LAMBDAS))
        et, lam = min(grid, key=lambda g: perplexity(_ext_only(dev, d_raw, d_val, g[0], g[1])))
        ppl[f"ext({store_name})"] = perplexity(_ext_only(test, t_raw, t_val, et, lam))
        tuned[f"ext({store_name})"] = {"ext_temp": et, "lambda": lam}
        segs_, tau_ = best
        scored = []
        for tau_ext in TAU_EXT6:
            p6 = eq6_with_ext(dev, segs_, tau_, s.seg_len, d_raw, d_val, tau_ext)
            for et, lam in itertools.product(EXT_TEMPS, [0.0, *LAMBDAS]):
                scored.append((perplexity(eq89(dev, p6, d_raw, d_val, et, lam)), tau_ext, et, lam))
        _, tau_ext, et2, lam2 = min(scored, key=lambda r: r[0])
        p6_test = eq6_with_ext(test, segs_, tau_, s.seg_len, t_raw, t_val, tau_ext)
        ppl[f"local+long+ext({store_name})"] = perplexity(
            eq89(test, p6_test, t_raw, t_val, et2, lam2)
        )
        tuned[f"local+long+ext({store_name})"] = {
            "segments": segs_,
            "tau": tau_,
            "tau_ext_in_eq6": tau_ext,
            "ext_temp": et2,
            "lambda": lam2,
        }
    res["test_ppl"] = ppl
    res["tuned_on_dev"] = tuned
    res["test_tokens"] = len(test.targets)
    res["dev_tokens"] = len(dev.targets)
    res["datastore_entries"] = {k: int(v[0].shape[0]) for k, v in stores.items()}
    return res


def _ext_only(o: SegmentOutputs, raw: torch.Tensor, vals: torch.Tensor, et: float, lam: float):
    lm = o.gold_logit - o.lse
    p8, has = memory_gold_logprob(raw / et, vals, o.targets)
    return interpolate(lm, p8, lam, has)


@torch.inference_mode()
def diagnose(name: str, out: Path, s: Setup, data: tuple) -> dict[str, Any]:
    """Training loss per 100 steps, and how much of Eq. 6's denominator the local memory takes.

    The share is exp(LSE of the memory scores) / (that + exp(LSE of the logits)) at tau = 1
    (the training scale), averaged over the dev positions that have a local memory.
    """
    from transformers import AutoModelForCausalLM

    from memlm.research.transformer_train import forward_with_keys, latest_checkpoint

    _, _, dev_c, _ = data
    ckpt = latest_checkpoint(out / name)
    assert ckpt is not None, f"no checkpoint under {out / name}"
    state = torch.load(ckpt / "trainer_state.pt", map_location="cpu", weights_only=True)
    history = state["history"]
    losses = [h["loss"] for h in history]
    per_100 = [
        round(sum(losses[a : a + 100]) / len(losses[a : a + 100]), 3)
        for a in range(0, len(losses), 100)
    ]
    model = AutoModelForCausalLM.from_pretrained(out / name / "model").eval()
    segs = make_segments(dev_c, s.seg_len)
    shares = []
    for a in range(0, len(segs), 16):
        logits, keys = forward_with_keys(model, torch.from_numpy(segs.x[a : a + 16]))
        lse = torch.logsumexp(logits, dim=-1)  # (b, L)
        sim = keys @ keys.transpose(1, 2) / math.sqrt(keys.shape[-1])  # (b, L, L)
        valid = torch.from_numpy(segs.valid[a : a + 16])
        earlier = torch.ones(s.seg_len, s.seg_len, dtype=torch.bool).tril(-1)
        vis = earlier.unsqueeze(0) & valid.unsqueeze(1) & valid.unsqueeze(2)
        mem = torch.logsumexp(sim.masked_fill(~vis, float("-inf")), dim=-1)
        has = vis.any(-1)
        shares.append(torch.sigmoid(mem - lse)[has])
    share = torch.cat(shares)
    res: dict[str, Any] = {
        "run": name,
        "train_loss_per_100_steps": per_100,
        "dev_local_memory_share": round(float(share.mean()), 3),
        "dev_positions": int(share.numel()),
    }
    if name == "trime-ext":  # how much of each stretch of the plan follows a BM25 neighbour
        from memlm.research.bm25_batching import bm25_neighbours, greedy_chain

        splits, train_c, _, _ = data
        rows = stream_segments(train_c, s.seg_len, rows_multiple=s.batch_segments)
        nb = bm25_neighbours(segment_texts(rows, splits.tokenizer.decode), 20)
        order = greedy_chain(nb, s.seed * 1000)  # epoch 0, as batch_plan seeds it
        follows = [order[i + 1] in nb[order[i]] for i in range(len(order) - 1)] + [False]
        span = 100 * s.batch_segments
        res["bm25_links_per_100_steps"] = [
            round(sum(follows[a : a + span]) / span, 3)
            for a in range(0, s.steps * s.batch_segments, span)
        ]
    return res


# --- inference side on the frozen SmolLM2: the news slice ---------------------------------


NEWS_LONG_SEGMENTS = [1, 2, 4]
NEWS_TAUS = [
    0.02,
    0.03,
    0.05,
    0.07,
    0.1,
    0.14,
    0.2,
    0.3,
    0.5,
    1.0,
    2.0,
]  # SmolLM2 sims ~2-3.5, lse ~12-31


def news_slice(out: Path, days: int, start: str, max_docs: int) -> dict[str, Any]:
    """Bare, continuous cache, + long-term, + external (FullMem / MoNIM) on SmolLM2-135M.

    Uses the evaluation harness's pieces (stream plan, cached encoder outputs, policy
    runs with the datastore and FAISS index); local / long-term memory come from
    :func:`memlm.knnlm.trime.cached_doc_logprobs`; tau, the long-term span and the
    kNN (k, T, lambda) are tuned on the dev documents and applied to the test documents.
    """
    import datetime as dt

    import numpy as np

    from memlm.corpus import load_news
    from memlm.encoder import Encoder, WindowConfig
    from memlm.evaluate import (
        TokenCache,
        TuneGrid,
        plan_stream,
        ppl,
        run_policy,
        token_logprobs,
        tune,
    )
    from memlm.knnlm import KnnParams
    from memlm.knnlm.policy import make_policy
    from memlm.knnlm.trime import cached_doc_logprobs

    t0 = time.time()
    encoder = Encoder.load("smollm2-135m")
    window = WindowConfig()
    plans = plan_stream(
        load_news(), days=days, start=dt.date.fromisoformat(start), max_docs_per_day=max_docs
    )
    cache = TokenCache(encoder, window)
    runs = {}
    for name in ("bare", "fullmem", "monim"):
        policy = None if name == "bare" else make_policy(name)
        runs[name] = run_policy(
            policy, plans, cache, out / "news-work" / name, ingest_params=KnnParams(), k_max=256
        )
    # TRIME local / long-term log-probs of the held-out tokens, in the harness's row order
    spans = {"local": 0, **{f"long{sg}": sg * window.context for sg in NEWS_LONG_SEGMENTS}}
    cols: dict[str, dict[str, list[np.ndarray]]] = {"dev": {}, "test": {}}
    for plan in plans:
        for split, docs in (("dev", plan.dev), ("test", plan.test)):
            for o, d in zip(cache.get_many([x.text for x in docs]), docs, strict=True):
                n_tok = len(encoder.tokenize(d.text))
                wins = window.windows(n_tok)
                for key, span in spans.items():
                    lp = cached_doc_logprobs(
                        o.keys,
                        o.targets,
                        o.target_logprob,
                        o.lse,
                        o.positions,
                        wins,
                        span,
                        NEWS_TAUS,
                    )
                    cols[split].setdefault(key, []).append(lp)
    mem = {sp: {k: np.concatenate(v) for k, v in c.items()} for sp, c in cols.items()}
    bare_dev, bare_test = runs["bare"].dev, runs["bare"].test
    assert len(mem["dev"]["local"]) == len(bare_dev["gold"])
    table: dict[str, Any] = {"bare": {"test_ppl": ppl(bare_test["target_lm_logprob"])}}

    def best_col(key: str) -> int:
        return int(np.argmin([ppl(mem["dev"][key][:, c]) for c in range(len(NEWS_TAUS))]))

    c = best_col("local")
    table["continuous cache (local)"] = {
        "test_ppl": ppl(mem["test"]["local"][:, c]),
        "tau": NEWS_TAUS[c],
    }
    long_key = min(
        (k for k in spans if k != "local"), key=lambda k: ppl(mem["dev"][k][:, best_col(k)])
    )
    lc = best_col(long_key)
    table["+ long-term"] = {
        "test_ppl": ppl(mem["test"][long_key][:, lc]),
        "tau": NEWS_TAUS[lc],
        "long_segments": spans[long_key] // window.context,
    }
    grid = TuneGrid()
    for name in ("fullmem", "monim"):
        run = runs[name]
        params, _ = tune(run.dev, grid)
        table[f"kNN-LM {name} (no local/long)"] = {
            "test_ppl": ppl(token_logprobs(run.test, params)),
            "memrate": run.memrate,
            **{f"knn_{k}": v for k, v in params.__dict__.items()},
        }
        dev = {**run.dev, "target_lm_logprob": mem["dev"][long_key][:, lc]}
        test = {**run.test, "target_lm_logprob": mem["test"][long_key][:, lc]}
        params, _ = tune(dev, grid)
        table[f"+ long-term + external {name}"] = {
            "test_ppl": ppl(token_logprobs(test, params)),
            "memrate": run.memrate,
            **{f"knn_{k}": v for k, v in params.__dict__.items()},
        }
    return {
        "days": days,
        "start": start,
        "max_docs_per_day": max_docs,
        "window": {"context": window.context, "stride": window.stride},
        "dev_tokens": int(len(bare_dev["gold"])),
        "test_tokens": int(len(bare_test["gold"])),
        "ingested_tokens": runs["bare"].tokens_seen,
        "seconds": round(time.time() - t0, 1),
        "rows": table,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("phase", choices=["train", "eval", "table", "diagnose", "news"])
    ap.add_argument("--run", choices=list(RUNS), action="append")
    ap.add_argument("--out", type=Path, default=Path("runs/trime"))
    ap.add_argument("--steps", type=int, default=Setup.steps)
    ap.add_argument("--train-tokens", type=int, default=Setup.train_tokens)
    ap.add_argument("--dev-tokens", type=int, default=Setup.dev_tokens)
    ap.add_argument("--test-tokens", type=int, default=Setup.test_tokens)
    ap.add_argument("--datastore-tokens", type=int, default=Setup.datastore_tokens)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=Setup.hidden)
    ap.add_argument("--layers", type=int, default=Setup.layers)
    ap.add_argument("--heads", type=int, default=Setup.heads)
    ap.add_argument("--batch-segments", type=int, default=Setup.batch_segments)
    ap.add_argument("--seg-len", type=int, default=Setup.seg_len)
    ap.add_argument("--lr", type=float, default=Setup.lr)
    ap.add_argument(
        "--vanilla-frac",
        type=float,
        default=Setup.vanilla_frac,
        help="share of the first updates trained with the plain LM loss (TRIME runs)",
    )
    ap.add_argument("--days", type=int, default=5, help="news phase: days of the stream")
    ap.add_argument("--start", default="2017-02-13", help="news phase: first day")
    ap.add_argument("--max-docs-per-day", type=int, default=20, help="news phase")
    args = ap.parse_args()
    set_threads(args.threads)
    s = Setup(
        steps=args.steps,
        train_tokens=args.train_tokens,
        dev_tokens=args.dev_tokens,
        test_tokens=args.test_tokens,
        datastore_tokens=args.datastore_tokens,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        batch_segments=args.batch_segments,
        seg_len=args.seg_len,
        lr=args.lr,
        vanilla_frac=args.vanilla_frac,
    )
    runs = args.run or list(RUNS)
    if args.phase == "news":
        res = news_slice(args.out, args.days, args.start, args.max_docs_per_day)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "news_slice.json").write_text(json.dumps(res, indent=2))
        print(json.dumps(res, indent=2))
        print("\n| memory | test ppl | tuned on dev |\n|---|---|---|")
        for row, r in res["rows"].items():
            extra = ", ".join(f"{k}={v:.3g}" for k, v in r.items() if k != "test_ppl")
            print(f"| {row} | {r['test_ppl']:.2f} | {extra} |")
        return
    if args.phase == "train":
        for r in runs:
            print(json.dumps(train_run(r, args.out, s)), flush=True)
        return
    if args.phase == "diagnose":
        data = load_data(s)
        print("\n| run | training loss, mean per 100 steps | local memory share of Eq. 6 on dev |")
        print("|---|---|---:|")
        for r in runs:
            d = diagnose(r, args.out, s, data)
            (args.out / r / "diagnose.json").write_text(json.dumps(d, indent=2))
            curve = ", ".join(f"{x:.2f}" for x in d["train_loss_per_100_steps"])
            print(f"| {LABELS[r]} | {curve} | {d['dev_local_memory_share']:.3f} |", flush=True)
            if "bm25_links_per_100_steps" in d:
                links = ", ".join(f"{x:.3f}" for x in d["bm25_links_per_100_steps"])
                print(f"|   (BM25 chain links to a neighbour, per 100 steps) | {links} | |")
        return
    if args.phase == "table":  # the tables again, from the eval.json files
        print_tables([json.loads((args.out / r / "eval.json").read_text()) for r in runs])
        return
    data = load_data(s)
    rows = []
    for r in runs:
        t0, c0 = time.time(), time.process_time()
        res = evaluate_model(r, args.out, s, data)
        res["eval_seconds"] = round(time.time() - t0, 1)
        res["eval_cpu_seconds"] = round(time.process_time() - c0, 1)
        info_path = args.out / r / "train_info.json"
        res["train"] = json.loads(info_path.read_text()) if info_path.exists() else None
        (args.out / r / "eval.json").write_text(json.dumps(res, indent=2))
        rows.append(res)
        print(json.dumps(res), flush=True)
    print_tables(rows)


COLUMNS = [
    "none",
    "local",
    "local+long",
    "ext(FullMem)",
    "ext(MoNIM)",
    "local+long+ext(FullMem)",
    "local+long+ext(MoNIM)",
]
LABELS = {
    "vanilla": "vanilla",
    "trime": "TrimeLM",
    "trime-long": "TrimeLM_long",
    "trime-ext": "TrimeLM_ext",
    "trime-ext-random": "TrimeLM_ext w/o BM25 batching",
}


def print_tables(rows: list[dict[str, Any]]) -> None:
    """Markdown: training cost, then test perplexity (the intended memory in bold)."""
    cost = []
    for res in rows:
        t = res["train"]
        cost.append(
            (
                LABELS[res["run"]],
                f"{t['train_tokens_seen']:,}",
                t["epochs"],
                f"{t['cpu_seconds']:.0f}",
                f"{t['wall_seconds']:.0f}",
                f"{t['loss_last_10pct']:.3f}",
            )
        )
    header = ["run", "targets seen", "epochs", "CPU s", "wall s", "loss, last 10% of steps"]
    print()
    print(markdown_table(header, cost))
    ppl = []
    for res in rows:
        cells = [
            f"**{res['test_ppl'][c]:.1f}**"
            if c == MEANT_FOR[res["run"]]
            else f"{res['test_ppl'][c]:.1f}"
            for c in COLUMNS
        ]
        ppl.append((LABELS[res["run"]], *cells, f"{res['eval_cpu_seconds']:.0f}"))
    print()
    print(markdown_table(["model", *COLUMNS, "eval CPU s"], ppl))


if __name__ == "__main__":
    main()
