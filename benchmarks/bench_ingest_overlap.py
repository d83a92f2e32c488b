"""MoNIM's ingest with the next document encoded ahead (the model and the memory side by side).

The engine's memory holds the ingested documents of a news slice (their real keys from the
evaluation's encoder cache, under the index the service builds for that size); then the
last day's documents are ingested with MoNIM, each one prepared (encode, search, decide)
and stored, in order:

- **encoder alone**: ``Encoder.encode_ids`` of the same documents, one after the other;
- **sequential**: ``prepare_document`` + ``store_document``, as the worker did before;
- **encode ahead**: the same, with ``next_text`` (the next document) given to each
  prepare, as the worker does with ``MEMLM_ENCODE_AHEAD``: the next forward starts on a
  thread of its own once this document's outputs are in hand, and runs while it is
  searched, decided and stored.

Each ingest starts from a copy of the same memory; the rounds alternate the two paths
(best of ``--rounds``). The decisions must be equal; the script says so.

    MEMLM_CACHE_DIR=/work/cache-speed MEMLM_THREADS=1 PYTHONPATH=. \\
        python benchmarks/bench_ingest_overlap.py --days 10 --max-docs-per-day 20
"""

from __future__ import annotations

import argparse
import datetime as dt
import shutil
import tempfile
import time
from pathlib import Path

import faiss
import numpy as np
import torch
from _common import load_average, markdown_table

from memlm.corpus import load_corpus
from memlm.encoder import Encoder, WindowConfig
from memlm.engine import Engine
from memlm.evaluate import TokenCache, plan_stream
from memlm.index import IndexParams
from memlm.knnlm import KnnParams
from memlm.memory import open_memory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--start", default="2017-02-13")
    ap.add_argument("--days", type=int, default=10)
    ap.add_argument("--max-docs-per-day", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch and faiss threads, each")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--docs", type=int, default=None, help="ingest only the first N")
    ap.add_argument("--precision", default="auto", help="the encoder's (auto: the engine's)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    print(f"load average before: {load_average()}")
    enc = Encoder.load("smollm2-135m", threads=args.threads, precision=args.precision)
    plans = plan_stream(
        load_corpus("news"),
        days=args.days,
        start=dt.date.fromisoformat(args.start),
        max_docs_per_day=args.max_docs_per_day,
    )
    cache = TokenCache(enc, WindowConfig())
    memory_docs = [d for p in plans[:-1] for d in p.train]
    ingest = plans[-1].train[: args.docs]
    tmp = Path(tempfile.mkdtemp())
    base = tmp / "base"
    mem = open_memory(None, base, enc.dim, key_precision=enc.precision)
    with mem.writer():
        for doc, o in enumerate(cache.get_many([d.text for d in memory_docs])):
            mem.put_document(doc, o.keys, o.targets, o.positions, 17000)
    n = mem.count()
    mem.build(IndexParams.for_size(n, enc.dim))
    mem.close()
    # the constant the service would serve after a build on this stream (MoNIM's decision)
    knn = KnnParams(k=64, temperature=2.0, lmbda=0.05)
    ids = [enc.tokenize(d.text) for d in ingest]
    n_tok = sum(len(i) - 1 for i in ids)
    print(
        f"memory: {n} entries of {len(memory_docs)} documents; "
        f"ingest {len(ingest)} documents, {n_tok} tokens"
    )

    def encoder_alone() -> None:
        for i in ids:
            enc.encode_ids(i, WindowConfig())

    def ingest_run(ahead: bool, r: int) -> list[np.ndarray]:
        data = tmp / f"{'ahead' if ahead else 'seq'}-{r}"
        shutil.copytree(base, data)
        eng = Engine.open(data, encoder=enc, knn=knn, grid=None, policy="monim")
        eng.reload_index()
        masks = []
        for j, d in enumerate(ingest):
            after = ingest[j + 1].text if ahead and j + 1 < len(ingest) else None
            prep = eng.prepare_document(10_000 + j, d.text, 17001, next_text=after)
            eng.store_document(prep)
            masks.append(prep.store)
        eng.close()
        shutil.rmtree(data)
        return masks

    enc.encode_ids(ids[0], WindowConfig())  # warm-up: the first forward allocates
    best: dict[str, float] = {}
    masks: dict[str, list[np.ndarray]] = {}
    paths = {
        "encoder alone": lambda r: encoder_alone(),
        "ingest, sequential": lambda r: masks.__setitem__("seq", ingest_run(False, r)),
        "ingest, encode ahead": lambda r: masks.__setitem__("ahead", ingest_run(True, r)),
    }
    for r in range(args.rounds):
        for name in list(paths) if r % 2 == 0 else list(paths)[::-1]:
            t0 = time.perf_counter()
            paths[name](r)
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
            print(f"round {r} {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    same = all(np.array_equal(a, b) for a, b in zip(masks["seq"], masks["ahead"], strict=True))
    enc_rate = n_tok / best["encoder alone"]
    rows = [(name, f"{n_tok / s:,.0f}", f"{n_tok / s / enc_rate:.2f}x") for name, s in best.items()]
    print(f"\nload average after: {load_average()}")
    print(f"MoNIM decisions of the two ingests equal: {same}\n")
    print(markdown_table(["path", "tokens/s", "vs encoder alone"], rows))
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
