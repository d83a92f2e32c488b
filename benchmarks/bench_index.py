"""Benchmark the memory index: build time, query time, recall vs exact, bytes per entry.

Synthetic clustered keys (float16, like the datastore) stand in for LM keys. For each N
the datastore is filled, ``build_index`` runs with ``IndexParams.for_size(N, dim)`` (flat
below 50k, IVF-PQ above), and queries (data points plus noise) are searched through
``MemoryIndex`` batched (one call) and one at a time. Recall@k is against an exact flat
search over the same keys.

    python benchmarks/bench_index.py                       # default, ~2-3 min
    python benchmarks/bench_index.py --sizes 1000000 --k 1024   # DESIGN scale
    python benchmarks/bench_index.py --crossover --k 1024       # direct vs BLAS
    python benchmarks/bench_index.py --sizes 100000 --incremental 10000   # nightly vs retrain
    python benchmarks/bench_index.py --append --workdir /work         # durable appends
    python benchmarks/bench_index.py --f16 --k 1024                   # re-rank conversion
    python benchmarks/bench_index.py --search-paths --sizes 300000 --threads 1  # PQ table, re-rank
    python benchmarks/bench_index.py --gather --sizes 300000 --k 768 --repeat 3   # key rows
    python benchmarks/bench_index.py --keys-npz ~/.cache/memlm/bench-keys \
        --encode-news 110000 --sizes 20000,100000                     # real SmolLM2 keys

Threads: ``--threads``, else MEMLM_THREADS, else faiss's default.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import faiss
import numpy as np
import numpy.typing as npt
from _common import recall

from memlm.datastore import Datastore
from memlm.index import IndexParams, MemoryIndex, build_index


def make_keys(
    n: int, dim: int, n_clusters: int, seed: int, chunk: int = 100_000
) -> tuple[npt.NDArray[np.float32], list[npt.NDArray[np.float16]]]:
    """Cluster centres and chunks of clustered float16 keys (norm spread like LM keys)."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((n_clusters, dim)).astype(np.float32) * 2.0
    # Cluster sizes follow a Zipf-like law, as token contexts do.
    weights = 1.0 / np.arange(1, n_clusters + 1) ** 0.8
    weights /= weights.sum()
    chunks = []
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        c = rng.choice(n_clusters, size=m, p=weights)
        x = centers[c] + rng.standard_normal((m, dim), dtype=np.float32)
        chunks.append(x.astype(np.float16))
    return centers, chunks


def npz_keys(
    folder: Path, n: int, n_queries: int
) -> tuple[list[npt.NDArray[np.float16]], npt.NDArray[np.float16]]:
    """Real LM keys from encoder-cache ``*.npz`` files (array "keys"): the first files fill
    the store (up to n keys), whole later files give the queries (held-out documents)."""
    files = sorted(f for f in folder.glob("*.npz") if not f.name.endswith(".tmp.npz"))
    store: list[npt.NDArray[np.float16]] = []
    queries: list[npt.NDArray[np.float16]] = []
    have = 0
    for f in files:
        with np.load(f) as z:
            k = z["keys"].astype(np.float16)
        if have < n:
            store.append(k[: n - have])
            have += len(store[-1])
        else:
            queries.append(k)
            if sum(len(x) for x in queries) >= n_queries:
                break
    if have < n or not queries:
        raise SystemExit(f"{folder}: {have} keys in {len(files)} files, need {n} + queries")
    return store, np.concatenate(queries)[:n_queries]


