"""The faiss and milvus memories side by side, on the same keys, in one run.

For each size N (``--sizes``) and backend, in this order:

- insert throughput: one ``append`` per 400-entry document, as the ingest worker writes;
- searchable-after-insert latency: a document appended by one handle, polled by another
  (``refresh`` + search every 10 ms) until its first key's top-1 neighbour is its own
  entry: what the API sees of a worker's write (median of ``--visibility-trials``);
- search latency (k=64) at batch 1 (p50, p99 of ``--single`` calls) and batch 64 (p50 over
  the queries), and recall@k against an exact search over the same float16 keys (chunked
  flat search), on the unbuilt memory (faiss: its fresh exact part; Milvus: its growing
  segments) and after ``build`` (FLAT below 50k entries, IVF_PQ above,
  ``IndexParams.for_size``; Milvus sizes it to one sealed segment). Milvus's IVF_PQ also
  runs with the exact re-rank from its stored keys (``rerank=1``);
- where the build's time goes: faiss train / add; Milvus flush, compaction, index
  re-creation and load (``unavailable``), and the wait for its index nodes;
- with ``--predict`` (``bench_memory_predict``): the service over the built memory, served
  by uvicorn: ``POST /predict`` on 128-token contexts, ``Engine.predict`` and the bare
  forward, interleaved round by round; p50 and p99 of each and the ratios to the bare
  forward. ``--predict-unbuilt milvus`` also times it before Milvus's build (a 1M-entry
  build may outlast the run).

Keys: real SmolLM2-135M keys of the bundled news (``--keys-npz``: a folder of encoder
``*.npz`` files, as ``bench_index.py --encode-news`` writes; the last files' keys are the
held-out queries), stretched to N with jittered copies when fewer real keys exist
(``--stretch-noise`` times each dimension's spread).

    MEMLM_THREADS=1 MEMLM_PRECISION=float32 python benchmarks/bench_memory_backends.py \\
        --keys-npz /work/cache/news-keys --sizes 100000,1000000 --queries 256 --predict

The Milvus server is the embedded ``milvus==2.3.5`` (started here, its data and logs under
the work directory) or ``--milvus host:port``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import numpy.typing as npt
from _common import load_average, markdown_table, percentile, recall, stats_ms, stopwatch

from memlm.index import IndexParams
from memlm.memory import open_faiss, open_milvus
from memlm.memory.embedded import start_embedded
from memlm.memory.url import MilvusURL

DOC_LEN = 400  # entries per appended document (~MoNIM's share of a news article)
TRUTH_CHUNK = 131_072  # rows per exact-search chunk: 300 MB of float32 keys at d=576
PROBE_DOC = 10_000_000  # document ids of the visibility probes (far above the store's)


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


def exact_truth(
    store: npt.NDArray[np.float16], q: npt.NDArray[np.float32], k: int
) -> npt.NDArray[np.int64]:
    """Exact top-k rows of ``store`` per query: flat search chunk by chunk, merged (the
    float32 copy of one chunk at a time, not of the whole store)."""
    heap = faiss.ResultHeap(len(q), k)
    for a in range(0, len(store), TRUTH_CHUNK):
        d, i = faiss.knn(q, store[a : a + TRUTH_CHUNK].astype(np.float32), k)
        heap.add_result(d, np.where(i >= 0, i + a, -1))
    heap.finalize()
    return heap.I


def docs_of(keys: npt.NDArray[np.float16]) -> Iterator[tuple[int, tuple[Any, ...]]]:
    """(first row, (keys, values, documents, positions, days)) per DOC_LEN-entry document."""
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


def rows_of(
    id_of_row: npt.NDArray[np.int64],
) -> Callable[[npt.NDArray[np.int64]], npt.NDArray[np.int64]]:
    """The store row of each entry id a search returned (-1 for padding and unknown ids),
    given the id each row was stored under."""
    order = np.argsort(id_of_row)
    sorted_ids = id_of_row[order]

    def to_row(ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        pos = np.clip(np.searchsorted(sorted_ids, ids), 0, len(sorted_ids) - 1)
        hit = (ids >= 0) & (sorted_ids[pos] == ids)
        return np.where(hit, order[pos], -1)

    return to_row


def search_rows(
    mem: Any,
    q: npt.NDArray[np.float32],
    k: int,
    truth: npt.NDArray[np.int64],
    to_row: Callable[[npt.NDArray[np.int64]], npt.NDArray[np.int64]],
    single: int,
) -> dict[str, float]:
    """Batch-1 p50/p99 over ``single`` queries, batch-64 p50 over all, and recall@k."""
    mem.search(q[:2], k)  # warm
    one = []
    for j in range(single):
        with stopwatch() as t:
            mem.search(q[j % len(q) : j % len(q) + 1], k)
        one.append(t.seconds)
    b64 = []
    found = []
    for a in range(0, len(q), 64):
        with stopwatch() as t:
            ids = mem.search(q[a : a + 64], k).ids
        b64.append(t.seconds)
        found.append(to_row(ids))
    b1 = stats_ms(one)
    return {
        "b1 p50 ms": b1["p50"],
        "b1 p99 ms": b1["p99"],
        "b64 p50 ms": stats_ms(b64)["p50"],
        f"recall@{k}": recall(np.concatenate(found), truth),
    }


def visibility(writer: Any, reader: Any, dim: int, scale: float, trials: int) -> float:
    """Median seconds from a document's append returning to its first key being found by
    another handle (polled every 10 ms)."""
    lat = []
    rng = np.random.default_rng(7)
    for t in range(trials):
        # far from every stored key, so its own entry is its only possible top-1
        k = (rng.standard_normal((50, dim)) * scale).astype(np.float16)
        n = len(k)
        ids = writer.append(k, np.zeros(n), np.full(n, PROBE_DOC + t), np.arange(n), np.zeros(n))
        t0 = time.perf_counter()
        while True:
            reader.refresh()
            if reader.search(k[:1].astype(np.float32), 1).ids[0, 0] == ids[0]:
                break
            if time.perf_counter() - t0 > 30:
                raise SystemExit("an appended entry was not searchable after 30 s")
            time.sleep(0.01)
        lat.append(time.perf_counter() - t0)
    for t in range(trials):  # the probes leave the memory
        writer.delete_document(PROBE_DOC + t)
    return percentile(lat, 50)


def build_phases(name: str, info: dict[str, Any], seconds: float) -> dict[str, Any]:
    """Where a build's seconds went (the backend's own split of them)."""
    if name == "faiss":
        parts = {"train s": info.get("train_seconds"), "add s": info.get("add_seconds")}
    else:
        parts = {
            "flush s": info.get("flush_seconds"),
            "compact s": info.get("compact_seconds"),
            "re-index + load s": info.get("unavailable_seconds"),
            "index wait s": info.get("index_wait_seconds"),
        }
    return {"build s": seconds, **{k: v for k, v in parts.items() if v is not None}}


def bench_backend(
    name: str,
    where: Path | str,
    open_pair: Callable[[], tuple[Any, Any]],
    store: npt.NDArray[np.float16],
    q: npt.NDArray[np.float32],
    truth: npt.NDArray[np.int64],
    args: argparse.Namespace,
    budget: float | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]]]:
    """(search rows, build row, /predict rows) of one backend at one size; ``budget``:
    seconds Milvus's build may wait for its index nodes (None: the URL's timeout)."""
    writer, reader = open_pair()
    n = len(store)
    id_of_row = np.empty(n, np.int64)
    with stopwatch() as ins:
        for a, entry in docs_of(store):
            id_of_row[a : a + len(entry[0])] = writer.append(*entry)
    to_row = rows_of(id_of_row)
    scale = float(np.abs(q).max()) * 10
    vis = visibility(writer, reader, store.shape[1], scale, args.visibility_trials)
    base = {
        "backend": name,
        "N": n,
        "insert entries/s": n / ins.seconds,
        "visible after ms": 1000 * vis,
    }
    rows = [
        {**base, "index": "unbuilt", **search_rows(reader, q, args.k, truth, to_row, args.single)}
    ]
    print(table(rows), flush=True)  # now: a build that outlasts the run leaves these
    predict: list[dict[str, Any]] = []
    if args.predict and name in args.predict_unbuilt.split(","):
        predict += run_predict(name, where, args, f"N={n:,}, unbuilt")
    build, params = timed_build(name, writer, budget)
    print(table([build]), flush=True)
    if params is None:
        print(f"# {name} N={n:,}: not built; built search and /predict not measured", flush=True)
    else:
        reader.refresh()
        if hasattr(reader, "index"):
            reader.index.reload()
        label = build["index"]
        rows.append(
            {**base, "index": label, **search_rows(reader, q, args.k, truth, to_row, args.single)}
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
        print(table(rows[1:]), flush=True)
        if args.predict:
            predict += run_predict(name, where, args, f"N={n:,}, {label}")
    writer.close()
    reader.close()
    return rows, build, predict


def timed_build(
    name: str, writer: Any, budget: float | None
) -> tuple[dict[str, Any], IndexParams | None]:
    """(build row, the built index's parameters; None when the build failed or did not
    finish within ``budget`` seconds). Milvus's budget is its per-call timeout, which its
    ``create_index`` waits for the index nodes with; when it runs out the row says how
    many rows the index nodes had indexed (Milvus goes on building, the run does not)."""
    n = writer.count()
    if budget is not None:
        # an int: pymilvus 2.4's create_index stops waiting only for an int timeout (a
        # float, as the URL's, waits for the index nodes however long they take)
        writer.timeout = max(1, int(budget))
    try:
        with stopwatch() as b:
            info = writer.build_index(None)
    except Exception as exc:  # noqa: BLE001 - a build that fails is a result to report
        row: dict[str, Any] = {"backend": name, "N": n, "build s": b.seconds}
        row["index"] = f"not built: {type(exc).__name__}"
        if name == "milvus":
            from pymilvus import utility

            got = utility.index_building_progress(writer.url.collection, using=writer.alias)
            row["index"] += f" ({got.get('indexed_rows')} of {got.get('total_rows')} rows indexed)"
        print(f"# {name} N={n:,}: the build failed: {exc!r}"[:500], flush=True)
        return row, None
    params = getattr(writer, "params", None) or IndexParams(**info["params"])
    label = "FLAT" if params.kind == "flat" else f"IVF_PQ {params.nlist}/{params.m}/{params.nprobe}"
    return {"backend": name, "N": n, **build_phases(name, info, b.seconds), "index": label}, params


def run_predict(
    name: str, where: Path | str, args: argparse.Namespace, label: str
) -> list[dict[str, Any]]:
    from bench_memory_predict import predict_rows

    rows = predict_rows(name, where, args.predict_rounds, label=label)
    print(table(rows), flush=True)
    return rows


def milvus_address(given: str | None, work: Path) -> tuple[str, str, Any]:
    """(host, port, the embedded server started here or None): ``given`` is host:port of
    a running server; None starts the embedded one under ``work``."""
    if given:
        host, port = given.split(":")
        return host, port, None
    server = start_embedded(work / "milvus")
    print(f"# embedded Milvus started in {server.start_seconds:.1f} s", flush=True)
    return server.host, str(server.port), server


def faiss_pair(folder: Path, dim: int) -> tuple[Any, Any]:
    """A shared writer (the ingest worker's) and a read-only handle (the API's)."""
    return open_faiss(folder, dim, shared=True), open_faiss(folder, None, readonly=True)


def milvus_pair(url: str, dim: int) -> tuple[Any, Any]:
    """Two connections to one collection: the worker's and the API's."""
    return open_milvus(url, dim), open_milvus(url, dim)


def _fmt(v: Any, col: str = "") -> str:
    if isinstance(v, float) and col.endswith("/bare p50"):
        return f"{v:.2f}x"
    if isinstance(v, float) and col.startswith("recall"):
        return f"{v:.3f}"
    if isinstance(v, float):
        return f"{v:.3f}" if v < 1 else f"{v:.1f}" if v < 100 else f"{v:,.0f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as one Markdown table (the union of their columns, first seen first)."""
    cols = list(dict.fromkeys(c for r in rows for c in r))
    align = "".join("l" if c in ("backend", "index") else "r" for c in cols)
    return markdown_table(cols, [[_fmt(r.get(c, ""), c) for c in cols] for r in rows], align=align)


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
    ap.add_argument("--milvus-timeout", type=float, default=1800, help="seconds per Milvus call")
    ap.add_argument(
        "--milvus-build-budget",
        default="",
        help="seconds Milvus's build may take, one value or one per size (default: the timeout)",
    )
    ap.add_argument(
        "--backends", default="faiss,milvus", help="comma-separated, in the order they run"
    )
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument(
        "--predict", action="store_true", help="also time /predict against the bare forward"
    )
    ap.add_argument(
        "--predict-unbuilt",
        default="",
        help="backends (comma-separated) whose /predict is also timed before the build",
    )
    ap.add_argument("--predict-rounds", type=int, default=40)
    args = ap.parse_args()
    faiss.omp_set_num_threads(int(os.environ.get("MEMLM_THREADS", "1")))
    real, q = real_keys(args.keys_npz, args.queries)
    print(
        f"# {len(real)} real SmolLM2 keys, {len(q)} held-out queries; "
        f"load average {load_average()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        flush=True,
    )
    work = Path(tempfile.mkdtemp(prefix="bench-mem-", dir=args.workdir))
    print(f"# work directory {work}", flush=True)
    host, port, server = milvus_address(args.milvus, work)
    dim = real.shape[1]
    sizes = [int(s) for s in args.sizes.split(",")]
    budgets = (
        [float(b) for b in args.milvus_build_budget.split(",")] if args.milvus_build_budget else []
    )
    budgets = (budgets or [args.milvus_timeout]) * (len(sizes) if len(budgets) <= 1 else 1)
    if len(budgets) != len(sizes):
        raise SystemExit("--milvus-build-budget: one value, or one per size")
    rows: list[dict[str, Any]] = []
    builds: list[dict[str, Any]] = []
    predict: list[dict[str, Any]] = []
    try:
        for i, n in enumerate(sizes):
            store = stretch(real, n, args.stretch_noise)
            with stopwatch() as t:
                truth = exact_truth(store, q, args.k)
            print(f"# N={n:,}: exact truth in {t.seconds:.0f} s; load {load_average()}", flush=True)
            url = f"milvus://{host}:{port}/bench_{n}?timeout={args.milvus_timeout:g}"
            data_dir = work / f"faiss-{n}"  # a service data directory: its memory/ is the store
            pairs: dict[str, tuple[Path | str, Callable[[], tuple[Any, Any]]]] = {
                "faiss": (data_dir, partial(faiss_pair, data_dir / "memory", dim)),
                "milvus": (url, partial(milvus_pair, url, dim)),
            }
            for name in args.backends.split(","):
                where, pair = pairs[name]
                budget = budgets[i] if name == "milvus" else None
                r, b, p = bench_backend(name, where, pair, store, q, truth, args, budget)
                rows += r
                builds.append(b)
                predict += p
                if server is not None:
                    print(f"# Milvus server RSS {server.rss_bytes() / 2**20:.0f} MiB", flush=True)
                print(f"# load average {load_average()}", flush=True)
            del store
        print(f"\n## all rows (load average after {load_average()})\n")
        for part in (rows, builds, predict):
            if part:
                print(table(part), end="\n\n")
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
