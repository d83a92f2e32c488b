"""Request time of POST /predict with many neighbours from long documents (provenance).

Memorises long documents (news articles joined into documents of 50k to 200k characters,
RandMem so that entries spread over all of them) with the real engine and worker,
builds the index, starts the real server (uvicorn on 127.0.0.1, in this process), then
sends /predict with ``--neighbours`` neighbours, one request at a time, 128-token
contexts taken from the memorised documents. Beside each request a thread pings
GET /healthz every 5 ms: the slowest ping is how long the event loop stalled.

With the token spans stored at ingest (``document_spans``, kept in a cache once read),
it also times requests with that cache emptied before each (the spans read from the
database), then deletes the stored spans, as for documents memorised before they
existed, and times the fallback (re-tokenising off the event loop, cached): the first
request, and the next ones.

    PYTHONPATH=. python benchmarks/bench_provenance.py --docs 8 --neighbours 100 --requests 5
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from typing import Any

from _common import load_average, markdown_table, memorise, open_served_engine, serving, stats_ms

TOKEN = "bench-token"


class Pinger:
    """GET /healthz every 5 ms on its own connection; the slowest answer per window."""

    def __init__(self, base_url: str) -> None:
        import httpx

        self.client = httpx.Client(base_url=base_url, timeout=60)
        self.worst = 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            t = time.perf_counter()
            self.client.get("/healthz").raise_for_status()
            self.worst = max(self.worst, time.perf_counter() - t)
            time.sleep(0.005)

    def take(self) -> float:
        worst, self.worst = self.worst, 0.0
        return worst * 1000

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.client.close()


def long_documents(n: int, lo: int, hi: int) -> list[Any]:
    """n documents of lo..hi characters (evenly spread), each a run of consecutive news."""
    from memlm.corpus import Document, load_news

    news = load_news()
    sizes = [lo + (hi - lo) * i // max(n - 1, 1) for i in range(n)]
    out, it = [], iter(news)
    for i, size in enumerate(sizes):
        parts: list[str] = []
        first = None
        while sum(len(p) + 2 for p in parts) < size:
            d = next(it)
            first = first or d
            parts.append(d.text)
        assert first is not None
        text = "\n\n".join(parts)[:size]
        out.append(
            Document(
                id=f"long-{i}",
                text=text,
                published_at=first.published_at,
                source=first.source,
                title=f"long document {i}",
                metadata={},
            )
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-gpt2")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("MEMLM_THREADS", 1)))
    ap.add_argument("--docs", type=int, default=20, help="long documents memorised")
    ap.add_argument("--min-chars", type=int, default=50_000)
    ap.add_argument("--max-chars", type=int, default=200_000)
    # MEMLM_RANDMEM_RATE: the worker applies the policy row's rate, which does not read it
    # (make_policy's 0.5 in the runs of docs/service.md)
    ap.add_argument("--rate", type=float, default=0.02, help="MEMLM_RANDMEM_RATE")
    ap.add_argument("--neighbours", type=int, default=100)
    ap.add_argument("--requests", type=int, default=20, help="timed requests per row")
    ap.add_argument("--context", type=int, default=128, help="context tokens")
    args = ap.parse_args()

    import httpx
    import numpy as np

    from memlm.db.session import make_engine, make_sessionmaker
    from service.app import create_app

    load_before = load_average()
    docs = long_documents(args.docs, args.min_chars, args.max_chars)
    settings, engine, _ = open_served_engine(
        "bench-provenance",
        model=args.model,
        threads=args.threads,
        policy="randmem",
        randmem_rate=args.rate,
        knn_k=max(args.neighbours, 1),
        ingest_token=TOKEN,
        admin_token=TOKEN,
    )
    ingest_s = memorise(engine, settings, docs)
    stats = engine.stats()
    sessions = make_sessionmaker(make_engine(settings.db_url))

    enc = engine.encoder
    rng = np.random.default_rng(0)
    contexts = []
    for d in docs:
        ids = enc.tokenize(d.text)
        at = int(rng.integers(0, len(ids) - args.context))
        contexts.append(enc.tokenizer.decode(ids[at : at + args.context]))

    app = create_app(settings, engine=engine, run_worker=False, poll=False)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    rows: list[tuple[str, list[float], list[float]]] = []  # seconds, worst /healthz ms
    doc_counts: list[int] = []
    with (
        serving(app) as base,
        httpx.Client(base_url=base, timeout=600, headers=headers) as client,
    ):
        pinger = Pinger(base)

        cached = app.state.memlm.cached

        def run(name: str, n: int, clear: bool = False) -> None:
            seconds: list[float] = []
            stall: list[float] = []
            for i in range(n):
                body = {"context": contexts[i % len(contexts)], "neighbours": args.neighbours}
                if clear:
                    cached["span_cache"].clear()
                pinger.take()
                t = time.perf_counter()
                r = client.post("/predict", json=body)
                seconds.append(time.perf_counter() - t)
                time.sleep(0.02)  # let the pinger see the end of a stall
                stall.append(pinger.take())
                r.raise_for_status()
                nbrs = r.json()["neighbours"]
                assert len(nbrs) == args.neighbours and all(x["snippet"] for x in nbrs)
                doc_counts.append(len({x["document_id"] for x in nbrs}))
            rows.append((name, seconds, stall))

        for i in range(2):  # warm-up
            client.post("/predict", json={"context": contexts[i], "neighbours": args.neighbours})
        run(f"/predict, neighbours={args.neighbours}", args.requests)
        try:
            from memlm.db.models import DocumentSpans
        except ImportError:  # before the offsets were stored
            DocumentSpans = None  # noqa: N806
        if DocumentSpans is not None:
            from sqlalchemy import delete

            run("  spans read from the database", args.requests, clear=True)
            with sessions.begin() as s:
                s.execute(delete(DocumentSpans))
            cached["span_cache"].clear()
            run("  spans not stored, first request", 1)
            run("  spans not stored, cached", args.requests)
        pinger.close()

    chars = [len(d.text) for d in docs]
    print(f"model {args.model}, threads {args.threads}")
    print(
        f"memory: {args.docs} documents of {min(chars):,}-{max(chars):,} characters "
        f"({sum(chars):,} in all), {stats['entries']} entries (RandMem), "
        f"ingested and built in {ingest_s:.0f} s"
    )
    print(
        f"{args.requests} requests per row, one at a time; the neighbours of a request come "
        f"from {min(doc_counts)}-{max(doc_counts)} documents"
    )
    print(f"load average before: {load_before}; after: {load_average()}")
    print()
    table = []
    for name, seconds, stall in rows:
        st = stats_ms(seconds)
        table.append((name, st["p50"], st["mean"], st["max"], max(stall)))
    header = ["request", "p50 ms", "mean ms", "max ms", "worst /healthz ms"]
    print(markdown_table(header, table, digits=0))


if __name__ == "__main__":
    main()
