"""Tokens per second of /generate's loop against plain HF ``generate``, same model, same run.

Builds a memory from real news with the real engine (MoNIM, then an index build), then
times, over the same contexts (the first ``--context`` tokens of later articles, not in
memory), interleaved round by round so a change of the machine's load hits every row:

  - HF generate: ``model.generate`` of the engine's own model, greedy, ``--tokens`` new
    tokens exactly (no end-of-text stop), attention cache on;
  - memlm.generate: the /generate loop called directly (``memlm.generate.generate``),
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
from typing import Any

from _common import interleaved, load_average, markdown_table, memorise, open_served_engine, serving


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("MEMLM_THREADS", 1)))
    ap.add_argument("--memory-docs", type=int, default=20, help="news articles memorised")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per generation")
    ap.add_argument("--context", type=int, default=128, help="context tokens")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (each row once)")
    ap.add_argument("--no-http", action="store_true", help="skip the HTTP row")
    args = ap.parse_args()

    import contextlib

    import httpx
    import torch

    from memlm.corpus import load_news
    from memlm.generate import GenerateConfig, generate
    from service.app import create_app

    load_before = load_average()
    news = load_news()
    settings, engine, _ = open_served_engine(
        "bench-generate",
        model=args.model,
        threads=args.threads,
        max_generate_tokens=max(256, args.tokens),
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
    produced: dict[str, list[int]] = {"HF generate": [], "memlm.generate": [], "HTTP /generate": []}

    def next_round() -> None:
        if outputs:  # the round before: how many greedy tokens the memory left alone
            agree.append(sum(a == b for a, b in zip(outputs["hf"], outputs["memlm"], strict=True)))
        current[:] = [contexts[len(agree) % len(contexts)]]

    def hf() -> None:
        x = torch.tensor(current)
        with torch.inference_mode():
            out = enc.model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=enc.tokenizer.eos_token_id,
            )
        outputs["hf"] = out[0, x.shape[1] :].tolist()
        produced["HF generate"].append(len(outputs["hf"]))

    def ours() -> None:
        _, toks = generate(engine, current[0], cfg)
        outputs["memlm"] = [t.token_id for t in toks]
        produced["memlm.generate"].append(len(toks))

    paths: dict[str, Any] = {"HF generate": hf, "memlm.generate": ours}
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

            paths["HTTP /generate"] = http
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
    base_rate = statistics.median(rates["HF generate"])
    rows = [
        (name, statistics.median(xs), statistics.fmean(xs), statistics.median(xs) / base_rate)
        for name, xs in rates.items()
    ]
    print(markdown_table(["path", "tokens/s median", "tokens/s mean", "x HF generate"], rows))
    print()
    timed = agree[1:]  # the warm-up round's tokens are not counted
    print(
        f"greedy tokens equal to HF generate's (the memory changes the rest): "
        f"{sum(timed)} of {n * len(timed)}"
    )


if __name__ == "__main__":
    main()
