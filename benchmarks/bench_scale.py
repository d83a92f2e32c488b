"""The memory at millions of entries: build, incremental add, RAM, disk, recall, latency.

Keys: real SmolLM2-135M keys of the bundled news (``--keys-npz``, one float16 ``.npz``
per article in stream order, written by ``--encode-news``), stretched to N entries by
this generator:

  round 0 stores the real keys as they are; round r >= 1 stores, for every real article
  in order, ``mu + sqrt(1 - a^2) * (key - mu) + a * sigma * z`` for each of its keys,
  with ``mu``/``sigma`` the real keys' per-dimension mean and standard deviation,
  ``z ~ N(0, 1)`` and ``a = --noise`` (0.5). Each dimension keeps its real mean and
  variance (and (1 - a^2) of every real covariance), every real key gets a cloud of
  noisy copies, and the outlier dimensions of LM keys stay as they are.

Values are the real next tokens of the article, positions the real positions, the day
its real publish day, and round r's copy of article i is document ``r * articles + i``
(a document's entries are consecutive ids, as ingest writes them). The last
``--heldout`` articles never enter the store: their keys are the queries.

For each N (``--sizes``):

- full build (train + add, ``build_index(retrain=True)``) and an incremental build
  adding ``--add`` entries (the next round) to the N-entry version;
- RAM per served entry: a fresh process opens the datastore and the index
  (``MemoryIndex``) and searches; (RSS after - RSS before) / N, and the anonymous part
  (RssAnon: memory the process owns; the float16 keys are memory-mapped file pages);
- disk per entry: datastore files and the index file;
- recall@64 and @1024 against an exact search over the same float16 keys (faiss flat,
  chunked, merged with ``faiss.ResultHeap``), with and without the fp16 re-rank;
- search latency (k=64, re-rank on) at batch 1 and batch 64;
- fresh-entry latency: a reader's ``refresh`` + search finding a document's entry
  after the writer's append returns (what the API does after the worker marks it done);
- ``/predict`` p50/p99 at a 128-token context (HTTP, and ``engine.predict``) beside
  the bare LM forward + head over the same contexts, interleaved in the same run.

    python benchmarks/bench_scale.py --keys-npz /work/cache/news-keys --encode-news 100000 \\
        --sizes 1000000,5000000 --workdir /work/scale

Threads: ``--threads`` (faiss and torch), else MEMLM_THREADS, else 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import numpy.typing as npt

from memlm.datastore import Datastore
from memlm.index import INDEX_FILE, MemoryIndex, build_index
from memlm.index.params import f16_to_f32

sys.path.insert(0, str(Path(__file__).parent))
from _common import load_average, recall  # noqa: E402
from bench_index import encode_news  # noqa: E402


class Stretcher:
    """Real article keys and the generator above (see the module docstring)."""

    def __init__(self, folder: Path, heldout: int, noise: float) -> None:
        from transformers import AutoTokenizer

        from memlm.corpus import load_news
        from memlm.encoder import bundled_tokenizer_path

        files = sorted(f for f in folder.glob("*.npz") if not f.name.endswith(".tmp.npz"))
        if len(files) <= heldout:
            raise SystemExit(f"{folder}: {len(files)} encoded articles, need > {heldout}")
        news = load_news()
        tok = AutoTokenizer.from_pretrained(bundled_tokenizer_path())
        days = sorted({d.published_at for d in news})
        self.articles: list[tuple[npt.NDArray[np.float16], npt.NDArray[np.int32], int]] = []
        queries = []
        for i, f in enumerate(files):
            with np.load(f) as z:
                keys = z["keys"].astype(np.float16)
            if i >= len(files) - heldout:
                queries.append(keys)
                continue
            ids = tok(news[i].text, add_special_tokens=False)["input_ids"]
            values = np.asarray(ids[1:], dtype=np.int32)
            if len(values) != len(keys):
                raise SystemExit(f"{f}: {len(keys)} keys, {len(values)} next tokens")
            self.articles.append((keys, values, days.index(news[i].published_at)))
        self.queries = np.concatenate(queries).astype(np.float32)
        real = np.concatenate([a[0] for a in self.articles]).astype(np.float32)
        self.real = len(real)
        self.mu = real.mean(0)
        self.sigma = real.std(0)
        self.noise = noise
        self.dim = real.shape[1]
        self.next_texts = [d.text for d in news[len(files) :]]  # never encoded: contexts

    def batches(self, first_round: int, n: int, batch: int = 65536) -> Iterator[tuple[Any, ...]]:
        """(keys, values, doc_ids, positions, days) batches of ``n`` entries in all, from
        round ``first_round`` on (whole articles, the last one cut)."""
        shrink = np.float32(math.sqrt(1 - self.noise**2))
        left, r = n, first_round
        parts: list[tuple[Any, ...]] = []
        size = 0
        while left > 0:
            rng = np.random.default_rng(r)
            for a, (keys, values, day) in enumerate(self.articles):
                take = min(len(keys), left)
                x = keys[:take].astype(np.float32)
                if r > 0:
                    z = rng.standard_normal(x.shape, dtype=np.float32)
                    x = self.mu + shrink * (x - self.mu) + np.float32(self.noise) * self.sigma * z
                doc = r * len(self.articles) + a
                parts.append(
                    (
                        x.astype(np.float16),
                        values[:take],
                        np.full(take, doc),
                        np.arange(1, take + 1),
                        np.full(take, day),
                    )
                )
                size += take
                left -= take
                if size >= batch or left == 0:
                    yield tuple(np.concatenate(c) for c in zip(*parts, strict=True))
                    parts, size = [], 0
                if left == 0:
                    return
            r += 1

    def fill(self, ds: Datastore, first_round: int, n: int) -> None:
        for keys, values, docs, pos, days in self.batches(first_round, n):
            ds.append(keys, values, docs, pos, days)


def exact_search(ds: Datastore, q: npt.NDArray[np.float32], k: int) -> npt.NDArray[np.int64]:
    """Exact top-k ids over every entry of ``ds`` (chunks of flat search, merged)."""
    heap = faiss.ResultHeap(len(q), k)
    for first, keys, _ in ds.iter_chunks(0, len(ds), 262_144):
        flat = faiss.IndexFlatL2(ds.dim)
        flat.add(f16_to_f32(keys))
        d, i = flat.search(q, min(k, len(keys)))
        heap.add_result(d, np.where(i >= 0, i + first, -1))
    heap.finalize()
    return heap.I


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def ram_child(data_dir: Path, queries: Path, threads: int) -> None:
    """Run in a fresh process: RSS of opening the served memory and searching it."""
    faiss.omp_set_num_threads(threads)
    q = np.load(queries)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:  # libraries and BLAS warm before "before"
        small = Datastore.open(Path(tmp) / "ds", dim=q.shape[1])
        keys = np.random.default_rng(0).standard_normal((1000, q.shape[1])).astype(np.float16)
        small.append(keys, np.zeros(1000, np.int32), 0, np.arange(1000), 0)
        MemoryIndex(small, Path(tmp) / "ix").search(q[:64], 64)
        small.close()
    before = {f: status_kb(f) for f in ("VmRSS", "RssAnon", "RssFile")}
    ds = Datastore.open(data_dir / "datastore", readonly=True)
    mem = MemoryIndex(ds, data_dir / "index")
    loaded = {f: status_kb(f) for f in before}
    for i in range(0, len(q), 64):
        mem.search(q[i : i + 64], 64)
    searched = {f: status_kb(f) for f in before}
    out = {"entries": mem.num_entries, "before": before, "loaded": loaded, "searched": searched}
    print(json.dumps(out))


def measure_ram(data_dir: Path, q: npt.NDArray[np.float32], threads: int) -> dict[str, Any]:
    qf = data_dir / "queries.npy"
    np.save(qf, q)
    cmd = [sys.executable, __file__, "--ram-child", str(data_dir), "--threads", str(threads)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"RAM child failed: {done.stderr[-2000:]}")
    out = done.stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def fresh_latency(ds: Datastore, data_dir: Path, st: Stretcher, rounds: int = 5) -> list[float]:
    """ms from a document's append (the worker's commit) to a reader finding its entry."""
    reader = Datastore.open(data_dir / "datastore", readonly=True)
    mem = MemoryIndex(reader, data_dir / "index")
    out = []
    for r in range(rounds):
        keys, values, docs, pos, days = next(st.batches(900 + r, 700, batch=700))
        ids = ds.append(keys, values, docs, pos, days)
        t0 = time.perf_counter()
        mem.refresh()
        _, found = mem.search(keys[-1:].astype(np.float32), 1)
        out.append((time.perf_counter() - t0) * 1000)
        assert found[0, 0] == ids[-1], (found, ids[-1])
    reader.close()
    return out


def bench_n(args: argparse.Namespace, st: Stretcher, n: int, threads: int) -> dict[str, Any]:
    top = args.workdir / f"n{n}"
    shutil.rmtree(top, ignore_errors=True)
    data_dir = top / "memory"  # Settings(data_dir=top).datastore_dir: what the API serves
    data_dir.mkdir(parents=True)
    row: dict[str, Any] = {"N": n, "load_before": load_average()}
    ds = Datastore.open(data_dir / "datastore", dim=st.dim)
    t0 = time.perf_counter()
    st.fill(ds, 0, n)
    row["generate_s"] = time.perf_counter() - t0
    print(f"# N={n}: store written in {row['generate_s']:.0f} s, load {load_average()}", flush=True)

    t0, c0 = time.perf_counter(), time.process_time()
    full = build_index(ds, data_dir / "index", retrain=True, progress=False, threads=threads)
    row["full_build_s"] = time.perf_counter() - t0
    row["full_build_cpu_s"] = time.process_time() - c0  # all threads' CPU time
    row["train_s"], row["add_s"] = full.train_seconds, full.add_seconds
    p = full.params
    row["params"] = f"nlist {p.nlist}, m {p.m}, nprobe {p.nprobe}, train {p.train_sample}"
    row["load_after_full"] = load_average()
    print(
        f"# N={n}: full build {row['full_build_s']:.0f} s ({full.reason}), load {load_average()}",
        flush=True,
    )

    q = st.queries[: args.queries]
    truth = exact_search(ds, q, 1024)
    mem = MemoryIndex(ds, data_dir / "index")
    mem.search(q[:4], 64)  # warm-up
    for k in (64, 1024):
        for rr in (False, True):
            _, ids = mem.search(q, k, rerank=rr)
            row[f"recall@{k}{' rr' if rr else ''}"] = recall(ids, truth[:, :k])
    single = []
    for j in range(min(64, len(q))):
        t0 = time.perf_counter()
        mem.search(q[j : j + 1], 64)
        single.append((time.perf_counter() - t0) * 1000)
    row["search b1 p50 ms"] = float(np.median(single))
    batch = []
    for j in range(0, len(q) - 63, 64):
        t0 = time.perf_counter()
        mem.search(q[j : j + 64], 64)
        batch.append((time.perf_counter() - t0) * 1000)
    row["search b64 ms/call"] = float(np.median(batch))

    row["ram"] = measure_ram(data_dir, q, threads)
    r = row["ram"]
    row["RSS B/entry"] = (r["searched"]["VmRSS"] - r["before"]["VmRSS"]) * 1024 / n
    row["anon B/entry"] = (r["searched"]["RssAnon"] - r["before"]["RssAnon"]) * 1024 / n
    row["anon loaded B/entry"] = (r["loaded"]["RssAnon"] - r["before"]["RssAnon"]) * 1024 / n
    row["index disk B/entry"] = (full.path / INDEX_FILE).stat().st_size / n
    row["store disk B/entry"] = ds.stats()["bytes_on_disk"] / n

    # Incremental: the next --add entries onto the N-entry version.
    rounds = math.ceil(n / st.real)
    st.fill(ds, rounds + 1, args.add)
    t0, c0 = time.perf_counter(), time.process_time()
    inc = build_index(ds, data_dir / "index", progress=False, threads=threads)
    row["incremental_s"] = time.perf_counter() - t0
    row["incremental_cpu_s"] = time.process_time() - c0
    assert inc.mode == "incremental" and inc.added == args.add, inc
    row["incremental add_s"] = inc.add_seconds
    row["load_after_incremental"] = load_average()
    print(
        f"# N={n}: +{args.add} incremental {row['incremental_s']:.1f} s, load {load_average()}",
        flush=True,
    )

    fresh = fresh_latency(ds, data_dir, st)
    row["fresh ms max"] = max(fresh)
    ds.close()
    if not args.skip_predict:
        row.update(predict_latency(args, top, st, threads))
    if not args.keep:
        shutil.rmtree(top)
    return row


def rerank_sweep(args: argparse.Namespace, top: Path, st: Stretcher) -> None:
    """recall@64 and batch-1 latency by ``rerank_min`` on a kept store's served version."""
    from dataclasses import replace

    data_dir = top / "memory"
    ds = Datastore.open(data_dir / "datastore", readonly=True)
    mem = MemoryIndex(ds, data_dir / "index")
    q = st.queries[: args.queries]
    truth = exact_search(ds, q, 64)
    st_ = mem._state
    assert st_.info is not None
    base = st_.info
    print(f"# {mem.num_entries} entries, version {mem.version}, {len(q)} queries, k=64")
    print("| rerank_min | candidates | recall@64 | batch-1 p50 ms |")
    print("|---:|---:|---:|---:|")
    for rmin in (1, 256, 512, 1024, 2048):
        st_.info = replace(base, params=replace(base.params, rerank_min=rmin))
        _, ids = mem.search(q, 64)
        ms = []
        for j in range(min(64, len(q))):
            t0 = time.perf_counter()
            mem.search(q[j : j + 1], 64)
            ms.append((time.perf_counter() - t0) * 1000)
        cand = max(64 * base.params.rerank_factor, rmin)
        print(f"| {rmin} | {cand} | {recall(ids, truth):.3f} | {np.median(ms):.1f} |", flush=True)
    st_.info = base