def encode_news(
    folder: Path, n_tokens: int, threads: int | None, shard: tuple[int, int] = (0, 1)
) -> None:
    """Write SmolLM2-135M keys of the bundled news, in date order, one float16 ``.npz``
    per article, until ``n_tokens`` keys exist (files already there are reused).

    Windows of 512 tokens overlapping by one (stride 511) so each token costs about one forward.
    ``shard`` (i, n): this process encodes articles i, i + n, ... (and stops at about
    ``n_tokens / n`` of its own), so n processes fill one folder side by side.
    """
    from memlm.corpus import load_news
    from memlm.encoder import Encoder, WindowConfig

    folder.mkdir(parents=True, exist_ok=True)
    enc = None
    window = WindowConfig(context=512, stride=511)
    have = 0
    t0 = time.perf_counter()
    part, parts = shard
    for i, doc in enumerate(load_news()):
        if i % parts != part:
            continue
        f = folder / f"{i:05d}.npz"
        if not f.exists():
            enc = enc or Encoder.load(threads=threads)
            keys = enc.encode_ids(enc.tokenize(doc.text), window).keys.astype(np.float16)
            np.savez(folder / f"{i:05d}.tmp.npz", keys=keys)
            os.replace(folder / f"{i:05d}.tmp.npz", f)
        with np.load(f) as z:
            have += len(z["keys"])
        if have * parts >= n_tokens:
            break
    print(
        f"# {have} news keys (shard {part}/{parts}) in {folder} ({time.perf_counter() - t0:.0f} s)",
        flush=True,
    )


def bench_one(args: argparse.Namespace, n: int, workdir: Path) -> dict[str, object]:
    k = args.k
    if args.keys_npz is not None:
        chunks, real_q = npz_keys(args.keys_npz, n, args.queries)
        dim = real_q.shape[1]
    else:
        dim = args.dim
        _, chunks = make_keys(n, dim, args.clusters, seed=n)
    ds = Datastore.open(workdir / f"ds-{n}", dim=dim)
    for i, x in enumerate(chunks):
        m = len(x)
        ds.append(x, np.zeros(m, np.int32), i, np.arange(m), 0)
    params = IndexParams.for_size(n, dim)
    if args.nlist or args.m:  # force IVF-PQ, e.g. to try it on a few real keys
        base = IndexParams.for_size(max(n, 50_000), dim)
        nlist = args.nlist or base.nlist
        params = replace(
            base,
            nlist=nlist,
            m=args.m or base.m,
            nprobe=args.nprobe or base.nprobe,
            train_size=max(nlist, 256, min(n, base.train_size)),
        )
    elif args.nprobe and params.kind == "ivfpq":
        params = replace(params, nprobe=args.nprobe)
    t0 = time.perf_counter()
    info = build_index(ds, workdir / f"ix-{n}", params, progress=False)
    build_s = time.perf_counter() - t0
    inc = incremental(args, ds, workdir / f"ix-{n}", params, chunks) if args.incremental else {}
    mem = MemoryIndex(ds, workdir / f"ix-{n}")  # the incremental version, if one was built

    rng = np.random.default_rng(1)
    if args.keys_npz is not None:
        q = real_q.astype(np.float32)
    else:
        qi = np.sort(rng.choice(n, size=args.queries, replace=False))
        noise = rng.standard_normal((args.queries, dim)).astype(np.float32)
        q = ds.keys(qi).astype(np.float32) + noise * np.float32(args.query_noise)

    # Exact ground truth: a flat index over the same float16 keys (and the added ones).
    exact = faiss.IndexFlatL2(dim)
    for x in chunks:
        exact.add(x.astype(np.float32))
    _, truth = exact.search(q, k)
    del exact

    mem.search(q[:2], k)  # warm up (page cache, lazy allocations)
    row: dict[str, object] = {
        "N": n,
        "kind": params.kind,
        "nlist/m/nprobe": (
            "-" if params.kind == "flat" else f"{params.nlist}/{params.m}/{params.nprobe}"
        ),
        "build s": build_s,
        "train s": info.train_seconds,
        "add s": info.add_seconds,
        "index B/entry": (info.path / "index.faiss").stat().st_size / info.entries,
        "store B/entry": ds.stats()["bytes_on_disk"] / len(ds),
    }
    row.update(inc)
    modes = [False, True] if params.kind == "ivfpq" else [False]
    for rerank in modes:
        tag = " +rr" if rerank else ""
        t0 = time.perf_counter()
        _, ids = mem.search(q, k, rerank=rerank)
        row[f"batch ms/q{tag}"] = (time.perf_counter() - t0) * 1000 / len(q)
        t0 = time.perf_counter()
        for j in range(args.single):
            mem.search(q[j : j + 1], k, rerank=rerank)
        row[f"single ms/q{tag}"] = (time.perf_counter() - t0) * 1000 / args.single
        row[f"recall@{k}{tag}"] = recall(ids, truth)
    return row


