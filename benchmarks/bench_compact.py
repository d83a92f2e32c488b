"""Forget at scale: the cost of one deletion and of compacting the datastore afterwards.

Builds a synthetic store (random float16 keys, documents of ``--per-doc`` consecutive
entries), deletes every ``--every``-th document (each given its entry range, as the
worker does) and compacts. Prints one line: milliseconds per deletion, compaction
seconds, rows removed, bytes reclaimed, and the load average.

    PYTHONPATH=. python benchmarks/bench_compact.py --entries 200000 --dim 576
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from _common import load_average, stopwatch

from memlm.datastore import Datastore


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--entries", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=576)
    p.add_argument("--per-doc", type=int, default=500)
    p.add_argument("--every", type=int, default=10, help="delete every n-th document")
    p.add_argument("--segment", type=int, default=100_000, help="max_segment_entries")
    a = p.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        ds = Datastore.open(Path(d), dim=a.dim, max_segment_entries=a.segment)
        step = 20_000
        for s in range(0, a.entries, step):
            n = min(step, a.entries - s)
            keys = rng.standard_normal((n, a.dim)).astype(np.float16)
            docs = np.arange(s, s + n) // a.per_doc
            ds.append(keys, np.zeros(n, np.int64), docs, np.zeros(n, np.int64), 0)
        doomed = range(0, -(-a.entries // a.per_doc), a.every)
        with stopwatch() as deleting:
            for doc in doomed:
                ds.delete_document(doc, entries=range(doc * a.per_doc, (doc + 1) * a.per_doc))
        per_delete = deleting.seconds / len(doomed)
        with stopwatch() as compacting:
            done = ds.compact()
        seconds = compacting.seconds
        print(
            f"{a.entries} entries d={a.dim}, {len(doomed)} documents deleted: "
            f"{per_delete * 1e3:.2f} ms per deletion; compaction {seconds:.2f} s, "
            f"{done.segments} segments, {done.rows_removed} rows removed, "
            f"{done.bytes_reclaimed / 1e6:.1f} MB reclaimed; live {ds.num_live}; "
            f"load average {load_average()}"
        )
        ds.close()


if __name__ == "__main__":
    main()