def record_builds(db_url: str, root: Path) -> None:
    """Record the versions built here as the worker would: the API serves only those."""
    from memlm.db.repositories import BuildRepository
    from memlm.db.session import make_engine, make_sessionmaker
    from memlm.index import BuildInfo, list_versions

    sessions = make_sessionmaker(make_engine(db_url))
    with sessions.begin() as s:
        builds = BuildRepository(s)
        done = builds.recorded_versions()
        for v in list_versions(root):
            if v in done:
                continue
            info = BuildInfo.read(root / f"v{v:06d}")
            row, _ = builds.enqueue(f"bench:{v}", "bench")
            s.flush()
            builds.finish(
                row.id, version=str(v), entries=info.entries, params=info.record(), seconds=0.0
            )


def open_served(data_dir: Path, threads: int) -> tuple[Any, Any]:
    """``(settings, engine)`` serving a store's folder, its built versions recorded."""
    from memlm.db.migrate import upgrade
    from memlm.engine import open_engine
    from memlm.settings import Settings

    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        data_dir=data_dir,
        threads=threads,
        index_poll_seconds=3600,
        embedded_worker=False,
    )
    upgrade(settings.db_url)
    record_builds(settings.db_url, data_dir / "memory" / "index")
    return settings, open_engine(settings)