def incremental(
    args: argparse.Namespace,
    ds: Datastore,
    root: Path,
    params: IndexParams,
    chunks: list[npt.NDArray[np.float16]],
) -> dict[str, object]:
    """Append ``--incremental`` entries (copies of stored keys plus noise), then time the
    nightly build (incremental: a copy of the version plus the new entries) beside a full
    retrain over the same N + added entries, into a scratch root."""
    add = args.incremental
    rng = np.random.default_rng(2)
    pool = np.concatenate(chunks)
    new = pool[rng.integers(0, len(pool), add)].astype(np.float32)
    new += rng.standard_normal(new.shape, dtype=np.float32) * np.float32(args.query_noise)
    ds.append(new.astype(np.float16), np.zeros(add, np.int32), -1, np.arange(add), 1)
    t0 = time.perf_counter()
    info = build_index(ds, root, progress=False)
    inc_s = time.perf_counter() - t0
    assert info.mode == "incremental", info.reason
    # the scratch root: the served one keeps serving the incremental version
    t0 = time.perf_counter()
    build_index(ds, root.with_name(root.name + "-full"), params, progress=False)
    full_s = time.perf_counter() - t0
    chunks.append(new.astype(np.float16))  # they join the exact ground truth
    return {f"incr +{add} s": inc_s, f"full retrain N+{add} s": full_s}


def crossover(args: argparse.Namespace) -> None:
    """ms per query of a flat search, direct scan vs BLAS, by queries per call."""
    rng = np.random.default_rng(0)
    n = int(args.sizes.split(",")[-1])
    index = faiss.IndexFlatL2(args.dim)
    index.add(rng.standard_normal((n, args.dim), dtype=np.float32))
    q = rng.standard_normal((32, args.dim), dtype=np.float32)
    index.search(q[:1], args.k)
    print(f"# flat N={n} dim={args.dim} k={args.k}: best of 3, ms per query")
    print("| queries per call | direct | BLAS |")
    print("|---|---|---|")
    for nq in (1, 2, 4, 8, 16, 32):
        row = []
        for threshold in (2**31 - 1, 1):  # never BLAS, always BLAS
            faiss.cvar.distance_compute_blas_threshold = threshold
            best = min(_timed(index, q[:nq], args.k) for _ in range(3))
            row.append(best * 1000 / nq)
        print(f"| {nq} | {row[0]:.1f} | {row[1]:.1f} |")


def append_latency(args: argparse.Namespace) -> None:
    """Durable append latency (5 data fsyncs + manifest + directory) by batch size."""
    rng = np.random.default_rng(0)
    print(f"# Datastore.append, dim={args.dim}, 20 appends per size, in {args.workdir or 'tmp'}")
    print("| entries per append | ms per append | entries/s |")
    print("|---|---|---|")
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        ds = Datastore.open(Path(tmp) / "ds", dim=args.dim)
        for n in (1, 100, 700, 5000):
            keys = rng.standard_normal((n, args.dim)).astype(np.float16)
            t0 = time.perf_counter()
            for i in range(20):
                ds.append(keys, np.arange(n), i, np.arange(n), 0)
            dt = (time.perf_counter() - t0) / 20
            print(f"| {n} | {dt * 1000:.1f} | {n / dt:.0f} |")
        ds.close()


