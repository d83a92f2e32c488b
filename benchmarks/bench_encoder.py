"""Encoder throughput against the machine's matmul peak, per precision, and ingest against it.

Prints two tables:

1. float32 paths (as before):
  - matmul peak: float32 GEMM (2048^3) GFLOP/s with the same thread count;
  - model forward: the raw HF forward of 512-token windows (logits for every position);
  - encoder forward only: the encoder's transformer body with its key hook, no LM head and
    no statistics, so the head + statistics share is the gap to the next row;
  - encoder: Encoder.encode_many over real news, windows of 512 with stride 511 (every token
    scored once), FLOP per token from Encoder.flops_per_token;
  - ingest: Engine.process_document (encode + search the served memory + augmented scoring
    + MoNIM + append) over the same documents, with a memory already holding other news.
2. one row per precision (MEMLM_PRECISION): encoder tokens/s, the peak GEMM rate of that
   precision measured in the same run (int8: dynamic-quantised Linear, GOP/s), the share
   of that peak, the speed-up over float32, ingest tokens/s and ingest / encoder of that
   precision (each precision has its own memory, filled with keys of that precision), and
   the perplexity on the test documents of the slice20 evaluation (``memlm eval --start
   2017-02-13 --days 5 --max-docs-per-day 20``: 2 test documents a day, 512/256 windows)
   against float32's.
All timed paths run in the same process, on the same documents, interleaved (best of
--repeat), so that the machine's load hits every precision alike.

    python benchmarks/bench_encoder.py --threads 2 --docs 6 --memory-docs 20 --repeat 5
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import load_average, markdown_table


def slice20_test_ids(enc: Any, max_docs: int | None) -> list[list[int]]:
    """Token ids of the slice20 evaluation's test documents (the first ``max_docs``)."""
    from memlm.corpus import load_news
    from memlm.evaluate import plan_stream

    plans = plan_stream(
        load_news(), start=dt.date(2017, 2, 13), days=5, max_docs_per_day=20
    )  # the README's slice20 (max_eval_docs_per_day defaults to 2, as memlm eval's)
    docs = [d for p in plans for d in p.test][:max_docs]
    return [enc.tokenize(d.text) for d in docs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("MEMLM_THREADS", 2)))
    ap.add_argument("--docs", type=int, default=12, help="news documents to time")
    ap.add_argument("--memory-docs", type=int, default=20, help="documents in memory before")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3, help="interleaved repetitions (best kept)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="windows per forward for the encoder and ingest (1: the CPU's best; a GPU wants more)",
    )
    ap.add_argument(
        "--precisions", default=None, help="comma-separated (default: the device's candidates)"
    )
    ap.add_argument(
        "--ppl-docs",
        type=int,
        default=None,
        help="use only the first N slice20 test documents for the perplexity (default all 10)",
    )
    args = ap.parse_args()

    import faiss

    from memlm.corpus import load_news
    from memlm.encoder import Encoder, WindowConfig, candidate_precisions, perplexity
    from memlm.encoder.precision import matmul_peak
    from memlm.engine import Engine
    from memlm.knnlm import KnnParams

    faiss.omp_set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    precisions = args.precisions.split(",") if args.precisions else candidate_precisions(device)
    assert precisions[0] == "float32", "float32 is the reference: name it first"
    load_before = load_average()
    encs = {
        p: Encoder.load(args.model, threads=args.threads, precision=p, device=device)
        for p in precisions
    }
    enc = encs["float32"]
    news = [d for d in load_news() if d.published_at.isoformat() >= "2017-02-13"]
    timed = news[: args.docs]
    memory = news[args.docs : args.docs + args.memory_docs]
    ids = [enc.tokenize(d.text) for d in timed]
    n_tok = sum(len(i) - 1 for i in ids)
    window = WindowConfig(context=args.context, stride=args.context - 1, batch_size=args.batch_size)
    # CUDA runs asynchronously: a timer read before the device finished would time nothing
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    flop_tok = enc.flops_per_token(args.context)

    # perplexity on the slice20 test tokens, each precision (not timed)
    test_ids = slice20_test_ids(enc, args.ppl_docs)
    ppl = {
        p: perplexity(
            torch.cat([torch.from_numpy(o.target_logprob) for o in e.encode_many(test_ids)]).numpy()
        )
        for p, e in encs.items()
    }
    test_tokens = sum(len(i) - 1 for i in test_ids)

    for e in encs.values():
        e.encode_many(ids[:1], window)  # warm-up

    def raw_forward() -> None:  # the model alone on the same windows (logits everywhere)
        with torch.inference_mode():
            for doc in ids:
                for b, e, _ in window.windows(len(doc)):
                    enc.model(torch.tensor([doc[b:e]], device=device))
        sync()

    def body_forward() -> None:  # the encoder's forward without the head and LM statistics
        for doc in ids:
            for b, e, _ in window.windows(len(doc)):
                x = torch.tensor([doc[b:e]])
                enc._forward(x, torch.ones_like(x))  # moves the batch to the encoder's device
        sync()

    raw_tokens = sum(e - b for doc in ids for b, e, _ in window.windows(len(doc)))

    with tempfile.TemporaryDirectory() as tmp:
        engines: dict[str, Engine] = {}
        mem_entries: dict[str, int] = {}
        for p, e in encs.items():  # one memory per precision: never mix key spaces
            eng = Engine(Path(tmp) / p, e, knn=KnnParams(), window=window)
            for i, d in enumerate(memory):
                eng.process_document(10_000 + i, d.text, 0, policy="fullmem")
            engines[p], mem_entries[p] = eng, eng.stats()["entries"]

        def ingest(p: str) -> int:
            eng = engines[p]
            stored = sum(
                eng.process_document(i, d.text, 1, policy="monim").tokens_stored
                for i, d in enumerate(timed)
            )
            eng.memory.truncate(mem_entries[p])  # the next repetition sees the same memory
            return stored

        # Interleaved repetitions, best of each: other jobs on the machine come and go, and
        # the best time is the one least disturbed by them.
        inf = float("inf")
        raw_s = body_s = inf
        enc_s, ing_s, peak = dict.fromkeys(encs, inf), dict.fromkeys(encs, inf), {}
        stored: dict[str, int] = {}
        for _ in range(args.repeat):
            t = time.perf_counter()
            raw_forward()
            raw_s = min(raw_s, time.perf_counter() - t)
            t = time.perf_counter()
            body_forward()
            body_s = min(body_s, time.perf_counter() - t)
            for p, e in encs.items():
                peak[p] = max(peak.get(p, 0.0), matmul_peak(p, device, repeats=3))
                t = time.perf_counter()
                e.encode_many(ids, window)
                enc_s[p] = min(enc_s[p], time.perf_counter() - t)
                t = time.perf_counter()
                stored[p] = ingest(p)
                ing_s[p] = min(ing_s[p], time.perf_counter() - t)

    f32 = enc_s["float32"]
    p32 = peak["float32"]
    rows = [
        ("float32 GEMM 2048^3", "-", f"{p32:.1f} GFLOP/s", "100%", "-"),
        (
            "model forward (HF, logits)",
            f"{raw_tokens / raw_s:.0f}",
            f"{raw_tokens / raw_s * flop_tok / 1e9:.1f} GFLOP/s",
            f"{raw_tokens / raw_s * flop_tok / 1e9 / p32:.0%}",
            "-",
        ),
        (
            "encoder forward only (keys, no head)",
            f"{raw_tokens / body_s:.0f}",
            "-",
            "-",
            f"{f32 / body_s:.2f}x",
        ),
        (
            "encoder (keys + LM stats)",
            f"{n_tok / f32:.0f}",
            f"{n_tok / f32 * flop_tok / 1e9:.1f} GFLOP/s",
            f"{n_tok / f32 * flop_tok / 1e9 / p32:.0%}",
            "1.00x",
        ),
        (
            f"ingest MoNIM ({mem_entries['float32']} entries in memory)",
            f"{n_tok / ing_s['float32']:.0f}",
            "-",
            "-",
            f"{f32 / ing_s['float32']:.2f}x",
        ),
    ]
    print(
        f"model {args.model} on {device}, {args.threads} threads, {len(timed)} news documents, "
        f"{n_tok} tokens, window {args.context}/{args.context}, {args.batch_size} window(s) a "
        f"forward, {flop_tok / 1e6:.0f} MFLOP/token, "
        f"best of {args.repeat}; float32 MoNIM stored {stored['float32']} "
        f"({stored['float32'] / n_tok:.0%}); perplexity on {len(test_ids)} slice20 test "
        f"documents ({test_tokens} tokens); load average before {load_before}, "
        f"after {load_average()}"
    )
    print()
    print(markdown_table(["path", "tokens/s", "achieved", "of peak", "vs encoder"], rows))
    print()
    prec_rows = []
    for p in encs:
        unit = "GOP/s" if p == "int8" else "GFLOP/s"
        tok_s = n_tok / enc_s[p]
        prec_rows.append(
            (
                p,
                f"{tok_s:.0f}",
                f"{f32 / enc_s[p]:.2f}x",
                f"{peak[p]:.1f} {unit}",
                f"{tok_s * flop_tok / 1e9 / peak[p]:.0%}",
                f"{n_tok / ing_s[p]:.0f}",
                f"{enc_s[p] / ing_s[p]:.2f}x",
                f"{ppl[p]:.3f}",
                f"{(ppl[p] - ppl['float32']) / ppl['float32']:+.2%}",
            )
        )
    header = ["precision", "encoder tokens/s", "vs float32", "GEMM peak (same run)", "of peak"]
    header += ["ingest tokens/s", "ingest / encoder", "test ppl", "ppl vs float32"]
    print(markdown_table(header, prec_rows))


if __name__ == "__main__":
    main()
