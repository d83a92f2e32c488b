"""Latency of POST /predict at a 128-token context, with the bare LM forward beside it.

Builds a memory from real news with the real engine, starts the real server (uvicorn on
127.0.0.1, in this process), then times, over the same 128-token contexts taken from
other news articles:

  - bare LM: the forward of the 128 tokens and the LM head at the last position (what a
    plain LM needs for one next-token distribution);
  - engine.predict: the bare LM plus the memory search, kNN distribution, interpolation
    and the top-N (called directly, no HTTP);
  - HTTP /predict: the whole request over a local socket (JSON, validation, the executor
    queue, the engine, provenance from the database), one request at a time;
  - HTTP /predict, neighbours=5: the same with provenance snippets;
  - HTTP /predict, words=5: five whole-word suggestions (a beam search that continues
    the forward's attention cache, memlm/knnlm/words.py);
  - HTTP /predict, local_memory: TRIME local memory (the context's own tokens) in the
    softmax before the datastore.

Prints one table (p50 / p99 / mean in milliseconds) and the machine's load average.

    python benchmarks/bench_predict.py --memory-docs 20 --requests 200
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from _common import (
    interleaved,
    load_average,
    markdown_table,
    memorise,
    open_served_engine,
    serving,
    stats_ms,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("MEMLM_THREADS", 1)))
    ap.add_argument("--memory-docs", type=int, default=20, help="news articles memorised")
    ap.add_argument("--requests", type=int, default=200, help="timed calls per row")
    ap.add_argument("--context", type=int, default=128, help="context tokens")
    ap.add_argument("--top-n", type=int, default=10)
    args = ap.parse_args()

    import httpx
    import torch

    from memlm.corpus import load_news
    from service.app import create_app

    load_before = load_average()
    news = load_news()
    settings, engine, load_s = open_served_engine(
        "bench-predict", model=args.model, threads=args.threads
    )
    # Memory: the first articles, memorised by the worker with MoNIM, then built.
    ingest_s = memorise(engine, settings, news[: args.memory_docs])
    stats = engine.stats()

    # Contexts: 128-token windows from later articles (not in memory), as text.
    enc = engine.encoder
    contexts: list[str] = []
    for d in news[args.memory_docs :]:
        ids = enc.tokenize(d.text)
        if len(ids) >= args.context + 1:
            contexts.append(enc.tokenizer.decode(ids[: args.context]))
        if len(contexts) == 50:
            break
    lengths = sorted(len(enc.tokenize(c)) for c in contexts)
    rounds = [-1]

    def next_round() -> None:
        rounds[0] += 1

    def ctx() -> str:
        return contexts[rounds[0] % len(contexts)]

    def bare() -> None:
        ids = enc.tokenize(ctx())
        _, hidden, _ = enc.start([ids])
        torch.log_softmax(enc.logits(hidden[0, -1:]), dim=-1)

    paths: dict[str, Callable[[], Any]] = {
        "bare LM forward + head (128 tokens)": bare,
        "engine.predict": lambda: engine.predict(ctx(), top_n=args.top_n),
    }

    app = create_app(settings, engine=engine, run_worker=False, poll=False)
    with serving(app) as base, httpx.Client(base_url=base, timeout=60) as client:
        variants: list[tuple[str, dict[str, Any]]] = [
            ("HTTP /predict", {}),
            ("HTTP /predict, neighbours=5", {"neighbours": 5}),
            ("HTTP /predict, words=5", {"words": 5}),
            ("HTTP /predict, local_memory", {"local_memory": True}),
        ]
        for name, extra in variants:

            def call(extra: dict[str, Any] = extra) -> None:
                r = client.post("/predict", json={"context": ctx(), "top_n": args.top_n, **extra})
                r.raise_for_status()

            paths[name] = call
        rows = interleaved(paths, args.requests, warmup=5, before_round=next_round)

    print(f"model {args.model}, threads {args.threads}, model load {load_s:.1f} s")
    print(
        f"memory: {args.memory_docs} news articles, {stats['entries']} entries "
        f"(MoNIM), index version {stats['index_version']}, built in {ingest_s:.0f} s with ingest"
    )
    print(
        f"contexts: {len(contexts)} windows of {lengths[0]}-{lengths[-1]} tokens, "
        f"{args.requests} timed calls per row after 5 warm-up calls, the rows interleaved"
    )
    print(f"load average before: {load_before}; after: {load_average()}")
    print()
    table = []
    for name, seconds in rows.items():
        st = stats_ms(seconds)
        table.append((name, st["p50"], st["p99"], st["mean"]))
    print(markdown_table(["path", "p50 ms", "p99 ms", "mean ms"], table))


if __name__ == "__main__":
    main()