def _timed(index: faiss.Index, q: npt.NDArray[np.float32], k: int) -> float:
    t0 = time.perf_counter()
    index.search(q, k)
    return time.perf_counter() - t0


def fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if v < 10 else f"{v:.1f}"
    return str(v)


def f16_conversion(args: argparse.Namespace) -> None:
    """float16 -> float32 of one re-rank block (4 * k candidates of dim), three ways."""
    import torch

    from memlm.index.params import f16_to_f32

    threads = args.threads or int(os.environ.get("MEMLM_THREADS", "1"))
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4 * args.k, args.dim)).astype(np.float16)
    sq = faiss.ScalarQuantizer(args.dim, faiss.ScalarQuantizer.QT_fp16)
    ways = {
        "faiss fp16 decoder (before)": lambda: sq.decode(x.view(np.uint8)),
        "numpy astype": lambda: x.astype(np.float32),
        "memlm f16_to_f32 (torch)": lambda: f16_to_f32(x),
    }
    ref = x.astype(np.float32)
    best = {name: float("inf") for name in ways}
    for _ in range(args.repeat):  # interleaved: load hits every way alike
        for name, f in ways.items():
            t0 = time.perf_counter()
            for _ in range(20):
                out = f()
            best[name] = min(best[name], (time.perf_counter() - t0) / 20)
            assert np.array_equal(out, ref), name  # exact, all three
    print(
        f"# block {x.shape[0]} x {args.dim} float16, threads={threads}, best of {args.repeat}, "
        f"load-avg(1m)={os.getloadavg()[0]:.2f}"
    )
    base = best["faiss fp16 decoder (before)"]
    print("| conversion | ms per block | ns per value | speed-up |")
    print("|---|---:|---:|---:|")
    for name, t in best.items():
        print(f"| {name} | {t * 1e3:.3f} | {t * 1e9 / x.size:.2f} | {base / t:.1f}x |")


def gather(args: argparse.Namespace) -> None:
    """Random key rows from a datastore segment: a memmap's fancy indexing (before) against
    ``np.take`` (Datastore.keys now), interleaved, 4 x --k rows a call as one re-rank block."""
    n = int(args.sizes.split(",")[-1])
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        ds = Datastore.open(Path(tmp) / "ds", dim=args.dim)
        for i, x in enumerate(make_keys(n, args.dim, args.clusters, seed=n)[1]):
            ds.append(x, np.zeros(len(x), np.int32), i, np.arange(len(x)), 0)
        keys = ds._segment_maps(0)["keys"]  # one segment: the memmap the gather reads
        rng = np.random.default_rng(0)
        batches = [rng.integers(0, len(keys), 4 * args.k) for _ in range(200)]
        ways = {
            "memmap fancy indexing (before)": lambda ids: keys[ids],
            "np.take (Datastore.keys)": lambda ids: np.take(np.asarray(keys), ids, axis=0),
        }
        best = {name: float("inf") for name in ways}
        for _ in range(args.repeat):
            for name, f in ways.items():
                t0 = time.perf_counter()
                for ids in batches:
                    f(ids)
                best[name] = min(best[name], time.perf_counter() - t0)
        ds.close()
    rows = len(batches) * 4 * args.k
    print(f"# N={n} x {args.dim} float16, {rows} random rows, best of {args.repeat}")
    base = best["memmap fancy indexing (before)"]
    print("| gather | ns per row | speed-up |")
    print("|---|---:|---:|")
    for name, t in best.items():
        print(f"| {name} | {t * 1e9 / rows:.0f} | {base / t:.2f}x |")


def _set_diff(a: npt.NDArray[np.int64], b: npt.NDArray[np.int64]) -> float:
    """Share of each row's neighbours not among the other's (order ignored)."""
    return float(
        np.mean([1 - len(np.intersect1d(x, y)) / len(x) for x, y in zip(a, b, strict=True)])
    )


