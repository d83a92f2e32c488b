"""How well Milvus's HNSW finds the exact top-10 on one flushed, indexed segment, at a
few (M, ef) pairs (why tests/test_memory_milvus.py searches HNSW at ef 128).

    python scripts/milvus_hnsw_probe.py --server 127.0.0.1:19530

Start a server first (``memlm.memory.embedded.start_embedded``). For each pair: a new
collection, 3,000 random 16-d keys inserted, flushed and indexed, then 20 queries'
top-10 ids compared rank by rank with brute force, polled for 8 s (the handoff from the
growing copy, searched exactly, to the indexed segment).
"""

from __future__ import annotations

import argparse
import time
import uuid

import numpy as np
from pymilvus import Collection, CollectionSchema, DataType, FieldSchema, connections, utility

DIM, N, K = 16, 3000, 10


def probe(m: int, ef: int, seconds: float) -> float:
    rng = np.random.default_rng(11)
    name = f"hnsw_probe_{uuid.uuid4().hex[:8]}"
    schema = CollectionSchema(
        [
            FieldSchema("id", DataType.INT64, is_primary=True),
            FieldSchema("key", DataType.FLOAT_VECTOR, dim=DIM),
        ]
    )
    coll = Collection(name, schema, consistency_level="Strong")
    try:
        index = {
            "index_type": "HNSW",
            "metric_type": "L2",
            "params": {"M": m, "efConstruction": 128},
        }
        coll.create_index("key", index)
        coll.load()
        keys = rng.standard_normal((N, DIM)).astype(np.float32)
        coll.insert([np.arange(N), keys])
        q = rng.standard_normal((20, DIM)).astype(np.float32)
        want = np.argsort(((q[:, None, :] - keys[None]) ** 2).sum(-1), axis=1)[:, :K]
        coll.flush()
        utility.wait_for_index_building_complete(name)
        t0, match = time.time(), 0.0
        while time.time() - t0 < seconds:  # the last reading: the indexed segment
            res = coll.search(q, "key", {"metric_type": "L2", "params": {"ef": ef}}, limit=K)
            match = float((np.array([[h.id for h in hits] for hits in res]) == want).mean())
            time.sleep(0.5)
        return match
    finally:
        utility.drop_collection(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", default="127.0.0.1:19530")
    ap.add_argument("--seconds", type=float, default=8.0)
    args = ap.parse_args()
    host, _, port = args.server.rpartition(":")
    connections.connect(host=host, port=int(port))
    print("| M | ef | top-10 rank match |\n|---:|---:|---:|")
    for m, ef in [(8, 32), (8, 128), (16, 64), (16, 128)]:
        print(f"| {m} | {ef} | {probe(m, ef, args.seconds):.3f} |", flush=True)


if __name__ == "__main__":
    main()
