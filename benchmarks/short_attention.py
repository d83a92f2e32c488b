"""Short attention spans on the news stream: the table of Figure 2b/2c and the plot of Figure 3.

Trains, with the same parameter budget (theta_M of the baseline LSTM), the same data and
the same number of steps: LSTM; attention, key-value and key-value-predict with windows
1, 5, 10, 15; N-gram RNN with N = 2..5 (17 models).  Prints dev/test perplexity, the
paper's three findings checked on these numbers, and writes the average attention weight
per window position as a PNG.  Each model's metrics and checkpoint go under ``--out``;
a model whose metrics exist is not retrained (the run resumes).

    python benchmarks/short_attention.py --steps 500

With ``--knn-eval CHECKPOINT`` it instead runs the streaming evaluation (``memlm.evaluate``,
FullMem vs MoNIM) with a trained model as the LM, over the documents of the dev and test
splits only (the LM never trained on them; the harness splits them again by day into
ingested / dev / test documents):

    python benchmarks/short_attention.py --knn-eval runs/short-attention/kvp-5/model.pt
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from _common import markdown_table

from memlm.research.data import bptt_batches, load_encoded_splits
from memlm.research.lstm_models import (
    ShortSpanConfig,
    ShortSpanLM,
    count_parameters,
    hidden_for_budget,
)
from memlm.research.lstm_train import (
    TrainConfig,
    evaluate,
    save_checkpoint,
    set_threads,
    train_model,
)

WINDOWS = (1, 5, 10, 15)
ATTENTIVE = ("attention", "kv", "kvp")
LABEL = {"attention": "Attention", "kv": "Key-Value", "kvp": "Key-Value-Predict"}


def model_specs() -> list[tuple[str, str, dict[str, int]]]:
    specs: list[tuple[str, str, dict[str, int]]] = [("lstm", "lstm", {})]
    for arch in ATTENTIVE:
        specs += [(f"{arch}-{w}", arch, {"window": w}) for w in WINDOWS]
    specs += [(f"{n}-gram", "ngram", {"ngram": n}) for n in range(2, 6)]
    return specs


def train_all(args: argparse.Namespace) -> dict[str, dict[str, object]]:
    data = load_encoded_splits(vocab_size=args.vocab_size)
    train = data.train
    if args.max_train_tokens:
        train = train.truncate_tokens(args.max_train_tokens)
    dev, test = data.dev, data.test
    if args.max_eval_tokens:
        dev, test = (
            dev.truncate_tokens(args.max_eval_tokens),
            test.truncate_tokens(args.max_eval_tokens),
        )
    V = data.tokenizer.vocab_size
    budget = count_parameters(ShortSpanConfig("lstm", V, hidden=args.budget_hidden, emb=args.emb))
    print(
        f"data: train {train.n_targets} targets ({len(train)} docs), dev {dev.n_targets}, "
        f"test {test.n_targets}; vocab {V}; budget theta_M {budget}",
        flush=True,
    )
    tcfg = TrainConfig(steps=args.steps, seed=args.seed, log_every=args.steps)
    results: dict[str, dict[str, object]] = {}
    only = set(args.only.split(",")) if args.only else None
    for name, arch, kw in model_specs():
        if only is not None and name not in only:
            continue
        folder = args.out / name
        metrics = folder / "metrics.json"
        if metrics.exists():
            results[name] = json.loads(metrics.read_text(encoding="utf-8"))
            continue
        hidden = hidden_for_budget(budget, arch, V, emb=args.emb, **kw)
        cfg = ShortSpanConfig(arch, V, hidden=hidden, emb=args.emb, **kw)
        torch.manual_seed(args.seed)
        model = ShortSpanLM(cfg)
        res = train_model(model, train, tcfg)
        t0 = time.perf_counter()
        ev_dev, ev_test = evaluate(model, dev), evaluate(model, test)
        words = data.tokenizer.words  # type: ignore[attr-defined]
        save_checkpoint(
            model, folder / "model.pt", {"kind": "word", "words": words, "lowercase": True}
        )
        results[name] = {
            "name": name,
            "config": asdict(cfg),
            "params_no_embedding": count_parameters(cfg),
            "steps": res.steps,
            "train_tokens": res.tokens,
            "train_seconds": round(res.seconds, 1),
            "eval_seconds": round(time.perf_counter() - t0, 1),
            "final_train_loss": res.losses[-1] if res.losses else None,
            "dev_ppl": ev_dev.ppl,
            "test_ppl": ev_test.ppl,
            "dev_tokens": ev_dev.tokens,
            "test_tokens": ev_test.tokens,
            "test_attention": ev_test.attention,
            "test_attention_tokens": ev_test.attention_tokens,
        }
        metrics.write_text(json.dumps(results[name], indent=2), encoding="utf-8")
        print(
            f"{name:>12s}  H={hidden:4d}  dev {ev_dev.ppl:7.2f}  test {ev_test.ppl:7.2f}  "
            f"train {res.seconds:6.1f}s",
            flush=True,
        )
    return results


def print_tables(results: dict[str, dict[str, object]]) -> None:
    def ppl(name: str, split: str) -> str:
        r = results.get(name)
        return f"{float(r[split + '_ppl']):.1f}" if r else "-"  # type: ignore[arg-type]

    print("\n### Dev / test perplexity by attention window (Figure 2a)\n")
    by_window = [
        (
            LABEL[arch],
            *(f"{ppl(f'{arch}-{w}', 'dev')} / {ppl(f'{arch}-{w}', 'test')}" for w in WINDOWS),
        )
        for arch in ATTENTIVE
    ]
    print(markdown_table(["Model", *(f"L={w}" for w in WINDOWS)], by_window))

    print("\n### All models (Figure 2b/2c): same theta_M, same data, same steps\n")
    rows: list[tuple[object, ...]] = []
    for name, _, _ in model_specs():
        r = results.get(name)
        if r is None:
            rows.append((name, *["-"] * 7))
            continue
        cfg = r["config"]
        assert isinstance(cfg, dict)
        parts = {"lstm": 1, "attention": 1, "kv": 2, "kvp": 3}.get(cfg["arch"], cfg["ngram"] - 1)
        rows.append(
            (
                name,
                cfg["hidden"],
                cfg["hidden"] // parts,
                r["params_no_embedding"],
                r["steps"],
                r["train_seconds"],
                f"{float(r['dev_ppl']):.1f}",  # type: ignore[arg-type]
                f"{float(r['test_ppl']):.1f}",  # type: ignore[arg-type]
            )
        )
    header = ["Model", "hidden H", "h* size", "theta_M", "steps", "train s", "Dev ppl"]
    print(markdown_table([*header, "Test ppl"], rows))


def check_findings(results: dict[str, dict[str, object]]) -> None:
    """The paper's three claims, evaluated on the dev perplexities (best window by dev)."""

    def best(arch: str) -> tuple[str, float, float] | None:
        rows = [results[f"{arch}-{w}"] for w in WINDOWS if f"{arch}-{w}" in results]
        if not rows:
            return None
        r = min(rows, key=lambda r: float(r["dev_ppl"]))  # type: ignore[arg-type]
        return str(r["name"]), float(r["dev_ppl"]), float(r["test_ppl"])  # type: ignore[arg-type]

    print("\n### The paper's findings on these runs\n")
    b = {a: best(a) for a in ATTENTIVE}
    for a, v in b.items():
        if v:
            print(f"- best {LABEL[a]} by dev: {v[0]} (dev {v[1]:.1f}, test {v[2]:.1f})")
    if b["kvp"] and b["attention"]:
        verdict = "holds" if b["kvp"][1] < b["attention"][1] else "does not hold"
        print(f"- KVP better than attention (dev, best windows): {verdict}")
    for name in ("attention-15", "kv-15", "kvp-15", "attention-10", "kv-10", "kvp-10"):
        att = results.get(name, {}).get("test_attention")
        if att:
            assert isinstance(att, list)
            last5, uniform = sum(att[-5:]), 5 / len(att)
            print(f"- {name}: weight on the last 5 positions {last5:.3f} (uniform: {uniform:.3f})")
    four = results.get("4-gram")
    attentive = [v for v in b.values() if v]
    if four and attentive:
        best_att = min(attentive, key=lambda v: v[1])
        gap = float(four["dev_ppl"]) - best_att[1]  # type: ignore[arg-type]
        print(
            f"- 4-gram RNN dev {float(four['dev_ppl']):.1f} vs best attentive {best_att[0]} "  # type: ignore[arg-type]
            f"{best_att[1]:.1f}: gap {gap:+.1f} ({100 * gap / best_att[1]:+.1f}%)"
        )


