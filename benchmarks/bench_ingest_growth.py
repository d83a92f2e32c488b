"""What the memory costs MoNIM's ingest as entries pile up since the last build (issue 32,
item 4): faiss, Milvus without sealing, Milvus sealing every ``--seal-rows`` rows, in one run.

Memory-level, as the ingest worker uses it: per document, one search of its
``--doc-tokens`` token keys (k=64, MoNIM's decision needs every token's neighbours), then
one ``append`` of the ``--stored`` entries MoNIM keeps. The LM forward is left out: the
keys are cached real SmolLM2-135M keys (``--keys-npz``, as ``bench_index.py --encode-news``
writes; held-out files are the queries), stretched with jittered copies to the largest
size (``bench_memory_backends.stretch``). So "tokens/s" is the memory's ceiling on the
worker's rate, not the worker's rate: the forward adds its own, constant, cost per token.

Each memory first holds ``--base`` entries indexed by one build with IVF_PQ (``--nlist``
lists; faiss: its IVF-PQ index; Milvus: the collection's index, which Milvus then also
builds on every segment sealed later; ``--milvus-index hnsw`` etc.: that kind instead). At each size N of entries appended since that
build the table shows the median search time per token, the Milvus server's CPU time per
token (``--milvus-pid``: /proc accounting of the server process, less sensitive than wall
time to the other jobs on a shared machine; the server is shared too, so it is an upper
bound) and the rate of ``--docs`` timed documents (search + append). The fill between
sizes appends 2,000-entry documents, untimed.

    MEMLM_THREADS=2 python benchmarks/bench_ingest_growth.py \\
        --keys-npz /work/cache-milvus/news-keys --milvus 127.0.0.1:19530 \\
        --sizes 10000,100000,300000 --milvus-pid "$(pgrep -f 'milvus run standalone')"
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from _common import load_average, markdown_table
from bench_memory_backends import real_keys, stretch

from memlm.index import FLAT_THRESHOLD, IndexParams
from memlm.memory import open_faiss, open_milvus
from memlm.memory.embedded import start_embedded
from memlm.memory.milvus_index import params_for

FILL_DOC = 2000  # entries per untimed fill document


def entries(
    keys: npt.NDArray[np.float16], doc: int
) -> tuple[Any, npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any]]:
    m = len(keys)
    return keys, np.arange(m) % 49152, np.full(m, doc), np.arange(m), np.full(m, 17_000)


def grow(mem: Any, pool: npt.NDArray[np.float16], have: int, n: int, doc: int) -> int:
    """Append pool rows ``have:n`` as fill documents; returns the next document id."""
    for a in range(have, n, FILL_DOC):
        mem.append(*entries(pool[a : min(n, a + FILL_DOC)], doc))
        doc += 1
    return doc


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 without one)."""
    if not pid:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_docs(
    mem: Any,
    pool: npt.NDArray[np.float16],
    q: npt.NDArray[np.float32],
    args: argparse.Namespace,
    doc: int,
) -> tuple[list[float], list[float], list[float]]:
    """(search seconds, append seconds, Milvus CPU seconds of the search) of ``args.docs``
    documents."""
    searches, appends, cpu = [], [], []
    rng = np.random.default_rng(doc)
    for i in range(args.docs):
        a = (i * args.doc_tokens) % max(1, len(q) - args.doc_tokens)
        c0 = cpu_seconds(args.milvus_pid)
        t0 = time.perf_counter()
        mem.search(q[a : a + args.doc_tokens], args.k)
        t1 = time.perf_counter()
        cpu.append(cpu_seconds(args.milvus_pid) - c0)
        rows = rng.integers(0, len(pool), args.stored)
        mem.append(*entries(pool[rows], doc + i))
        t2 = time.perf_counter()
        searches.append(t1 - t0)
        appends.append(t2 - t1)
    return searches, appends, cpu


