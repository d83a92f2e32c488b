"""Where the encoder's time goes, per precision variant: a profile and interleaved timings.

Variants (``--variants``, comma-separated):
  float32          the reference;
  bf16-f32head     bfloat16 transformer on SDPA attention, LM head product in float32 (the
                   encoder before memlm.encoder.head and memlm.encoder.attention);
  bf16-sdpa        bfloat16 on SDPA attention, half-precision head with float32 rescoring;
  bf16             the bfloat16 encoder as it is: half-precision head, matmul attention;
  bf16-eager       as bf16, with transformers' eager attention.

1. Profile (torch.profiler, one 512-token window of news, after a warm-up): self CPU time
   of each op, split into the transformer body (``_forward``) and the LM head +
   statistics (``_stats``), in ms per window; per op the least of ``--profile-passes``
   profiled encodes (the totals are sums of those minima).
2. Encoder tokens/s: ``Encoder.encode_ids`` of each 512/511 window of the first ``--docs``
   news documents from 2017-02-13 (bench_encoder.py's), variants alternating window by
   window, ``--repeat`` rounds; the best and median round, their ratios to float32's, and
   the median over rounds of float32's time / the variant's in the same round.
3. Perplexity of every variant on the first ``--ppl-docs`` slice20 test documents
   (bench_encoder.py's), 512/256 windows, against float32's.

    MEMLM_THREADS=1 PYTHONPATH=. python benchmarks/profile_encoder.py --threads 1 --repeat 9
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any

import torch
from _common import load_average, markdown_table
from bench_encoder import slice20_test_ids

VARIANTS = ("float32", "bf16-f32head", "bf16-sdpa", "bf16")


def make(variant: str, model: str, threads: int) -> Any:
    """The encoder of one variant (see the module docstring)."""
    from memlm.encoder import Encoder

    enc = Encoder.load(
        model, threads=threads, precision="float32" if variant == "float32" else "bfloat16"
    )
    if variant == "bf16-f32head":
        enc.head_weight_half = None
    if variant in ("bf16-f32head", "bf16-sdpa"):
        enc.model.set_attn_implementation("sdpa")
    if variant == "bf16-eager":
        enc.model.set_attn_implementation("eager")
    return enc


def profile_window(enc: Any, ids: list[int], passes: int) -> dict[tuple[str, str], float]:
    """Self CPU ms per (region, op) of one encode of ``ids`` (one window): the least of
    ``passes`` profiled encodes, op by op."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from memlm.encoder import WindowConfig

    window = WindowConfig(context=len(ids), stride=len(ids) - 1, batch_size=1)
    forward, stats = enc._forward, enc._stats

    def fwd(*a: Any, **k: Any) -> Any:
        with record_function("body"):
            return forward(*a, **k)

    def st(*a: Any, **k: Any) -> Any:
        with record_function("head+stats"):
            return stats(*a, **k)

    enc._forward, enc._stats = fwd, st
    runs: list[dict[tuple[str, str], float]] = []
    try:
        enc.encode_ids(ids, window)  # warm-up
        for _ in range(passes):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                enc.encode_ids(ids, window)
            out: dict[tuple[str, str], float] = defaultdict(float)
            for ev in prof.events():
                region, p = "other", ev.cpu_parent
                while p is not None:
                    if p.name in ("body", "head+stats"):
                        region = p.name
                        break
                    p = p.cpu_parent
                if ev.name not in ("body", "head+stats"):
                    out[(region, ev.name)] += ev.self_cpu_time_total / 1e3
            runs.append(out)
    finally:
        del enc._forward, enc._stats  # back to the class's methods
    # per op, the least disturbed of the passes (other jobs on the machine only add time)
    return {k: min(r.get(k, 0.0) for r in runs) for k in set().union(*runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--ppl-docs", type=int, default=4)
    ap.add_argument("--profile-passes", type=int, default=3, help="least per op is kept")
    ap.add_argument("--top-ops", type=int, default=8, help="ops per region in the profile")
    args = ap.parse_args()

    from memlm.corpus import load_news
    from memlm.encoder import WindowConfig, perplexity

    torch.set_num_threads(args.threads)
    load_before = load_average()
    variants = args.variants.split(",")
    assert variants[0] == "float32", "float32 is the reference: name it first"
    encs = {v: make(v, args.model, args.threads) for v in variants}
    ref = encs["float32"]
    news = [d for d in load_news() if d.published_at.isoformat() >= "2017-02-13"]
    ids = [ref.tokenize(d.text) for d in news[: args.docs]]
    n_tok = sum(len(i) - 1 for i in ids)
    window = WindowConfig(context=512, stride=511, batch_size=1)

    # 1. profile of one 512-token window
    first = next(i for i in ids if len(i) >= 512)[:512]
    prof = {v: profile_window(e, first, args.profile_passes) for v, e in encs.items()}
    keys: set[tuple[str, str]] = set()
    for v in variants:
        for region in ("body", "head+stats"):
            ops = sorted(
                ((k, t) for k, t in prof[v].items() if k[0] == region), key=lambda x: -x[1]
            )
            keys |= {k for k, _ in ops[: args.top_ops]}
    rows = []
    for k in sorted(keys, key=lambda k: (k[0], -prof[variants[0]].get(k, 0.0))):
        rows.append((k[0], k[1], *(f"{prof[v].get(k, 0.0):.1f}" for v in variants)))
    for region in ("body", "head+stats", "other"):
        rows.append(
            (
                region,
                "**total**",
                *(f"{sum(t for k, t in prof[v].items() if k[0] == region):.1f}" for v in variants),
            )
        )
    rows.append(("all", "**total**", *(f"{sum(prof[v].values()):.1f}" for v in variants)))

    # 2. interleaved timings, variants alternating window by window: on a shared machine a
    # busy spell then hits every variant alike, and per-round ratios cancel slow drifts
    pieces = [doc[b:e] for doc in ids for b, e, _ in window.windows(len(doc))]
    for e in encs.values():
        e.encode_ids(pieces[0], window)  # warm-up
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.repeat):
        spent = dict.fromkeys(variants, 0.0)
        for piece in pieces:
            for v, e in encs.items():
                t = time.perf_counter()
                e.encode_ids(piece, window)
                spent[v] += time.perf_counter() - t
        for v in variants:
            times[v].append(spent[v])
    n_tok = sum(len(p) - 1 for p in pieces)

    # 3. perplexity
    test_ids = slice20_test_ids(ref, args.ppl_docs)
    ppl = {}
    for v, e in encs.items():
        lp = [torch.from_numpy(o.target_logprob) for o in e.encode_many(test_ids)]
        ppl[v] = perplexity(torch.cat(lp).numpy())

    print(
        f"model {args.model}, {args.threads} threads, torch {torch.__version__}; profile: one "
        f"512-token window; timings: {len(ids)} news documents ({n_tok} tokens), 512/511 "
        f"windows, {args.repeat} interleaved rounds; perplexity: {len(test_ids)} slice20 test "
        f"documents; load average before {load_before}, after {load_average()}"
    )
    print()
    print(f"Self CPU ms per 512-token window (torch.profiler, least of {args.profile_passes}):")
    print()
    print(markdown_table(["region", "op", *variants], rows))
    print()
    best32 = min(times["float32"])
    trows = []
    for v in variants:
        best, med = min(times[v]), statistics.median(times[v])
        trows.append(
            (
                v,
                f"{n_tok / best:.0f}",
                f"{n_tok / med:.0f}",
                f"{best32 / best:.2f}x",
                f"{statistics.median(times['float32']) / med:.2f}x",
                f"{statistics.median(a / b for a, b in zip(times['float32'], times[v], strict=True)):.2f}x",
                f"{ppl[v]:.3f}",
                f"{(ppl[v] - ppl['float32']) / ppl['float32']:+.3%}",
            )
        )
    header = ["variant", "tokens/s (best)", "tokens/s (median)", "vs float32 (best)"]
    header += ["vs float32 (median)", "vs float32 (median of rounds)", "test ppl", "ppl vs float32"]
    print(markdown_table(header, trows))


if __name__ == "__main__":
    main()