def plot_attention(results: dict[str, dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), sharey=True)
    for ax, w in zip(axes, WINDOWS[1:], strict=True):
        for arch in ATTENTIVE:
            att = results.get(f"{arch}-{w}", {}).get("test_attention")
            if att:
                assert isinstance(att, list)
                style = {"attention": "-", "kv": "--", "kvp": ":"}[arch]
                ax.plot(range(-w, 0), att, style, marker="o", label=LABEL[arch])
        ax.set_title(f"window L = {w}")
        ax.set_xticks(range(-w, 0, max(1, w // 5)))
        ax.set_xlabel("position relative to the predicting step (-1 = previous)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("mean attention weight (test)")
    axes[0].legend()
    fig.suptitle("Average attention per window position, news test split (cf. Figure 3b)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nwrote {path}")


def knn_eval(args: argparse.Namespace) -> int:
    """FullMem vs MoNIM with a trained short-span LM as the encoder of the datastore."""
    from memlm.corpus import load_news
    from memlm.evaluate import EvalConfig, evaluate, render_markdown
    from memlm.research.data import split_documents
    from memlm.research.lstm_encoder import ShortSpanEncoder

    enc = ShortSpanEncoder.from_checkpoint(args.knn_eval)
    splits = split_documents(load_news())  # the split the LM was trained with (seed 0, 5%/5%)
    docs = sorted(splits.dev + splits.test, key=lambda d: (d.published_at, d.id))
    cfg = EvalConfig(
        model=enc.name,
        policies=("fullmem", "monim"),
        index_kind="flat",
        max_eval_docs_per_day=args.eval_docs_per_day,
        days=args.knn_days,
        delta=args.knn_delta,
        seed=args.seed,
    )
    report = evaluate(cfg, docs, args.knn_out, encoder=enc)
    print(render_markdown(report))
    from memlm.evaluate import TokenCache

    outs = TokenCache(enc, cfg.window).get_many([d.text for d in docs])  # cached by evaluate
    lp = np.concatenate([o.target_logprob for o in outs])
    print(
        f"bare LM over the {lp.size} tokens: max log p(gold) {lp.max():.2f}; "
        f"share with log p(gold) < delta {args.knn_delta}: {(lp < args.knn_delta).mean():.3f}"
    )
    for name, r in report["results"].items():
        print(
            f"{name:8s} MemRate {r['memrate']:6.1%}  entries {r['entries']:7d}  dev ppl "
            f"{r['dev_ppl']:7.2f}  test ppl {r['test_ppl']:7.2f}  (k {r['k']}, T {r['temperature']}, "
            f"lambda {r['lambda']})"
        )
    return 0


def diagnose(args: argparse.Namespace) -> int:
    """Why attention stays flat: gradient norms at init and after training, value statistics.

    On the 4th window of the dev split (64 x 20): gradient norms of the attention
    parameters for a freshly initialised model and for the checkpoint, the spread of the
    attention weights across tokens, and the mean and spread of the key/value/predict parts.
    """
    from memlm.research.lstm_train import load_checkpoint, masked_loss

    trained, _ = load_checkpoint(args.diagnose)
    cfg = trained.cfg
    data = load_encoded_splits(vocab_size=cfg.vocab_size)
    batch = list(bptt_batches(data.dev, 64, 20))[3]
    torch.manual_seed(args.seed)
    for label, model in (("init", ShortSpanLM(cfg)), ("trained", trained)):
        model.train()
        for p in model.parameters():
            p.requires_grad_(True)
        model.zero_grad()
        out = model(batch.x, batch.reset)
        masked_loss(out.logits, batch.y, batch.mask).backward()
        names = ("w_att", "w_y.weight", "w_h.weight", "w_r.weight", "proj.weight")
        grads = {
            n: f"{p.grad.norm().item():.2g}"
            for n, p in model.named_parameters()
            if n in names and p.grad is not None
        }
        print(f"{label}: gradient norms {grads}")
        if out.attention is not None:
            full = batch.mask & (out.pos >= cfg.window)
            att = out.attention[full].detach()
            print(
                f"  attention mean per slot {[round(x, 4) for x in att.mean(0).tolist()]}, "
                f"max std over tokens {att.std(0).max().item():.4f}"
            )
        with torch.no_grad():
            H = cfg.hidden
            hs, _, _ = model._lstm(batch.x, batch.reset, torch.zeros(64, H), torch.zeros(64, H))
            parts = dict(zip(("key", "value", "predict"), model._split(hs), strict=True))
        keep = batch.mask
        stats = {
            n: f"mean|x| {t[keep].abs().mean().item():.2f} std {t[keep].std(0).mean().item():.2f}"
            for n, t in parts.items()
        }
        print(f"  LSTM output parts: {stats}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=800, help="training windows per model")
    p.add_argument("--vocab-size", type=int, default=5000)
    p.add_argument("--emb", type=int, default=64)
    p.add_argument("--budget-hidden", type=int, default=100, help="LSTM hidden size fixing theta_M")
    p.add_argument("--max-train-tokens", type=int, default=None)
    p.add_argument("--max-eval-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="", help="comma-separated model names")
    p.add_argument("--out", type=Path, default=Path("runs/short-attention"))
    p.add_argument("--plot", default="docs/img/short-attention-weights.png", help="'' for none")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--knn-eval", type=Path, default=None, help="checkpoint: FullMem vs MoNIM run")
    p.add_argument("--knn-out", type=Path, default=Path("runs/short-attention-knn"))
    p.add_argument(
        "--eval-docs-per-day", type=int, default=2, help="--knn-eval: dev/test docs a day"
    )
    p.add_argument("--knn-days", type=int, default=None, help="--knn-eval: first N days only")
    p.add_argument("--knn-delta", type=float, default=-1.5, help="--knn-eval: MoNIM threshold")
    p.add_argument("--diagnose", type=Path, default=None, help="checkpoint: attention diagnostics")
    args = p.parse_args(argv)
    set_threads(args.threads)
    if args.diagnose is not None:
        return diagnose(args)
    if args.knn_eval is not None:
        return knn_eval(args)
    print(
        f"# short attention spans: python {platform.python_version()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s); args {vars(args)}",
        flush=True,
    )
    t0 = time.perf_counter()
    results = train_all(args)
    print_tables(results)
    check_findings(results)
    if args.plot and any(r.get("test_attention") for r in results.values()):
        plot_attention(results, Path(args.plot))
    total = sum(_num(r["train_seconds"]) + _num(r.get("eval_seconds", 0)) for r in results.values())
    print(
        f"\ntrain+eval seconds over the {len(results)} models: {total:.0f} ({total / 60:.1f} min); "
        f"this invocation {time.perf_counter() - t0:.0f} s"
    )
    return 0 if all(math.isfinite(_num(r["dev_ppl"])) for r in results.values()) else 1


def _num(x: object) -> float:
    assert isinstance(x, int | float)
    return float(x)


if __name__ == "__main__":
    sys.exit(main())
