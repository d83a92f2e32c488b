"""Each caller's k and re-rank depth, and RetoMaton's pointers, on real tokens (issue 36).

A FullMem memory of a slice of the bundled news (every token of the ingested documents of
all days but the last, real SmolLM2-135M keys from the evaluation's encoder cache) under
the index the service would build for its size (IVF-PQ past 50k entries), plus an exact
flat index over the same datastore for the ground truth. Queries: the held-out (dev and
test) documents of every day, and the last day's ingested documents as MoNIM would score
them against that memory.

1. **Depth**: every (k, depth) the callers might ask for, side by side with today's
   default depth (max(4 k, 1024)) in one run: held-out tokens searched per second,
   recall@k against the exact search, test ppl (k, T, lambda tuned on dev over the grid's
   k <= k, as ``memlm eval`` does), the ppl at the default row's tuned values (the search's
   own effect) and, at k <= 64, the share of MoNIM decisions that change (the constant
   the service would tune on the same dev tokens).
2. **Pointers**: ``memlm.memory.pointers.PointerSearch`` on the same tokens against the
   full search at the same k and depth: searches saved, recall of the full search's ids,
   the ppl at the full search's tuned values, MoNIM decisions changed, and tokens/s.

    MEMLM_CACHE_DIR=/work/cache-speed PYTHONPATH=. python benchmarks/bench_search_depth.py \\
        --start 2017-02-13 --days 10 --max-docs-per-day 20 --threads 1

The encode (bfloat16, one thread) fills the cache the first time; later runs read it.

At the whole stream's size: ``--memory RUN/work/fullmem --split RUN/split.json`` searches
the memory a ``memlm eval --keep-stores`` run kept (its datastore and the last index it
built, e.g. 2.5M entries under IVF-PQ) with the held-out documents of that run's split,
instead of building a slice's memory. The exact ground truth then costs a flat index over every
entry (float32 in RAM: 5.8 GB at 2.5M) and is only built with ``--truth``; without it,
recall is measured against the default depth's ids.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import torch
from _common import load_average, markdown_table

import memlm.index.search as search_mod
from memlm.calibrator.constant import SERVED_GRID, TuneGrid, ppl, token_logprobs, tune
from memlm.corpus import load_corpus
from memlm.datastore import Datastore
from memlm.encoder import Encoder, TokenOutputs, WindowConfig
from memlm.evaluate import TokenCache, plan_stream
from memlm.evaluate.plan import plan_from_split
from memlm.index import FLAT_THRESHOLD, IndexParams, MemoryIndex, build_index
from memlm.index.params import BuildInfo
from memlm.index.versions import current_version, version_name
from memlm.knnlm import KnnParams
from memlm.knnlm.policy import make_policy, token_scores
from memlm.memory.pointers import PointerConfig, PointerSearch

Search = tuple[np.ndarray, np.ndarray, np.ndarray]


def split_of(outs: Sequence[TokenOutputs], found: Sequence[Search]) -> dict[str, np.ndarray]:
    """The held-out arrays ``tune`` and ``token_logprobs`` read."""
    return {
        "distances": np.concatenate([f[0] for f in found]),
        "values": np.concatenate([f[2] for f in found]),
        "gold": np.concatenate([o.targets for o in outs]).astype(np.int64),
        "target_lm_logprob": np.concatenate([o.target_logprob for o in outs]),
    }


def recall(ids: Sequence[np.ndarray], truth: Sequence[np.ndarray]) -> float:
    hit = tot = 0
    for a, b in zip(ids, truth, strict=True):
        for r in range(len(b)):
            t = b[r][b[r] >= 0]
            hit += len(np.intersect1d(a[r][a[r] >= 0], t))
            tot += len(t)
    return hit / tot if tot else float("nan")


def decisions(enc: Encoder, outs: Sequence[TokenOutputs], found: Sequence[Search], p: KnnParams):
    monim = make_policy("monim")
    return np.concatenate(
        [
            monim.decide(token_scores(enc, o, f[0][:, : p.k], f[2][:, : p.k], p))
            for o, f in zip(outs, found, strict=True)
        ]
    )


def timed_search(index: MemoryIndex, outs: Sequence[TokenOutputs], k: int, depth: int | None):
    """One search call per document (as the evaluation and the engine do); seconds."""
    t0 = time.perf_counter()
    found = [index.search_values(o.keys, k, depth=depth) for o in outs]
    return found, time.perf_counter() - t0


ONE_PIECE = "one piece"


def one_piece(index: MemoryIndex, outs: Sequence[TokenOutputs], k: int):
    """``timed_search`` at the default depth with the re-rank's float32 conversion in one
    piece (``RERANK_CHUNK_ELEMENTS = 0``, the code before the cache-sized pieces): the
    same distances to the bit, the old speed."""
    saved = search_mod.RERANK_CHUNK_ELEMENTS
    search_mod.RERANK_CHUNK_ELEMENTS = 0
    try:
        return timed_search(index, outs, k, None)
    finally:
        search_mod.RERANK_CHUNK_ELEMENTS = saved


def best_seconds(runs: dict[Any, Any], rounds: int) -> tuple[dict[Any, float], dict[Any, Any]]:
    """The fastest of ``rounds`` timings of each path, the paths alternated (forwards, then
    backwards) so that a change in the machine's load hits them alike; and each path's
    result (every round gives the same)."""
    best: dict[Any, float] = {}
    result: dict[Any, Any] = {}
    keys = list(runs)
    for r in range(rounds):
        for key in keys if r % 2 == 0 else keys[::-1]:
            t0 = time.perf_counter()
            result[key] = runs[key]()
            best[key] = min(best.get(key, float("inf")), time.perf_counter() - t0)
    return best, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--start", default="2017-02-13")
    ap.add_argument("--days", type=int, default=10)
    ap.add_argument("--max-docs-per-day", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workdir", type=Path, default=None, help="keep the stores here")
    ap.add_argument("--ks", default="1024,256,64", help="k of the depth table")
    ap.add_argument("--depths", default="4096,2048,1024,512,256,128", help="depths tried")
    ap.add_argument("--min-hits", default="2,4,8,16", help="pointer configurations")
    ap.add_argument("--pointer-ks", default="64,1024")
    ap.add_argument("--block", type=int, default=8, help="one more pointer row: min_hits 8")
    ap.add_argument("--rounds", type=int, default=2, help="timings: best of, alternated")
    ap.add_argument("--held-docs", type=int, default=None, help="the first N dev and N test")
    ap.add_argument("--ingest-docs", type=int, default=None, help="the last day's first N")
    ap.add_argument("--pointer-hits-large", default="16", help="pointer settings at k > 64")
    ap.add_argument("--memory", type=Path, default=None, help="an eval run's kept memory")
    ap.add_argument("--split", type=Path, default=None, help="that run's split.json")
    ap.add_argument("--truth", action="store_true", help="with --memory: exact ground truth")
    ap.add_argument("--no-pointers", action="store_true", help="the depth table only")
    ap.add_argument(
        "--one-piece", action="store_true", help="a row for the re-rank converted in one piece"
    )
    ap.add_argument(
        "--forward",
        action="store_true",
        help="time the bare forward on the held-out texts: a kNN-LM / bare column",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    print(f"load average before: {load_average()}")
    enc = Encoder.load("smollm2-135m", threads=args.threads, precision="bfloat16")
    if args.split is not None:  # the run's own plan, every day of it
        plans = plan_from_split(load_corpus("news"), json.loads(args.split.read_text()))
    else:
        plans = plan_stream(
            load_corpus("news"),
            days=args.days,
            start=dt.date.fromisoformat(args.start),
            max_docs_per_day=args.max_docs_per_day,
        )
    cache = TokenCache(enc, WindowConfig())
    memory_docs = [d for p in plans[:-1] for d in p.train]
    ingest = cache.get_many([d.text for d in plans[-1].train][: args.ingest_docs])
    dev_texts = [d.text for p in plans for d in p.dev][: args.held_docs]
    test_texts = [d.text for p in plans for d in p.test][: args.held_docs]
    dev, test = cache.get_many(dev_texts), cache.get_many(test_texts)
    held = dev + test
    tmp = tempfile.TemporaryDirectory()
    work = args.workdir or Path(tmp.name)
    if args.memory is not None:  # the run's memory as it stands, read only
        ds = Datastore.open(args.memory / "datastore", readonly=True)
        index = MemoryIndex(ds, args.memory / "index")
        version = current_version(args.memory / "index")
        if version is None:
            raise SystemExit(f"{args.memory / 'index'} holds no built version")
        params = BuildInfo.read(args.memory / "index" / version_name(version)).params
        n = index.num_entries
        exact = None
        if args.truth:
            build_index(ds, work / "exact", IndexParams.exact(), progress=False)
            exact = MemoryIndex(ds, work / "exact")
    else:
        ds = Datastore.open(work / "ds", dim=enc.dim)
        if len(ds) == 0:
            mem_outs = cache.get_many([d.text for d in memory_docs])
            for doc, o in enumerate(mem_outs):
                ds.append(
                    o.keys.astype(np.float16), o.targets.astype(np.int32), doc, o.positions, 0
                )
        n = len(ds)
        params = IndexParams.for_size(max(n, FLAT_THRESHOLD), ds.dim)
        for root, p in (("ivfpq", params), ("exact", IndexParams.exact())):
            if not (work / root / "CURRENT").exists():
                t0 = time.perf_counter()
                build_index(ds, work / root, p, progress=False, threads=args.threads)
                print(f"built {root} over {n} entries in {time.perf_counter() - t0:.1f} s")
        index = MemoryIndex(ds, work / "ivfpq")
        exact = MemoryIndex(ds, work / "exact")
    n_held, n_ingest = sum(len(o) for o in held), sum(len(o) for o in ingest)
    print(
        f"{n} entries ({len(memory_docs)} documents), index {params.kind} nlist {params.nlist} "
        f"m {params.m} nprobe {params.nprobe}; {n_held} held-out tokens ({len(dev)} dev, "
        f"{len(test)} test documents), {n_ingest} tokens of {len(ingest)} ingested documents"
    )
    ks = [int(x) for x in args.ks.split(",")]
    depths = [int(x) for x in args.depths.split(",")]
    truth = {  # without an exact index: the default depth's ids (filled in below)
        k: [exact.search_values(o.keys, k)[1] for o in (held + ingest if k <= 64 else held)]
        for k in ks
        if exact is not None
    }
    grid = TuneGrid()
    timed_search(index, held + ingest, 64, None)  # the page cache: every row warm alike
    fwd_rate = None
    if args.forward:  # the evaluation's own forward (keys and LM statistics), no memory
        ids = [enc.tokenize(t) for t in dev_texts + test_texts]
        t0 = time.perf_counter()
        enc.encode_many(ids, cache.window)
        fwd_rate = n_held / (time.perf_counter() - t0)
        print(f"bare forward: {fwd_rate:,.0f} tokens/s over {n_held} held-out tokens")

    # --- 1. depth --------------------------------------------------------------------------
    rows: list[tuple[Any, ...]] = []
    base: dict[int, dict[str, Any]] = {}
    for k in ks:
        default = params.rerank_depth(k)
        tried: list[Any] = [None] + sorted({d for d in depths if k <= d < default}, reverse=True)
        outs = held + ingest if k <= 64 else held
        n_outs = sum(len(o) for o in outs)
        paths = {d: lambda d=d, o=outs, k=k: timed_search(index, o, k, d) for d in tried}
        if args.one_piece:  # the default depth, its re-rank converted in one piece
            paths = {ONE_PIECE: lambda o=outs, k=k: one_piece(index, o, k)} | paths
            tried = [None, ONE_PIECE] + tried[1:]
        secs, results = best_seconds(paths, args.rounds)
        if k not in truth:
            truth[k] = [f[1] for f in results[None][0]]
        for key in tried:
            depth = None if key == ONE_PIECE else key
            found, seconds = results[key][0], secs[key]
            f_dev, f_test = found[: len(dev)], found[len(dev) : len(held)]
            kgrid = TuneGrid(tuple(x for x in grid.ks if x <= k), grid.temperatures, grid.lambdas)
            tuned, _ = tune(split_of(dev, f_dev), kgrid)
            test_split = split_of(test, f_test)
            p_test = ppl(token_logprobs(test_split, tuned))
            rec = recall([f[1] for f in found[: len(held)]], truth[k][: len(held)])
            changed = ""
            if key is None:
                base[k] = {"params": tuned, "ppl": p_test}
                if k <= 64:
                    served, _ = tune(split_of(dev, f_dev), SERVED_GRID)
                    base[k]["served"] = served
                    base[k]["decide"] = decisions(enc, ingest, found[len(held) :], served)
            same = ppl(token_logprobs(test_split, base[k]["params"]))
            if k <= 64:
                now = decisions(enc, ingest, found[len(held) :], base[k]["served"])
                changed = f"{(now != base[k]['decide']).mean():.2%}"
            rows.append(
                (
                    k,
                    f"{params.rerank_depth(k, depth)}"
                    + {None: " (default)", ONE_PIECE: " (default, one-piece re-rank)"}.get(key, ""),
                    f"{n_outs / seconds:,.0f}",
                    f"{secs[ONE_PIECE if args.one_piece else None] / seconds:.2f}x",
                    # a kNN-LM evaluation pays the forward and the search of each token
                    "" if fwd_rate is None else f"{1 / (1 + fwd_rate * seconds / n_outs):.2f}x",
                    f"{rec:.3f}",
                    f"{p_test:.3f}",
                    f"{tuned.k}/{tuned.temperature:g}/{tuned.lmbda:g}",
                    f"{same:.3f} ({same / base[k]['ppl'] - 1:+.2%})",
                    changed,
                )
            )
            print(rows[-1], flush=True)
    print(f"\nload average after the depth table: {load_average()}\n")
    print(
        markdown_table(
            [
                "k",
                "depth",
                "queries/s",
                "vs " + ("the one-piece default" if args.one_piece else "the default"),
                "kNN-LM / bare forward (forward + search)",
                "recall@k" + ("" if exact is not None else " (of the default's ids)"),
                "test ppl (tuned)",
                "tuned k/T/lambda",
                "test ppl at the default row's values",
                "MoNIM decisions changed",
            ],
            rows,
        )
    )

    # --- 2. pointers -----------------------------------------------------------------------
    prow: list[tuple[Any, ...]] = []
    for k in [] if args.no_pointers else [int(x) for x in args.pointer_ks.split(",")]:
        outs = held + ingest if k <= 64 else held
        hits = [int(h) for h in args.min_hits.split(",")]
        if k > 64:  # the held-out searches: the slow ones
            hits = [int(h) for h in args.pointer_hits_large.split(",")]
        configs = [PointerConfig(min_hits=h) for h in hits if h <= k]
        if args.block > 1:
            configs.append(PointerConfig(min_hits=8, block=args.block))

        def follow(cfg: PointerConfig, k: int = k, outs: list[TokenOutputs] = outs):
            ps = PointerSearch(lambda q, kk: index.search_values(q, kk), index.successors, k, cfg)
            return [ps.document(o.keys, o.targets)[:3] for o in outs], ps.stats

        paths: dict[Any, Any] = {"full": lambda o=outs, k=k: timed_search(index, o, k, None)}
        paths.update({c: (lambda c=c: follow(c)) for c in configs})
        secs, results = best_seconds(paths, args.rounds)
        full = results["full"][0]
        n_tok = sum(len(o) for o in outs)
        full_rate = n_tok / secs["full"]
        ref = base.get(k, {}).get("params") or tune(split_of(dev, full[: len(dev)]), grid)[0]
        ref_ppl = ppl(token_logprobs(split_of(test, full[len(dev) : len(held)]), ref))
        prow.append((k, "full search", f"{full_rate:,.0f}", "0%", "1.000", f"{ref_ppl:.3f}", ""))
        for cfg in configs:
            got, stats = results[cfg]
            rate = n_tok / secs[cfg]
            rec = recall([g[1] for g in got], [f[1] for f in full])
            p_ptr = ppl(token_logprobs(split_of(test, got[len(dev) : len(held)]), ref))
            changed = ""
            if k <= 64 and "served" in base.get(k, {}):
                now = decisions(enc, ingest, got[len(held) :], base[k]["served"])
                changed = f"{(now != base[k]['decide']).mean():.2%}"
            prow.append(
                (
                    k,
                    f"pointers, min_hits {cfg.min_hits}"
                    + (f", block {cfg.block}" if cfg.block > 1 else ""),
                    f"{rate:,.0f}",
                    f"{stats.saved:.1%}",
                    f"{rec:.3f}",
                    f"{p_ptr:.3f} ({p_ptr / ref_ppl - 1:+.2%})",
                    changed,
                )
            )
            print(prow[-1], flush=True)
    if prow:
        print(f"\nload average after: {load_average()}\n")
        print(
            markdown_table(
                [
                    "k",
                    "path",
                    "tokens/s",
                    "searches saved",
                    "recall of the full search's ids",
                    "test ppl at the full search's values",
                    "MoNIM decisions changed",
                ],
                prow,
            )
        )
    tmp.cleanup()


if __name__ == "__main__":
    main()