def run(
    name: str, mem: Any, pool: npt.NDArray[np.float16], q: Any, args: argparse.Namespace
) -> list[dict[str, Any]]:
    rows = []
    doc = grow(mem, pool, 0, args.base, 1)
    if args.base:  # else: never built, the memory's exact index (faiss: fresh; Milvus: FLAT)
        t0 = time.perf_counter()
        params = IndexParams(
            kind="ivfpq", nlist=args.nlist, m=args.m, nprobe=16, train_size=args.base
        )
        if name != "faiss" and args.milvus_index != "ivf_pq":  # faiss builds IVF-PQ only
            params = params_for(
                FLAT_THRESHOLD, pool.shape[1], mem.segment_rows(), args.milvus_index
            )
        mem.build_index(params)
        took = time.perf_counter() - t0
        print(f"# {name}: {args.base:,} entries built ({params}) in {took:.1f} s", flush=True)
    have = args.base
    for n in [int(s) for s in args.sizes.split(",")]:
        t0 = time.perf_counter()
        doc = grow(mem, pool, have, args.base + n, doc)
        fill = time.perf_counter() - t0
        have = args.base + n
        mem.search(q[:8], args.k)  # warm (a seal's segments loaded)
        s, a, cpu = timed_docs(mem, pool, q, args, 10_000_000 + n)
        have += args.docs * args.stored
        doc_s = [x + y for x, y in zip(s, a, strict=True)]
        rows.append(
            {
                "memory": name,
                "entries since build": n,
                "search us/token": 1e6 * statistics.median(s) / args.doc_tokens,
                "Milvus CPU us/token": 1e6 * statistics.median(cpu) / args.doc_tokens
                if args.milvus_pid and name != "faiss"
                else "",
                "append ms/doc": 1e3 * statistics.median(a),
                "ingest tokens/s": args.doc_tokens * len(doc_s) / sum(doc_s),
                "fill s": fill,
                "load": load_average(),
            }
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--keys-npz", type=Path, required=True)
    ap.add_argument(
        "--milvus",
        default="127.0.0.1:19530",
        help="host:port of a Milvus server, or 'embedded' (started here, stopped at the end)",
    )
    ap.add_argument("--sizes", default="10000,100000,300000")
    ap.add_argument("--base", type=int, default=20000, help="entries of the last build")
    ap.add_argument("--nlist", type=int, default=256, help="IVF lists of that build")
    ap.add_argument("--m", type=int, default=48, help="PQ sub-quantizers of that build")
    ap.add_argument(
        "--milvus-index",
        default="ivf_pq",
        help="Milvus's index of that build: ivf_pq (--nlist, --m, as faiss) or another kind "
        "of the memory URL's index option (hnsw, ivf_flat, ivf_sq8: sized as the memory does)",
    )
    ap.add_argument("--milvus-pid", type=int, default=None, help="the server's pid (CPU time)")
    ap.add_argument("--doc-tokens", type=int, default=512, help="tokens searched per document")
    ap.add_argument("--stored", type=int, default=256, help="entries MoNIM keeps per document")
    ap.add_argument("--docs", type=int, default=5, help="timed documents per size")
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--seal-rows", type=int, default=20000, help="the fix: seal every N rows")
    ap.add_argument("--stretch-noise", type=float, default=0.1)
    ap.add_argument("--memories", default="faiss,milvus-unsealed,milvus-sealed")
    args = ap.parse_args()
    top = args.base + max(int(s) for s in args.sizes.split(",")) + args.docs * args.stored * 10
    real, q = real_keys(args.keys_npz, 4 * args.doc_tokens)
    pool = stretch(real, top, args.stretch_noise)
    dim = pool.shape[1]
    print(f"# {len(real):,} real keys stretched to {len(pool):,}, dim {dim}; {load_average()}")
    server = None
    if args.milvus == "embedded" and args.memories != "faiss":
        server = start_embedded(Path(tempfile.mkdtemp(prefix="growth-milvus-")))
        args.milvus = f"{server.host}:{server.port}"
        proc = getattr(server.server, "server_proc", None)
        args.milvus_pid = args.milvus_pid or (proc.pid if proc is not None else None)
    try:
        rows = measure(args, pool, q, dim)
    finally:
        if server is not None:
            server.stop()
    print_rows(rows)


def measure(
    args: argparse.Namespace, pool: npt.NDArray[np.float16], q: Any, dim: int
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    mem: Any
    for name in args.memories.split(","):
        if name == "faiss":
            with tempfile.TemporaryDirectory() as d:
                mem = open_faiss(Path(d), dim, shared=True)
                rows += run(name, mem, pool, q, args)
                mem.close()
            continue
        seal = args.seal_rows if name == "milvus-sealed" else 0
        url = f"milvus://{args.milvus}/growth_{uuid.uuid4().hex[:10]}?seal={seal}&timeout=600"
        mem = open_milvus(url, dim)
        try:
            rows += run(f"{name}" + (f" ({seal:,})" if seal else ""), mem, pool, q, args)
        finally:
            mem.drop()
            mem.close()
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    cols = list(rows[0])
    cells = [
        [
            f"{v:,.0f}"
            if isinstance(v, float) and v >= 100
            else f"{v:.1f}"
            if isinstance(v, float)
            else f"{v:,}"
            if isinstance(v, int)
            else v
            for v in (r[c] for c in cols)
        ]
        for r in rows
    ]
    print(markdown_table(cols, cells, align="l" + "r" * (len(cols) - 2) + "l"))


if __name__ == "__main__":
    main()
