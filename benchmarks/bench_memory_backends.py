"""The faiss and milvus memories side by side, on the same keys, in one run.

For each backend: insert throughput (one ``append`` per document, as the ingest worker
writes), searchable-after-insert latency (a document appended by one handle, polled by
another until its first key's top-1 neighbour is its own entry: what the API sees of a
worker's write), search latency at batch 1 and 64 and recall@k against an exact search
over the same keys, before and after ``build`` (FLAT below 50k entries, IVF_PQ above,
``IndexParams.for_size``). Milvus's IVF_PQ also runs with the exact re-rank from its
stored keys (``rerank=1``). With ``--predict``, the engine's next-token prediction
(``Engine.predict`` on a 128-token context: forward, search, interpolation) over each
filled memory, against the bare forward, interleaved.

Keys: real SmolLM2-135M keys of the bundled news (``--keys-npz``: a folder of encoder
``*.npz`` files, as ``bench_index.py --encode-news`` writes), stretched to N with jittered
copies when fewer real keys exist (``--stretch-noise`` times each key's spread).

    python benchmarks/bench_memory_backends.py --keys-npz /tmp/keys --sizes 100000 --predict

The Milvus server is the embedded ``milvus==2.3.5`` (started here) or ``--milvus host:port``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import numpy.typing as npt

from memlm.index import IndexParams
from memlm.memory import open_faiss, open_milvus
from memlm.memory.embedded import start_embedded
from memlm.memory.url import MilvusURL

DOC_LEN = 400  # entries per appended document (~MoNIM's share of a news article)


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def real_keys(
    folder: Path, n_queries: int
) -> tuple[npt.NDArray[np.float16], npt.NDArray[np.float32]]:
    """All keys of the folder's files; the last files' keys are the queries (held out)."""
    files = sorted(f for f in folder.glob("*.npz") if not f.name.endswith(".tmp.npz"))
    arrays = []
    for f in files:
        with np.load(f) as z:
            arrays.append(z["keys"].astype(np.float16))
    queries: list[npt.NDArray[np.float16]] = []
    while arrays and sum(len(q) for q in queries) < n_queries:
        queries.insert(0, arrays.pop())
    if not arrays:
        raise SystemExit(f"{folder}: not enough keys for {n_queries} queries and a store")
    return np.concatenate(arrays), np.concatenate(queries)[:n_queries].astype(np.float32)


def stretch(
    keys: npt.NDArray[np.float16], n: int, noise: float, seed: int = 0
) -> npt.NDArray[np.float16]:
    """``n`` keys: the real ones, then jittered copies (Gaussian, ``noise`` x per-dim std)."""
    if n <= len(keys):
        return keys[:n]
    rng = np.random.default_rng(seed)
    std = keys.astype(np.float32).std(0) * noise
    out = [keys]
    have = len(keys)
    while have < n:
        m = min(len(keys), n - have)
        base = keys[rng.integers(0, len(keys), m)].astype(np.float32)
        out.append(
            (base + rng.standard_normal(base.shape).astype(np.float32) * std).astype(np.float16)
        )
        have += m
    return np.concatenate(out)


def ms(samples: list[float]) -> float:
    return 1000 * statistics.median(samples)


def recall(found: npt.NDArray[np.int64], truth: npt.NDArray[np.int64]) -> float:
    return float(
        np.mean(
            [len(np.intersect1d(f[f >= 0], t)) / len(t) for f, t in zip(found, truth, strict=True)]
        )
    )


def docs_of(keys: npt.NDArray[np.float16]):
    """(keys, values, documents, positions, days) per document of DOC_LEN entries."""
    for d, a in enumerate(range(0, len(keys), DOC_LEN)):
        k = keys[a : a + DOC_LEN]
        m = len(k)
        yield (
            a,
            (
                k,
                np.arange(a, a + m) % 49152,
                np.full(m, d),
                np.arange(m),
                np.full(m, 17_000 + d // 100),
            ),
        )


def search_rows(
    mem: Any,
    q: npt.NDArray[np.float32],
    k: int,
    truth: npt.NDArray[np.int64],
    to_row: Any,
    reps: int,
) -> dict[str, float]:
    mem.search(q[:2], k)  # warm
    one = []
    for j in range(reps):
        t0 = time.perf_counter()
        mem.search(q[j : j + 1], k)
        one.append(time.perf_counter() - t0)
    b64 = []
    found = np.empty((0, k), np.int64)
    for a in range(0, len(q), 64):
        t0 = time.perf_counter()
        _, ids, _ = mem.search(q[a : a + 64], k)
        b64.append(time.perf_counter() - t0)
        found = np.concatenate([found, to_row(ids)])
    return {"b1 ms": ms(one), "b64 ms": ms(b64), f"recall@{k}": recall(found, truth)}


def visibility(
    writer: Any, reader: Any, keys: npt.NDArray[np.float16], trials: int, first_doc: int
) -> float:
    """Median seconds from a document's append returning to its first key being found by
    another handle (polled every 10 ms)."""
    lat = []
    rng = np.random.default_rng(7)
    scale = float(np.abs(keys).max()) * 10
    for t in range(trials):
        # far from every stored key, so its own entry is its only possible top-1
        k = (rng.standard_normal((50, keys.shape[1])) * scale).astype(np.float16)
        ids = writer.append(
            k, np.zeros(len(k)), np.full(len(k), first_doc + t), np.arange(len(k)), np.zeros(len(k))
        )
        t0 = time.perf_counter()
        while True:
            reader.refresh()
            _, got, _ = reader.search(k[:1].astype(np.float32), 1)
            if got[0, 0] == ids[0]:
                break
            if time.perf_counter() - t0 > 30:
                raise SystemExit("an appended entry was not searchable after 30 s")
            time.sleep(0.01)
        lat.append(time.perf_counter() - t0)
    return statistics.median(lat)


def bench_backend(
    name: str,
    open_pair: Any,
    store: npt.NDArray[np.float16],
    q: npt.NDArray[np.float32],
    truth: npt.NDArray[np.int64],
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    writer, reader = open_pair()
    rows = []
    n = len(store)
    id_of_row = np.empty(n, np.int64)
    t0 = time.perf_counter()
    for a, entry in docs_of(store):
        id_of_row[a : a + len(entry[0])] = writer.append(*entry)
    insert_s = time.perf_counter() - t0
    order = np.argsort(id_of_row)
    sorted_ids = id_of_row[order]

    def to_row(ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        pos = np.clip(np.searchsorted(sorted_ids, ids), 0, n - 1)
        hit = (ids >= 0) & (sorted_ids[pos] == ids)
        return np.where(hit, order[pos], -1)

    vis = visibility(writer, reader, q, args.visibility_trials, first_doc=10_000_000)
    for t in range(args.visibility_trials):  # the probes leave the memory
        writer.delete_document(10_000_000 + t)
    base = {
        "backend": name,
        "N": n,
        "insert entries/s": n / insert_s,
        "visible after ms": 1000 * vis,
    }
    rows.append(
        {
            **base,
            "index": "fresh (unbuilt)",
            **search_rows(reader, q, args.k, truth, to_row, args.single),
        }
    )
    t0 = time.perf_counter()
    info = writer.build(None)
    build_s = time.perf_counter() - t0
    reader.refresh()
    if hasattr(reader, "index"):
        reader.index.reload()
    params = getattr(writer, "params", None) or IndexParams(**info["params"])
    label = "FLAT" if params.kind == "flat" else f"IVF_PQ {params.nlist}/{params.m}/{params.nprobe}"
    rows.append(
        {
            **base,
            "index": f"{label}, build {build_s:.0f} s",
            **search_rows(reader, q, args.k, truth, to_row, args.single),
        }
    )
    if name == "milvus" and params.kind == "ivfpq":
        reader.url = MilvusURL(**{**reader.url.__dict__, "rerank": True})
        rows.append(
            {
                **base,
                "index": f"{label} + exact re-rank (x{params.rerank_factor})",
                **search_rows(reader, q, args.k, truth, to_row, args.single),
            }
        )
        reader.url = MilvusURL(**{**reader.url.__dict__, "rerank": False})
    return rows, writer, reader


def table(rows: list[dict[str, Any]]) -> str:
    cols = list(dict.fromkeys(c for r in rows for c in r))

    def f(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if v < 1 else f"{v:.1f}" if v < 100 else f"{v:,.0f}"
        return str(v)

    out = [
        "| " + " | ".join(cols) + " |",
        "|" + "|".join("---:" if c not in ("backend", "index") else "---" for c in cols) + "|",
    ]
    out += ["| " + " | ".join(f(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--keys-npz", type=Path, required=True)
    ap.add_argument("--sizes", default="100000")
    ap.add_argument("--queries", type=int, default=256)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--single", type=int, default=50, help="batch-1 searches timed")
    ap.add_argument("--visibility-trials", type=int, default=10)
    ap.add_argument("--stretch-noise", type=float, default=0.1)
    ap.add_argument(
        "--milvus", default=None, help="host:port of a running server (default: embedded)"
    )
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument(
        "--predict", action="store_true", help="also time Engine.predict against the bare forward"
    )
    ap.add_argument("--predict-rounds", type=int, default=40)
    args = ap.parse_args()
    faiss.omp_set_num_threads(int(os.environ.get("MEMLM_THREADS", "1")))
    real, q = real_keys(args.keys_npz, args.queries)
    print(
        f"# {len(real)} real SmolLM2 keys, {len(q)} held-out queries; load average {load_average()}",
        flush=True,
    )
    work = Path(tempfile.mkdtemp(prefix="bench-mem-", dir=args.workdir))
    server = None
    if args.milvus:
        host, port = args.milvus.split(":")
    else:
        server = start_embedded(work / "milvus")
        host, port = server.host, str(server.port)
        print(f"# embedded Milvus started in {server.start_seconds:.1f} s", flush=True)
    dim = real.shape[1]
    all_rows = []
    try:
        for n in [int(s) for s in args.sizes.split(",")]:
            store = stretch(real, n, args.stretch_noise)
            exact = faiss.IndexFlatL2(store.shape[1])
            exact.add(store.astype(np.float32))
            _, truth = exact.search(q, args.k)
            del exact

            def faiss_pair(n: int = n) -> tuple[Any, Any]:
                w = open_faiss(work / f"faiss-{n}", dim, shared=True)
                r = open_faiss(work / f"faiss-{n}", None, readonly=True)
                return w, r

            def milvus_pair(n: int = n) -> tuple[Any, Any]:
                url = f"milvus://{host}:{port}/bench_{n}?timeout=600"
                return open_milvus(url, dim), open_milvus(url, dim)

            for name, pair in (("faiss", faiss_pair), ("milvus", milvus_pair)):
                rows, w, r = bench_backend(name, pair, store, q, truth, args)
                all_rows += rows
                print(table(rows), flush=True)
                if server is not None:
                    print(f"# Milvus server RSS {server.rss_bytes() / 2**20:.0f} MiB", flush=True)
                if args.predict:
                    from bench_memory_predict import predict_rows

                    all_rows_p = predict_rows(name, r, args)
                    print(table(all_rows_p), flush=True)
                w.close()
                r.close()
        print(f"\n## all rows (load average {load_average()})\n")
        print(table(all_rows))
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
