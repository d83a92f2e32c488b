"""Tokens per second of /generate's loop against plain HF ``generate``, same model, same run.

Builds a memory from real news with the real engine (MoNIM, then an index build), then
times, over the same contexts (the first ``--context`` tokens of later articles, not in
memory), interleaved round by round so a change of the machine's load hits every row:

  - HF generate: ``model.generate`` of the engine's own model, greedy, ``--tokens`` new
    tokens exactly (no end-of-text stop), attention cache on;
  - memlm.engine.generation: the /generate loop called directly (``memlm.engine.generation.generate``),
    greedy, memory on: every step searches the memory and interpolates (the served
    k, T and lambda), same number of tokens;
  - HTTP /generate: the whole request over a local socket (JSON, the executor's jobs of
    MEMLM_GENERATE_CHUNK_TOKENS tokens, the engine), one request at a time.

Prints tokens/s (median and mean over the rounds), the ratio to HF generate, how many
tokens the augmented greedy path shares with the bare LM's, and the load average.

    python benchmarks/bench_generate.py --memory-docs 20 --tokens 64 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from _common import (
    hf_generate,
    interleaved,
    load_average,
    markdown_table,
    memorise,
    open_served_engine,
    serving,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("MEMLM_THREADS", 1)))
    ap.add_argument("--memory-docs", type=int, default=20, help="news articles memorised")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per generation")
    ap.add_argument("--context", type=int, default=128, help="context tokens")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (each row once)")
    ap.add_argument("--no-http", action="store_true", help="skip the HTTP row")
    ap.add_argument(
        "--lambda",
        dest="lmbda",
        type=float,
        default=0.25,
        help="served lambda, fixed with k 64 and T 2 (a tuned one may be 0 on a small "
        "memory: the work is the same, but the memory would change no token)",
    )
    args = ap.parse_args()

    import contextlib

    import httpx
    import torch

    from memlm.corpus import load_news
    from memlm.engine.generation import GenerateConfig, generate
    from service.app import create_app

    load_before = load_average()
    news = load_news()
    settings, engine, _ = open_served_engine(
        "bench-generate",
        model=args.model,
        threads=args.threads,
        max_generate_tokens=max(256, args.tokens),
        knn_k=64,
        knn_temperature=2.0,
        knn_lambda=args.lmbda,
    )
    build_s = memorise(engine, settings, news[: args.memory_docs])
    stats = engine.stats()
    enc = engine.encoder
    contexts: list[list[int]] = []
    for d in news[args.memory_docs :]:
        ids = enc.tokenize(d.text)
        if len(ids) >= args.context:
            contexts.append(ids[: args.context])
        if len(contexts) == args.rounds + 1:
            break
    n = args.tokens
    cfg = GenerateConfig(max_tokens=n, stop_at_eos=False)
    current: list[list[int]] = []
    outputs: dict[str, list[int]] = {}
    agree: list[int] = []
    produced: dict[str, list[int]] = {
        "HF generate": [],
        "memlm.engine.generation": [],
        "HTTP /generate": [],
    }

    def next_round() -> None:
        if outputs:  # the round before: how many greedy tokens the memory left alone
            agree.append(sum(a == b for a, b in zip(outputs["hf"], outputs["memlm"], strict=True)))
        current[:] = [contexts[len(agree) % len(contexts)]]

    def hf() -> None:
        outputs["hf"] = hf_generate(enc, current[0], n)
        produced["HF generate"].append(len(outputs["hf"]))

    def ours() -> None:
        _, toks = generate(engine, current[0], cfg)
        outputs["memlm"] = [t.token_id for t in toks]
        produced["memlm.engine.generation"].append(len(toks))

    cpu: dict[str, list[float]] = {name: [] for name in produced}

    def cpu_timed(name: str, fn: Any) -> Any:
        """``fn`` that also records the process's CPU seconds it took: on a machine shared
        with other work, wall time is mostly waiting for a core; CPU time is the work."""

        def run() -> None:
            t = time.process_time()
            fn()
            cpu[name].append(time.process_time() - t)

        return run

    paths: dict[str, Any] = {
        "HF generate": cpu_timed("HF generate", hf),
        "memlm.engine.generation": cpu_timed("memlm.engine.generation", ours),
    }
    with contextlib.ExitStack() as stack:
        if not args.no_http:
            app = create_app(settings, engine=engine, run_worker=False, poll=False)
            base = stack.enter_context(serving(app))
            client = stack.enter_context(httpx.Client(base_url=base, timeout=600))

            def http() -> None:
                body = {"context": enc.tokenizer.decode(current[0]), "max_tokens": n}
                r = client.post("/generate", json=body)
                r.raise_for_status()
                produced["HTTP /generate"].append(r.json()["generated_tokens"])  # eos may end it

            paths["HTTP /generate"] = cpu_timed("HTTP /generate", http)
        times = interleaved(paths, args.rounds, warmup=1, before_round=next_round)
    next_round()

    print(f"model {args.model}, threads {args.threads}, torch {torch.__version__}")
    print(
        f"memory: {args.memory_docs} news articles, {stats['entries']} entries (MoNIM), "
        f"index version {stats['index_version']}, served k={engine.knn.k} "
        f"T={engine.knn.temperature} lambda={engine.knn.lmbda} ({build_s:.0f} s to build)"
    )
    print(
        f"{args.rounds} rounds after one warm-up round, each a {args.context}-token context "
        f"and {n} new tokens, greedy, the rows interleaved"
    )
    print(f"load average before: {load_before}; after: {load_average()}")
    print()
    # tokens per second of each timed call (the warm-up round's call is the first)
    rates = {
        name: [k / s for k, s in zip(produced[name][1:], secs, strict=True)]
        for name, secs in times.items()
    }
    cpu_rates = {
        name: [k / s for k, s in zip(produced[name][1:], cpu[name][1:], strict=True)]
        for name in times
    }
    base_rate = statistics.median(rates["HF generate"])
    base_cpu = statistics.median(cpu_rates["HF generate"])
    rows = [
        (
            name,
            statistics.median(xs),
            statistics.median(xs) / base_rate,
            statistics.median(cpu_rates[name]),
            statistics.median(cpu_rates[name]) / base_cpu,
        )
        for name, xs in rates.items()
    ]
    header = ["path", "tokens/s (wall)", "x HF", "tokens per CPU second", "x HF (CPU)"]
    print(markdown_table(header, rows, digits=2))
    print("(medians over the rounds; CPU seconds of the whole process, all its threads)")
    print()
    timed = agree[1:]  # the warm-up round's tokens are not counted
    print(
        f"greedy tokens equal to HF generate's (the memory changes the rest): "
        f"{sum(timed)} of {n * len(timed)}"
    )


if __name__ == "__main__":
    main()
