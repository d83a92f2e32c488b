"""Which index a Milvus memory should build: recall@k and latency of each kind on the
same real keys (issue 32, item 5).

For each size N (``--sizes``): N real SmolLM2-135M keys (``--keys-npz``, as
``bench_index.py --encode-news`` writes; the last files' keys are the held-out queries;
jittered copies only where fewer real keys exist) go into one Milvus collection through
the memory (``open_milvus``; flushed, so every row sits in a sealed, indexed segment).
Then, for each kind (``--kinds``), the collection's index is replaced in place (release,
drop, create, wait for the index nodes, load; timed) and searched through the memory as
the service searches it:

- each search parameter of the sweep (``--nprobes`` for IVF_*, ``--efs`` for HNSW):
  recall@k against an exact search of the same keys, batch-1 p50/p99 over ``--single``
  queries and batch-64 p50 (``bench_memory_backends.search_rows``);
- for the kinds whose distances are approximate (IVF_SQ8, IVF_PQ), also with the exact
  re-rank of ``--rerank-depths`` candidates from the keys Milvus stores;
- with ``--predict``: ``POST /predict`` and ``Engine.predict`` against the bare forward
  over the memory with the kind's served search parameters (``bench_memory_predict``).

"bytes/entry" is the index's size by its formula (float32 keys: 4 d; SQ8: d; PQ: m; HNSW:
4 d plus ~2 M neighbour ids at the base layer), not a measurement.

    MEMLM_THREADS=1 python benchmarks/bench_milvus_index.py --keys-npz /work/keys/news \\
        --sizes 100000,1000000 --kinds hnsw,ivf_flat,ivf_sq8,ivf_pq --predict
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import numpy.typing as npt
from _common import load_average, stopwatch
from bench_memory_backends import (
    exact_truth,
    milvus_address,
    real_keys,
    rows_of,
    run_predict,
    search_rows,
    stretch,
    table,
)

from memlm.index import IndexParams
from memlm.memory import open_milvus
from memlm.memory.milvus_index import describe, milvus_index, params_for

UPSERT_ROWS = 40_000  # rows per memory call while filling (100 documents of 400)
DOC_LEN = 400


def fill(mem: Any, store: npt.NDArray[np.float16]) -> tuple[float, npt.NDArray[np.int64]]:
    """Upsert ``store`` as 400-entry documents, flush; (seconds, entry id of each row)."""
    ids = np.empty(len(store), np.int64)
    rows = np.arange(len(store))
    with stopwatch() as t:
        for a in range(0, len(store), UPSERT_ROWS):
            r = rows[a : a + UPSERT_ROWS]
            ids[r] = mem.upsert(
                store[r], r % 49152, r // DOC_LEN, r % DOC_LEN, np.full(len(r), 17_000)
            )
            print(f"#   {a + len(r):,} rows in {t.seconds:.0f} s", flush=True)
        mem.flush()
    return t.seconds, ids


def segments(mem: Any) -> int:
    from pymilvus import utility

    return len(utility.get_query_segment_info(mem.collection.name, using=mem.alias))


def reindex(mem: Any, params: IndexParams, budget: int) -> dict[str, Any]:
    """Replace the collection's index with ``params``'s, in place; the seconds of each
    step. (The service re-creates it beside the served one instead: no downtime, and a
    copy of every row, which this comparison leaves out.)"""
    from pymilvus import utility

    coll = mem.collection
    coll.release(timeout=budget)
    if coll.has_index(timeout=budget):
        coll.drop_index(timeout=budget)
    with stopwatch() as b:
        coll.create_index("key", milvus_index(params), timeout=budget)
        utility.wait_for_index_building_complete(coll.name, using=mem.alias, timeout=budget)
    with stopwatch() as ld:
        coll.load(timeout=budget)
    mem.refresh()  # the memory reads the index back (its kind and the served search params)
    assert mem.params.kind == params.kind, (mem.params, params)
    return {"build s": b.seconds, "load s": ld.seconds, "segments": segments(mem)}


def bytes_per_entry(p: IndexParams, dim: int) -> int:
    return {
        "flat": 4 * dim,
        "ivfflat": 4 * dim,
        "ivfsq8": dim,
        "ivfpq": p.m,
        "hnsw": 4 * dim + 2 * p.hnsw_m * 4,
    }[p.kind]


def sweep(p: IndexParams, args: argparse.Namespace) -> list[tuple[str, IndexParams, int | None]]:
    """(label, search parameters, re-rank depth) of each row to measure for ``p``."""
    out: list[tuple[str, IndexParams, int | None]] = []
    if p.kind == "hnsw":
        for ef in (int(x) for x in args.efs.split(",")):
            out.append((f"ef {ef}", replace(p, ef=ef), None))
    elif p.kind != "flat":
        for nprobe in (int(x) for x in args.nprobes.split(",")):
            out.append((f"nprobe {nprobe}", replace(p, nprobe=nprobe), None))
    if not p.exact_distances:
        base = replace(p, nprobe=int(args.rerank_nprobe))
        for depth in (int(x) for x in args.rerank_depths.split(",")):
            out.append((f"nprobe {base.nprobe} + re-rank {depth}", base, depth))
    return out or [("", p, None)]


def bench_size(
    mem: Any, store: npt.NDArray[np.float16], q: npt.NDArray[np.float32], args: argparse.Namespace
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    n, dim = store.shape
    with stopwatch() as tt:
        truth = exact_truth(store, q, args.k)
    fill_s, ids = fill(mem, store)
    print(f"# N={n:,}: filled in {fill_s:.0f} s, exact truth in {tt.seconds:.0f} s", flush=True)
    to_row = rows_of(ids)
    rows: list[dict[str, Any]] = []
    predict: list[dict[str, Any]] = []
    for choice in args.kinds.split(","):
        p = params_for(n, dim, mem.segment_rows(), choice)
        if p.kind == "hnsw":
            p = replace(p, hnsw_m=args.hnsw_m, ef_construction=args.ef_construction)
        try:
            built = reindex(mem, p, args.build_budget)
        except Exception as exc:  # noqa: BLE001 - a build past the budget is a result
            print(f"# {describe(p)} at N={n:,}: not built: {exc!r}"[:400], flush=True)
            rows.append({"N": n, "index": describe(p), "build s": f"not built: {exc!r}"[:80]})
            continue
        base = {"N": n, "index": describe(p), **built, "bytes/entry": bytes_per_entry(p, dim)}
        for a in range(0, len(q), 64):  # warm: the segments just loaded, paged in
            mem.search(q[a : a + 64], args.k)
        for label, searched, depth in sweep(p, args):
            mem.params = searched
            if depth is None:
                r = search_rows(mem, q, args.k, truth, to_row, args.single)
            else:
                r = search_rows(_Reranked(mem, depth), q, args.k, truth, to_row, args.single)
            rows.append({**base, "search": label, **r, "load": load_average()})
            print(table(rows[-1:]), flush=True)
        mem.params = mem._index_params()  # the served search parameters again
        if args.predict:
            predict += run_predict("milvus", args.url, args, f"N={n:,}, {describe(mem.params)}")
    return rows, predict


class _Reranked:
    """The memory with a re-rank depth on every search (the caller's ``depth``)."""

    def __init__(self, mem: Any, depth: int) -> None:
        self.mem, self.depth = mem, depth

    def search(self, q: npt.NDArray[np.float32], k: int) -> Any:
        return self.mem.search(q, k, depth=self.depth)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--keys-npz", type=Path, required=True)
    ap.add_argument("--sizes", default="100000")
    ap.add_argument("--kinds", default="hnsw,ivf_flat,ivf_sq8,ivf_pq")
    ap.add_argument("--nprobes", default="16,32,64,128")
    ap.add_argument("--efs", default="64,128,256")
    ap.add_argument("--hnsw-m", type=int, default=16)
    ap.add_argument("--ef-construction", type=int, default=128)
    ap.add_argument("--rerank-depths", default="256,1024")
    ap.add_argument("--rerank-nprobe", type=int, default=64)
    ap.add_argument("--queries", type=int, default=256)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--single", type=int, default=50, help="batch-1 searches timed")
    ap.add_argument("--stretch-noise", type=float, default=0.1)
    ap.add_argument("--build-budget", type=int, default=3600, help="seconds per index build")
    ap.add_argument("--milvus", default=None, help="host:port (default: embedded)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--predict", action="store_true", help="/predict against the bare forward")
    ap.add_argument("--predict-rounds", type=int, default=40)
    args = ap.parse_args()
    faiss.omp_set_num_threads(int(os.environ.get("MEMLM_THREADS", "1")))
    real, q = real_keys(args.keys_npz, args.queries)
    print(
        f"# {len(real):,} real SmolLM2 keys, {len(q)} held-out queries, k={args.k}; "
        f"load average {load_average()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        flush=True,
    )
    work = Path(tempfile.mkdtemp(prefix="bench-milvus-index-", dir=args.workdir))
    host, port, server = milvus_address(args.milvus, work)
    rows: list[dict[str, Any]] = []
    predict: list[dict[str, Any]] = []
    try:
        for n in (int(s) for s in args.sizes.split(",")):
            store = stretch(real, n, args.stretch_noise)
            real_n = min(n, len(real))
            print(f"# N={n:,}: {real_n:,} real keys, {n - real_n:,} jittered copies", flush=True)
            # seal=0: the fill flushes once; the index is replaced by hand (``reindex``)
            args.url = f"milvus://{host}:{port}/bench_index_{n}?seal=0&timeout=600"
            mem = open_milvus(args.url, store.shape[1])
            try:
                r, p = bench_size(mem, store, q, args)
                rows += r
                predict += p
            finally:
                mem.drop()
                mem.close()
        print(f"\n## Recall@{args.k} and latency by index (load average {load_average()})\n")
        print(table(rows))
        if predict:
            print("\n## /predict over each index against the bare forward\n")
            print(table(predict))
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
