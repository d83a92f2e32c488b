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
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


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

    import httpx
    import torch
    import uvicorn

    from memlm.corpus import load_news
    from memlm.db.migrate import upgrade
    from memlm.generate import GenerateConfig, generate
    from memlm.settings import Settings
    from service.app import create_app
    from workers.engine import open_engine

    load_before = load_average()
    news = load_news()
    tmp = Path(tempfile.mkdtemp(prefix="bench-generate-"))
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        data_dir=tmp,
        model=args.model,
        threads=args.threads,
        index_poll_seconds=3600,
        embedded_worker=False,
        max_generate_tokens=max(256, args.tokens),
    )
    upgrade(settings.db_url)
    engine: Any = open_engine(settings, writer=True)
    t0 = time.perf_counter()
    for i, d in enumerate(news[: args.memory_docs]):
        engine.process_document(i + 1, d.text, 0)
    engine.rebuild()
    build_s = time.perf_counter() - t0
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
    outputs: dict[str, list[int]] = {}

    def hf(ids: list[int]) -> int:
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = enc.model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=enc.tokenizer.eos_token_id,
            )
        outputs["hf"] = out[0, len(ids) :].tolist()
        return int(out.shape[1]) - len(ids)

    def ours(ids: list[int]) -> int:
        _, toks = generate(engine, ids, cfg)
        outputs["memlm"] = [t.token_id for t in toks]
        return len(toks)

    rows: dict[str, Callable[[list[int]], int]] = {"HF generate": hf, "memlm.generate": ours}
    server = thread = client = None
    if not args.no_http:
        app = create_app(settings, engine=engine, run_worker=False, poll=False)
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)

        def http(ids: list[int]) -> int:
            assert client is not None
            body = {"context": enc.tokenizer.decode(ids), "max_tokens": n}
            r = client.post("/generate", json=body)
            r.raise_for_status()
            return int(r.json()["generated_tokens"])

        rows["HTTP /generate"] = http

    rates: dict[str, list[float]] = {name: [] for name in rows}
    agree: list[int] = []
    for r, ids in enumerate(contexts[: args.rounds + 1]):
        for name, fn in rows.items():
            t = time.perf_counter()
            got = fn(ids)
            dt = time.perf_counter() - t
            if r > 0:  # round 0 warms up every path
                rates[name].append(got / dt)
        if r > 0:
            agree.append(sum(a == b for a, b in zip(outputs["hf"], outputs["memlm"], strict=True)))
    if client is not None and server is not None and thread is not None:
        client.close()
        server.should_exit = True
        thread.join(10)

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
    base = statistics.median(rates["HF generate"])
    print(f"| {'path':16s} | tokens/s median | tokens/s mean | vs HF generate (median) |")
    print(f"|{'-' * 18}|----------------:|--------------:|------------------------:|")
    for name, xs in rates.items():
        med = statistics.median(xs)
        print(
            f"| {name:16s} | {med:15.1f} | {statistics.fmean(xs):13.1f} | {med / base:22.2f}x |"
        )
    print()
    print(
        f"greedy tokens equal to HF generate's (the memory changes the rest): "
        f"{sum(agree)} of {n * len(agree)}"
    )


if __name__ == "__main__":
    main()
