"""What counting usage costs (memlm.memory.usage): time per ingested document and bytes,
per entry (block 1) against blocks of 64, on synthetic neighbour lists.

    python benchmarks/bench_usage.py --entries 1000000 --docs 200 --tokens 700 --k 64

Neighbours of a token are drawn Zipf-like over the entry ids (popular entries come back),
values from a 50k vocabulary with the gold token among them 3% of the time (slice20:
82,837 hits of 2,560,576 retrievals).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from memlm.memory.usage import Usage


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--docs", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=700)
    ap.add_argument("--k", type=int, default=64)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(a.docs):
        ids = (rng.zipf(1.3, (a.tokens, a.k)) - 1) % a.entries
        gold = rng.integers(0, 50_000, a.tokens)
        vals = np.where(rng.random((a.tokens, a.k)) < 0.03, gold[:, None], 0).astype(np.int32)
        batches.append((ids.astype(np.int64), vals, gold))
    print("| block | ms per document | bytes | bytes per entry | blocks |")
    print("|---:|---:|---:|---:|---:|")
    for block in (1, 64):
        u = Usage(block)
        t0 = time.perf_counter()
        for ids, vals, gold in batches:
            u.add(ids, vals, gold)
        ms = (time.perf_counter() - t0) * 1000 / a.docs
        t = u.totals()
        print(
            f"| {block} | {ms:.2f} | {t['bytes']:,} | {t['bytes'] / a.entries:.2f} | {t['blocks']:,} |"
        )


if __name__ == "__main__":
    main()