def predict_latency(
    args: argparse.Namespace,
    data_dir: Path,
    st: Stretcher,
    threads: int,
    served: tuple[Any, Any] | None = None,
) -> dict[str, Any]:
    """p50/p99 of HTTP /predict and engine.predict beside the bare forward, interleaved.

    ``served``: ``open_served``'s pair to time (the caller closes its engine); else one
    opened and closed here.
    """
    import threading

    import httpx
    import torch
    import uvicorn

    from service.app import create_app

    settings, engine = served or open_served(data_dir, threads)
    enc = engine.encoder
    contexts = []
    for text in st.next_texts:
        ids = enc.tokenize(text)
        if len(ids) > args.context:
            contexts.append(enc.tokenizer.decode(ids[: args.context]))
        if len(contexts) == 50:
            break

    def bare(c: str) -> None:
        _, hidden, _ = enc.start([enc.tokenize(c)])
        torch.log_softmax(enc.logits(hidden[0, -1:]), dim=-1)

    app = create_app(settings, engine=engine, run_worker=False, poll=False)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    times: dict[str, list[float]] = {"bare": [], "engine": [], "http": []}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:

        def http(c: str) -> None:
            client.post("/predict", json={"context": c, "top_n": 10}).raise_for_status()

        fns = {"bare": bare, "engine": lambda c: engine.predict(c, top_n=10), "http": http}
        for i in range(args.requests + 5):
            c = contexts[i % len(contexts)]
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn(c)
                if i >= 5:  # warm-up
                    times[name].append((time.perf_counter() - t0) * 1000)
    server.should_exit = True
    thread.join(10)
    st_ = engine.stats()
    out: dict[str, Any] = {
        "predict served entries": st_["entries"],
        "predict index": st_["index"],  # built + fresh parts the predictions searched
    }
    for name, ms in times.items():
        out[f"{name} p50 ms"] = float(np.percentile(ms, 50))
        out[f"{name} p99 ms"] = float(np.percentile(ms, 99))
    out["http/bare p50"] = out["http p50 ms"] / out["bare p50 ms"]
    out["engine/bare p50"] = out["engine p50 ms"] / out["bare p50 ms"]
    if served is None:
        engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="1000000")
    ap.add_argument("--keys-npz", type=Path, default=None, help="encoder-cache folder (required)")
    ap.add_argument("--encode-news", type=int, default=0, help="first encode this many keys")
    ap.add_argument("--heldout", type=int, default=8, help="last articles kept for queries")
    ap.add_argument("--noise", type=float, default=0.5, help="a of the generator")
    ap.add_argument("--queries", type=int, default=256)
    ap.add_argument("--add", type=int, default=100_000, help="entries the incremental build adds")
    ap.add_argument("--requests", type=int, default=100, help="timed /predict calls per row")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/memlm-scale"))
    ap.add_argument("--threads", type=int, default=int(os.environ.get("MEMLM_THREADS", "1")))
    ap.add_argument("--skip-predict", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the stores")
    ap.add_argument("--ram-child", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument(
        "--rerank-sweep",
        type=Path,
        default=None,
        help="only recall@64 by rerank_min, on a store a --keep run left (its n<N> folder)",
    )
    ap.add_argument(
        "--predict-only",
        type=Path,
        default=None,
        help="only the /predict rows, on a store a --keep run left (its n<N> folder)",
    )
    args = ap.parse_args()
    if args.ram_child is not None:
        ram_child(args.ram_child, args.ram_child / "queries.npy", args.threads)
        return
    if args.keys_npz is None:
        ap.error("--keys-npz is required")
    faiss.omp_set_num_threads(args.threads)
    if args.encode_news:
        encode_news(args.keys_npz, args.encode_news, args.threads)
    st = Stretcher(args.keys_npz, args.heldout, args.noise)
    if args.rerank_sweep is not None:
        print(f"# re-rank sweep on {args.rerank_sweep}, load {load_average()}", flush=True)
        rerank_sweep(args, args.rerank_sweep, st)
        print(f"# load after: {load_average()}")
        return
    if args.predict_only is not None:
        print(f"# /predict on {args.predict_only}, load {load_average()}", flush=True)
        row = predict_latency(args, args.predict_only, st, args.threads)
        print(json.dumps(row, default=str), flush=True)
        print(f"# load after: {load_average()}")
        return
    print(
        f"# {st.real} real keys from {len(st.articles)} articles, {len(st.queries)} held-out query "
        f"keys; noise a={args.noise}; threads {args.threads}; faiss {faiss.__version__}; "
        f"load {load_average()}; {os.cpu_count()} cores",
        flush=True,
    )
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        row = bench_n(args, st, n, args.threads)
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)
    print()
    cols = [
        "N",
        "params",
        "full_build_s",
        "full_build_cpu_s",
        "train_s",
        "incremental_s",
        "incremental_cpu_s",
        "RSS B/entry",
        "anon B/entry",
        "anon loaded B/entry",
        "index disk B/entry",
        "store disk B/entry",
        "recall@64",
        "recall@64 rr",
        "recall@1024",
        "recall@1024 rr",
        "search b1 p50 ms",
        "search b64 ms/call",
        "fresh ms max",
        "bare p50 ms",
        "http p50 ms",
        "http p99 ms",
        "engine p50 ms",
        "http/bare p50",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(_fmt(r.get(c, "-")) for c in cols) + " |")


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if v < 10 else f"{v:.1f}"
    return str(v)


if __name__ == "__main__":
    main()
