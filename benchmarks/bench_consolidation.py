"""What one night's consolidation costs on a faiss memory of N entries (synthetic keys):
the re-test of ``--sample`` entries and a budget's retirement, against the build.

    python benchmarks/bench_consolidation.py --entries 100000 --sample 4096 --threads 1
    python benchmarks/bench_consolidation.py --entries 1000000 --spread-only
    python benchmarks/bench_consolidation.py --store /work/growth/n1000000/memory --nights 3

``--store``: the re-test alone, a few nights in a row, on a faiss memory a benchmark left
(``bench_cost_growth.py --keep``: real news keys stretched to N, the nightly build's
IVF-PQ index); it retires what fails from that store.

Keys (without ``--store``): 1,000 Gaussian clusters in 576 dimensions (as bench_index.py),
each cluster's entries sharing one of 5 values, so that some entries are redundant.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import faiss
import numpy as np

from memlm.knnlm import KnnParams
from memlm.memory.consolidation import ConsolidationConfig, consolidate
from memlm.memory.entry_lm import EntryLM
from memlm.memory.faiss_backend import FaissMemory
from memlm.memory.usage import Usage

DIM = 576


def spread_night(entries: int, days: int) -> None:
    """One spread-budget night on a faiss memory of ``entries`` over ``days`` days: retire
    one day's worth (what a night over budget retires) with p_LM known for every entry."""
    rng = np.random.default_rng(0)
    per_day = entries // days
    lm = EntryLM()
    with tempfile.TemporaryDirectory() as tmp:
        mem = FaissMemory.open(Path(tmp), DIM)
        t0 = time.perf_counter()
        for d in range(days):
            n = per_day if d < days - 1 else entries - per_day * (days - 1)
            keys = rng.standard_normal((n, DIM)).astype(np.float16)
            span = mem.put_document(d, keys, rng.integers(0, 49152, n), np.arange(n), 19000 + d)
            lm.add(mem.entry_ids(d, np.arange(n), span), -rng.exponential(2.0, n))
        t_fill = time.perf_counter() - t0
        cfg = ConsolidationConfig(budget=entries - per_day, criterion="spread")
        t0 = time.perf_counter()
        ids, _ = mem.live_days()
        t_read = time.perf_counter() - t0
        rep = consolidate(mem, cfg, KnnParams(), Usage(), lm_logprob=lm.of)
        t0 = time.perf_counter()
        lm.prune(mem.live_days()[0])
        t_prune = time.perf_counter() - t0
        print(f"entries {entries:,} over {days} days (fill {t_fill:.1f} s, no index)")
        print(
            f"spread budget night: {rep.retired['budget']:,} retired in {rep.seconds:.2f} s "
            f"(of which reading every live id and day: {t_read:.2f} s); "
            f"p_LM store {lm.nbytes() / 1e6:.1f} MB, pruned in {t_prune:.2f} s"
        )
        mem.close()


def retest_store(store: Path, sample: int, nights: int) -> None:
    """``nights`` re-tests of ``sample`` entries each on the memory at ``store`` (its
    served index), the cursor moving on as in the service; p_LM is unknown (taken as 0,
    the service's lower bound for such entries): the searches, the work, are the same."""
    mem = FaissMemory.open(store, None)
    try:
        built = mem.served_version
        print(f"{store}: {mem.count():,} live entries, index version {built}")
        params = KnnParams(k=64, temperature=5.0, lmbda=0.25)
        with tempfile.TemporaryDirectory() as cursor:
            for night in range(nights):
                rep = consolidate(
                    mem, ConsolidationConfig(sample=sample), params, Usage(), state=Path(cursor)
                )
                print(
                    f"night {night + 1}: re-test of {rep.examined:,} in {rep.seconds:.1f} s "
                    f"({1000 * rep.seconds / max(1, rep.examined):.2f} ms an entry, "
                    f"{2 * params.k + 1} neighbours each), {rep.retired['test']:,} retired"
                )
    finally:
        mem.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--sample", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--spread-only",
        action="store_true",
        help="only the spread budget (no index: it searches nothing), entries over --days",
    )
    ap.add_argument("--days", type=int, default=57, help="--spread-only: days the entries span")
    ap.add_argument(
        "--store", type=Path, help="only the re-test, on this faiss memory (retires from it)"
    )
    ap.add_argument("--nights", type=int, default=3, help="--store: re-tests in a row")
    a = ap.parse_args()
    faiss.omp_set_num_threads(a.threads)
    if a.store is not None:
        retest_store(a.store, a.sample, a.nights)
        return
    if a.spread_only:
        spread_night(a.entries, a.days)
        return
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((1000, DIM)).astype(np.float32) * 2
    cluster = rng.integers(0, 1000, a.entries)
    values = (cluster * 5 + rng.integers(0, 5, a.entries)).astype(np.int32)
    with tempfile.TemporaryDirectory() as tmp:
        mem = FaissMemory.open(Path(tmp), DIM)
        t0 = time.perf_counter()
        for lo in range(0, a.entries, 50_000):
            c = cluster[lo : lo + 50_000]
            keys = centres[c] + rng.standard_normal((len(c), DIM)).astype(np.float32)
            mem.put_document(lo, keys, values[lo : lo + len(c)], np.arange(len(c)), 19000)
        t_fill = time.perf_counter() - t0
        t0 = time.perf_counter()
        info = mem.build()
        mem.reload()
        t_build = time.perf_counter() - t0
        params = KnnParams(k=64, temperature=5.0, lmbda=0.25)
        usage = Usage()
        cfg = ConsolidationConfig(sample=a.sample)
        rep = consolidate(mem, cfg, params, usage)
        budget = ConsolidationConfig(sample=0, budget=a.entries - a.sample, criterion="usage")
        rep_b = consolidate(mem, budget, params, usage)
        age = ConsolidationConfig(sample=0, budget=a.entries - 2 * a.sample, criterion="age")
        rep_a = consolidate(mem, age, params, usage)
        t0 = time.perf_counter()
        mem.compact()
        info2 = mem.build()
        t_build2 = time.perf_counter() - t0
        print(f"entries {a.entries:,}, index {info.params.kind} nlist {info.params.nlist}")
        print(f"fill {t_fill:.1f} s, full build {t_build:.1f} s")
        print(
            f"re-test of {rep.examined:,}: {rep.seconds:.1f} s "
            f"({1000 * rep.seconds / max(1, rep.examined):.2f} ms an entry), "
            f"{rep.retired['test']:,} retired"
        )
        print(f"usage budget, {rep_b.retired['budget']:,} retired: {rep_b.seconds:.1f} s")
        print(f"age budget, {rep_a.retired['budget']:,} retired: {rep_a.seconds:.1f} s")
        print(
            f"compaction + incremental build after: {t_build2:.1f} s "
            f"({info2.mode}, removed {info2.removed:,})"
        )
        mem.close()


if __name__ == "__main__":
    main()
