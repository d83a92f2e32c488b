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
    the forward's attention cache, memlm/words.py);
  - HTTP /predict, local_memory: TRIME local memory (the context's own tokens) in the
    softmax before the datastore.

Prints one table (p50 / p99 / mean in milliseconds) and the machine's load average.

    python benchmarks/bench_predict.py --memory-docs 20 --requests 200
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def percentiles(ms: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(ms, n=100, method="inclusive")
    return q[49], q[98], statistics.fmean(ms)


def timed(
    fns: dict[str, Callable[[], Any]],
    n: int,
    next_round: Callable[[], None],
    warmup: int = 5,
) -> dict[str, list[float]]:
    """Milliseconds per call of each function, interleaved: round i calls every path once
    (on the same input), so a change in the machine's load hits every row alike."""
    for _ in range(warmup):
        next_round()
        for fn in fns.values():
            fn()
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(n):
        next_round()
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            out[name].append((time.perf_counter() - t) * 1000)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    import uvicorn

    from memlm.corpus import load_news
    from memlm.db.migrate import upgrade
    from memlm.settings import Settings
    from service.app import create_app
    from workers.engine import open_engine, policy_factory
    from workers.ingest import IngestWorker

    load_before = load_average()
    news = load_news()
    tmp = Path(tempfile.mkdtemp(prefix="bench-predict-"))
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        data_dir=tmp,
        model=args.model,
        threads=args.threads,
        index_poll_seconds=3600,
        embedded_worker=False,
    )
    upgrade(settings.db_url)
    t0 = time.perf_counter()
    engine: Any = open_engine(settings)
    load_s = time.perf_counter() - t0

    # Memory: the first articles, memorised by the worker with MoNIM, then built.
    from memlm.db.repositories import DocumentRepository, NewDocument
    from memlm.db.session import make_engine, make_sessionmaker
    from workers.builder import enqueue_rebuild

    sessions = make_sessionmaker(make_engine(settings.db_url))
    with sessions.begin() as s:
        DocumentRepository(s).add_many(
            NewDocument(text=d.text, published_at=d.published_at, source=d.source, title=d.title)
            for d in news[: args.memory_docs]
        )
    worker = IngestWorker(engine, sessions, settings, policy_factory=policy_factory)
    worker.start(timeout=5)
    t0 = time.perf_counter()
    while worker.step() is not None:
        pass
    enqueue_rebuild(sessions, requested_by="bench")
    worker.step()
    worker.lock.release()
    ingest_s = time.perf_counter() - t0
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

    port = free_port()
    app = create_app(settings, engine=engine, run_worker=False, poll=False)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
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
        rows = timed(paths, args.requests, next_round)
    server.should_exit = True
    thread.join(10)

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
    print(f"| {'path':40s} | p50 ms | p99 ms | mean ms |")
    print(f"|{'-' * 42}|-------:|-------:|--------:|")
    for name, ms in rows.items():
        p50, p99, mean = percentiles(ms)
        print(f"| {name:40s} | {p50:6.1f} | {p99:6.1f} | {mean:7.1f} |")


if __name__ == "__main__":
    main()
