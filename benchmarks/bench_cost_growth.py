"""How the cost grows with the memory: ingest tokens/s and ``/predict`` p50 at N entries.

For each N (``--sizes``), on the faiss backend with the index a nightly build makes
(``build_index(retrain=True)``: ``IndexParams.for_size(N)``), over the keys of
``bench_scale.py`` (real SmolLM2-135M news keys stretched to N by its generator):

- **ingest, memory side**: the ingest worker's per-document work, MoNIM's
  ``prepare_document`` (search k=64 against the served memory, the augmented scores, the
  decision) and ``store_document`` (the durable append), on ``--ingest-docs`` news
  articles the keys never saw; their encoder outputs are computed once before and served
  from that cache, so the timing is the memory's share alone. Tokens/s of that, and the
  encoder's own tokens/s on the same articles (``Encoder.encode_ids``, the work the cache
  stood in for, timed in the same run); the worker's rate is about
  ``1 / (1 / encoder + 1 / memory)``;
- **``/predict``**: ``bench_scale.predict_latency`` on the same served engine (HTTP via
  uvicorn, ``engine.predict`` and the bare forward + head, 128-token contexts,
  interleaved): p50 / p99 and the ratio to the bare forward;
- **``/generate``**: the generation loop (``memlm.engine.generation.generate``: per new
  token one one-token forward with the attention cache, one search of the N entries at the
  served k and the interpolation, greedy) against the bare model's Hugging Face
  ``generate`` on the same ``--context``-token contexts, ``--generate-tokens`` new tokens
  each, the two interleaved round by round: tokens/s of each and the median of the
  per-round ratios (``--generate-rounds 0`` skips it).

/predict runs first, so the contexts search the N built entries (the ingest then adds
its own, a few thousand, to the fresh part).

    MEMLM_THREADS=1 PYTHONPATH=. nice -n 5 python benchmarks/bench_cost_growth.py \\
        --keys-npz /work/cache-speed/news-keys --sizes 100000,1000000 --workdir /work/growth
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from memlm.datastore import Datastore
from memlm.index import build_index
from memlm.index.params import BuildInfo
from memlm.index.versions import current_version, version_name

sys.path.insert(0, str(Path(__file__).parent))
from _common import hf_generate, interleaved, load_average, markdown_table  # noqa: E402
from bench_scale import Stretcher, open_served, predict_latency  # noqa: E402


def ingest_rates(engine: Any, texts: list[str], first_doc: int) -> dict[str, Any]:
    """Memory-side tokens/s of MoNIM's ingest (encoder outputs cached) and the encoder's."""
    enc = engine.encoder
    ids = [enc.tokenize(t) for t in texts]
    enc.encode_ids(ids[0][:256], engine.window)  # warm-up: the first forward allocates
    cached: dict[tuple[int, ...], Any] = {}
    t0 = time.perf_counter()
    for i in ids:
        cached[tuple(i)] = enc.encode_ids(i, engine.window)
    encode_s = time.perf_counter() - t0
    tokens = sum(len(o) for o in cached.values())

    def from_cache(i: list[int], window: Any, key_ce: bool = False) -> Any:
        assert not key_ce, "MoNIM(loss) asks for no key cross-entropy"
        return cached[tuple(i)]

    enc.encode_ids = from_cache  # instance attribute: this run only, removed below
    start = engine.memory.count()
    prepare_s = store_s = 0.0
    stored = 0
    try:
        for j, text in enumerate(texts):
            t0 = time.perf_counter()
            prep = engine.prepare_document(first_doc + j, text, 0)
            t1 = time.perf_counter()
            res = engine.store_document(prep)
            prepare_s += t1 - t0
            store_s += time.perf_counter() - t1
            stored += res.tokens_stored
    finally:
        del enc.encode_ids
        engine.memory.truncate(start)  # the store keeps its size (--reuse)
    memory_s = prepare_s + store_s
    return {
        "ingest tokens": tokens,
        "MemRate": stored / tokens,
        "encoder tok/s": tokens / encode_s,
        "memory tok/s": tokens / memory_s,
        "search+decide ms/tok": prepare_s / tokens * 1000,
        "append ms/tok": store_s / tokens * 1000,
        "memory/encoder time": memory_s / encode_s,
        "worker tok/s": tokens / (encode_s + memory_s),
    }


def worker_rates(engine: Any, texts: list[str], first_doc: int, rounds: int) -> dict[str, Any]:
    """The ingest worker's whole per-document path (encode, search, decide, append), as
    it runs, against the encoder alone on the same articles; two ways:

    - **sequential**: ``prepare_document`` then ``store_document``, one document after
      the other;
    - **encode ahead**: the same with ``next_text``: the next document's forward starts
      once this one's outputs are in hand and runs beside its search, decision and append.

    The three paths are interleaved round by round (``rounds`` timed rounds after one
    untimed sequential one, which also records the articles' held-out tokens once), and
    each ingest is cut off again afterwards (``truncate``), so every round starts from the
    same memory. Per path the median seconds; the ratios are medians of per-round ratios.
    The decisions of the two ingests must be equal (``decisions equal``).
    """
    enc, memory = engine.encoder, engine.memory
    ids = [enc.tokenize(t) for t in texts]
    tokens = sum(len(i) - 1 for i in ids)
    start = memory.count()
    masks: dict[str, list[Any]] = {}

    def ingest(name: str, ahead: bool) -> None:
        got = []
        for j, text in enumerate(texts):
            after = texts[j + 1] if ahead and j + 1 < len(texts) else None
            prep = engine.prepare_document(first_doc + j, text, 0, next_text=after)
            engine.store_document(prep)
            got.append(prep.store)
        memory.truncate(start)
        masks[name] = got

    def encoder_alone() -> None:
        for i in ids:
            enc.encode_ids(i, engine.window)

    times = interleaved(
        {
            "encoder": encoder_alone,
            "sequential": lambda: ingest("sequential", False),
            "ahead": lambda: ingest("ahead", True),
        },
        rounds,
        warmup=1,
    )
    same = all((a == b).all() for a, b in zip(masks["sequential"], masks["ahead"], strict=True))
    med = {name: statistics.median(ts) for name, ts in times.items()}

    def ratio(name: str) -> float:
        return statistics.median(e / t for e, t in zip(times["encoder"], times[name], strict=True))

    return {
        "worker tokens": tokens,
        "encoder e2e tok/s": tokens / med["encoder"],
        "worker seq tok/s": tokens / med["sequential"],
        "worker ahead tok/s": tokens / med["ahead"],
        "seq/encoder": ratio("sequential"),
        "ahead/encoder": ratio("ahead"),
        "decisions equal": same,
        "decisions": masks["sequential"],
    }


def generate_rates(engine: Any, st: Stretcher, args: argparse.Namespace) -> dict[str, Any]:
    """Tokens/s of the ``/generate`` loop (memory on) and of the bare model's HF
    ``generate``, interleaved: one round = one context, each path once."""
    from memlm.engine.generation import GenerateConfig, generate

    enc = engine.encoder
    n = args.generate_tokens
    long_enough = (ids for ids in map(enc.tokenize, st.next_texts) if len(ids) >= args.context)
    contexts = [
        ids[: args.context] for ids in itertools.islice(long_enough, args.generate_rounds + 1)
    ]
    cfg = GenerateConfig(max_tokens=n, stop_at_eos=False)
    rounds = itertools.count()
    current: list[list[int]] = []
    lams: list[float] = []

    def next_round() -> None:
        current[:] = [contexts[next(rounds) % len(contexts)]]

    def ours() -> None:
        _, toks = generate(engine, current[0], cfg)
        assert len(toks) == n
        lams.extend(t.lam for t in toks)

    times = interleaved(
        {"bare": lambda: hf_generate(enc, current[0], n), "memlm": ours},
        args.generate_rounds,
        warmup=1,
        before_round=next_round,
    )
    ratios = [b / m for b, m in zip(times["bare"], times["memlm"], strict=True)]
    timed = lams[n:]  # the warm-up round's are not counted
    return {
        "generate tok/s": n / statistics.median(times["memlm"]),
        "bare generate tok/s": n / statistics.median(times["bare"]),
        "generate/bare": statistics.median(ratios),
        "generate lambda>0": sum(x > 0 for x in timed) / len(timed),
        "generate mean lambda": statistics.fmean(timed),
    }


def bench_n(args: argparse.Namespace, st: Stretcher, n: int) -> dict[str, Any]:
    top = args.workdir / f"n{n}"
    data_dir = top / "memory"  # Settings(data_dir=top).datastore_dir: what the API serves
    row: dict[str, Any] = {"N": n, "load before": load_average()}
    version = current_version(data_dir / "index") if args.reuse else None
    if version is not None:
        ds = Datastore.open(data_dir / "datastore", dim=st.dim)
        if len(ds) != n:  # an ingest cut off by a crash, or another size
            raise SystemExit(f"{data_dir} holds {len(ds)} entries, not {n}: drop --reuse")
        ds.close()
        # the version's metadata only: the engine opened below reads the index itself
        p = BuildInfo.read(data_dir / "index" / version_name(version)).params
        row["build s"] = "reused"
    else:
        shutil.rmtree(top, ignore_errors=True)
        data_dir.mkdir(parents=True)
        ds = Datastore.open(data_dir / "datastore", dim=st.dim)
        st.fill(ds, 0, n)
        t0 = time.perf_counter()
        built = build_index(
            ds, data_dir / "index", retrain=True, progress=False, threads=args.threads
        )
        row["build s"] = time.perf_counter() - t0
        p = built.params
        ds.close()
    row["index"] = f"{p.kind} nlist {p.nlist} m {p.m} nprobe {p.nprobe}"
    built_s = row["build s"]
    build = "reused" if built_s == "reused" else f"{built_s:.0f} s"
    print(f"# N={n}: index {row['index']}, build {build}, load {load_average()}")
    served = open_served(top, args.threads)
    try:
        row["precision"] = served[1].encoder.precision
        if args.requests:
            row.update(predict_latency(args, top, st, args.threads, served=served))
        if args.generate_rounds:
            row.update(generate_rates(served[1], st, args))
        texts = st.next_texts[-args.ingest_docs :]  # /predict's contexts are the first ones
        if args.worker_rounds:
            row.update(worker_rates(served[1], texts, 10_000_000, args.worker_rounds))
            decisions = np.concatenate(row.pop("decisions"))
            if args.decisions_out is not None:  # to compare runs (another depth, say)
                args.decisions_out.parent.mkdir(parents=True, exist_ok=True)
                np.save(args.decisions_out, decisions)
        row.update(ingest_rates(served[1], texts, first_doc=10_000_000))
    finally:
        served[1].close()
    row["load after"] = load_average()
    if not args.keep:
        shutil.rmtree(top)
    return row


COLUMNS = [
    ("N", "N"),
    ("index", "index"),
    ("build s", "build s"),
    ("encoder tok/s", "encoder alone tok/s"),
    ("memory tok/s", "ingest memory side tok/s"),
    ("search+decide ms/tok", "search+decide ms/tok"),
    ("append ms/tok", "append ms/tok"),
    ("memory/encoder time", "memory / encoder time"),
    ("worker tok/s", "worker tok/s (sum)"),
    ("encoder e2e tok/s", "encoder alone tok/s (worker rounds)"),
    ("worker seq tok/s", "worker sequential tok/s"),
    ("seq/encoder", "sequential / encoder"),
    ("worker ahead tok/s", "worker encode-ahead tok/s"),
    ("ahead/encoder", "encode-ahead / encoder"),
    ("decisions equal", "decisions equal"),
    ("http p50 ms", "/predict p50 ms"),
    ("http p99 ms", "/predict p99 ms"),
    ("bare p50 ms", "bare fwd p50 ms"),
    ("http/bare p50", "/predict / bare p50"),
    ("generate tok/s", "/generate tok/s"),
    ("bare generate tok/s", "bare HF generate tok/s"),
    ("generate/bare", "/generate / bare"),
    ("load before", "load before"),
    ("load after", "load after"),
]


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if v < 10 else f"{v:,.0f}"
    return str(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--keys-npz", type=Path, required=True, help="bench_scale's key folder")
    ap.add_argument("--sizes", default="100000,1000000")
    ap.add_argument("--heldout", type=int, default=8, help="last key files kept out")
    ap.add_argument("--noise", type=float, default=0.5, help="a of bench_scale's generator")
    ap.add_argument("--ingest-docs", type=int, default=6, help="articles MoNIM ingests per N")
    ap.add_argument("--requests", type=int, default=30, help="timed /predict calls per N (0: skip)")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--generate-tokens", type=int, default=64, help="new tokens per generation")
    ap.add_argument("--generate-rounds", type=int, default=5, help="timed rounds (0: skip)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/memlm-growth"))
    ap.add_argument("--threads", type=int, default=int(os.environ.get("MEMLM_THREADS", "1")))
    ap.add_argument("--keep", action="store_true", help="keep the stores")
    ap.add_argument(
        "--reuse", action="store_true", help="serve a kept store of that size as it is (no build)"
    )
    ap.add_argument(
        "--decisions-out", type=Path, help="save MoNIM's decisions of the worker rounds (.npy)"
    )
    ap.add_argument(
        "--worker-rounds",
        type=int,
        default=3,
        help="timed rounds of the whole worker path, sequential and encode-ahead (0: skip)",
    )
    args = ap.parse_args()
    faiss.omp_set_num_threads(args.threads)
    st = Stretcher(args.keys_npz, args.heldout, args.noise)
    print(
        f"# {st.real} real keys of {len(st.articles)} articles; threads {args.threads}; "
        f"faiss {faiss.__version__}; {os.cpu_count()} cores; load {load_average()}",
        flush=True,
    )
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        rows.append(bench_n(args, st, n))
        print({k: _cell(v) for k, v in rows[-1].items()}, flush=True)
    print()
    print(
        markdown_table(
            [title for _, title in COLUMNS],
            [[_cell(r.get(key, "-")) for key, _ in COLUMNS] for r in rows],
        )
    )
    print(
        f"\nprecision {rows[0].get('precision')}; MemRate "
        + ", ".join(f"{r['N']}: {r['MemRate']:.3f}" for r in rows)
    )
    if args.generate_rounds:
        print(
            "/generate: tokens with lambda > 0 (a search whose answer was mixed in), mean "
            "lambda: "
            + ", ".join(
                f"{r['N']}: {r['generate lambda>0']:.3f}, {r['generate mean lambda']:.3f}"
                for r in rows
            )
        )


if __name__ == "__main__":
    main()