def search_paths(args: argparse.Namespace) -> None:
    """IVF-PQ search_values with and without the precomputed table (MEMLM_PQ_TABLE_MB)
    and the broadcast re-rank (search.RERANK_BROADCAST) in one piece or in cache-sized
    pieces (search.RERANK_CHUNK_ELEMENTS), side by side and interleaved.

    k = 64 is MoNIM's ingest search (the served k; 1,024 candidates re-ranked), k = 1,024
    the held-out search (4,096 candidates).  Queries are news-like: data points plus noise,
    searched in batches of --queries, as a document's tokens are.
    """
    import memlm.index.search as search_mod

    configs = {  # name: (table MB, broadcast re-rank, its float32 piece in elements)
        "baseline (no table, numpy re-rank)": ("0", False, 0),
        "precomputed table": ("4096", False, 0),
        "broadcast re-rank": ("0", True, 0),
        "both, re-rank in one piece": ("4096", True, 0),
        "both, re-rank in cache-sized pieces (default)": (
            "4096",
            True,
            search_mod.RERANK_CHUNK_ELEMENTS,
        ),
    }
    rows = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for n in (int(x) for x in args.sizes.split(",")):
            _, chunks = make_keys(n, args.dim, args.clusters, seed=n)
            ds = Datastore.open(Path(tmp) / f"ds-{n}", dim=args.dim)
            for i, x in enumerate(chunks):
                ds.append(x, np.zeros(len(x), np.int32), i, np.arange(len(x)), 0)
            params = IndexParams.for_size(n, args.dim)
            t0 = time.perf_counter()
            build_index(ds, Path(tmp) / f"ix-{n}", params, progress=False)
            build_s = time.perf_counter() - t0
            rng = np.random.default_rng(n + 1)
            data = np.concatenate(chunks)[rng.integers(0, n, 4 * args.queries)]
            q = (data + rng.standard_normal(data.shape) * args.query_noise).astype(np.float32)
            for k in (64, 1024):
                best: dict[str, float] = {}
                ids: dict[str, npt.NDArray[np.int64]] = {}
                for _ in range(args.repeat):
                    for name, (mb, broadcast, piece) in configs.items():
                        os.environ["MEMLM_PQ_TABLE_MB"] = mb
                        search_mod.RERANK_BROADCAST = broadcast
                        search_mod.RERANK_CHUNK_ELEMENTS = piece
                        mem = MemoryIndex(ds, Path(tmp) / f"ix-{n}")
                        mem.search_values(q[:8], k)  # warm the pages
                        t = time.perf_counter()
                        got = [
                            mem.search_values(q[s : s + args.queries], k)[1]
                            for s in range(0, len(q), args.queries)
                        ]
                        dt = time.perf_counter() - t
                        best[name] = min(best.get(name, np.inf), dt)
                        ids[name] = np.concatenate(got)
                baseline = "baseline (no table, numpy re-rank)"
                base = best[baseline]
                for name in configs:
                    rows.append(
                        {
                            "N": n,
                            "nlist/m": f"{params.nlist}/{params.m}",
                            "k": k,
                            "path": name,
                            "queries/s": round(len(q) / best[name]),
                            "vs baseline": f"{base / best[name]:.2f}x",
                            # float sums in another order can swap near-equal neighbours
                            "ids moved": f"{(ids[name] != ids[baseline]).mean():.2%}",
                            "sets differ": f"{_set_diff(ids[name], ids[baseline]):.3%}",
                        }
                    )
            print(f"# N={n}: build {build_s:.0f} s, load-avg(1m)={os.getloadavg()[0]:.2f}")
            ds.close()
    os.environ.pop("MEMLM_PQ_TABLE_MB", None)
    print(
        f"# {len(q)} queries in batches of {args.queries}, best of {args.repeat}, "
        f"threads={faiss.omp_get_max_threads()}, faiss={faiss.__version__}"
    )
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(fmt(r[c]) for c in cols) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="20000,100000", help="comma-separated N")
    ap.add_argument("--dim", type=int, default=576, help="key dimension (SmolLM2: 576)")
    ap.add_argument("--k", type=int, default=256, help="neighbours per query")
    ap.add_argument("--queries", type=int, default=64, help="queries in the batched call")
    ap.add_argument("--single", type=int, default=8, help="queries timed one at a time")
    ap.add_argument("--clusters", type=int, default=1000)
    ap.add_argument("--query-noise", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--encode-news",
        type=int,
        default=0,
        help="first write this many real SmolLM2 keys of the news into --keys-npz",
    )
    ap.add_argument(
        "--encode-shard",
        default="0/1",
        help="i/n: encode every n-th article from the i-th (n processes side by side)",
    )
    ap.add_argument(
        "--incremental",
        type=int,
        default=0,
        help="also append this many entries and time the incremental build beside a full one",
    )
    ap.add_argument("--nlist", type=int, default=0, help="force IVF-PQ with this many lists")
    ap.add_argument("--m", type=int, default=0, help="force IVF-PQ with this many code bytes")
    ap.add_argument("--nprobe", type=int, default=0, help="override nprobe")
    ap.add_argument(
        "--keys-npz",
        type=Path,
        default=None,
        help="use real keys from an encoder cache folder of *.npz instead of synthetic ones",
    )
    ap.add_argument("--workdir", type=Path, default=None, help="keep files here")
    ap.add_argument("--append", action="store_true", help="only time Datastore.append")
    ap.add_argument(
        "--crossover",
        action="store_true",
        help="only time flat search direct vs BLAS by batch size (N = last of --sizes)",
    )
    ap.add_argument(
        "--f16", action="store_true", help="only time the float16 -> float32 re-rank conversion"
    )
    ap.add_argument(
        "--search-paths",
        action="store_true",
        help="only time IVF-PQ search_values with/without the precomputed table and the "
        "broadcast re-rank (k = 64 and 1024)",
    )
    ap.add_argument(
        "--gather",
        action="store_true",
        help="only time random key-row gathers: memmap fancy indexing vs np.take",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=5,
        help="--f16, --search-paths, --gather: interleaved repetitions",
    )
    args = ap.parse_args()
    if args.f16:
        f16_conversion(args)
        return
    threads = args.threads or int(os.environ.get("MEMLM_THREADS", "0")) or None
    if threads:
        faiss.omp_set_num_threads(threads)
        import torch

        torch.set_num_threads(threads)
    if args.search_paths:
        search_paths(args)
        return
    if args.gather:
        gather(args)
        return
    if args.crossover:
        crossover(args)
        return
    if args.append:
        append_latency(args)
        return
    if args.encode_news:
        if args.keys_npz is None:
            raise SystemExit("--encode-news needs --keys-npz DIR to write to")
        part, parts = (int(x) for x in args.encode_shard.split("/"))
        encode_news(args.keys_npz, args.encode_news, threads, (part, parts))
        if not args.sizes:  # only the keys
            return
    print(
        f"# keys={args.keys_npz or 'synthetic clustered'} dim={args.dim} k={args.k} queries={args.queries} single={args.single} "
        f"clusters={args.clusters} threads={threads or faiss.omp_get_max_threads()} "
        f"faiss={faiss.__version__} load-avg(1m) before={os.getloadavg()[0]:.2f}"
    )
    rows = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for n in (int(s) for s in args.sizes.split(",")):
            rows.append(bench_one(args, n, Path(tmp)))
            print(f"# N={n} done, load-avg(1m)={os.getloadavg()[0]:.2f}", flush=True)
    cols = list(dict.fromkeys(c for r in rows for c in r))
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(fmt(r.get(c, "-")) for c in cols) + " |")


if __name__ == "__main__":
    main()
