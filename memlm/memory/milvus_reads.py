"""Reading one physical Milvus collection: searches, scans and lookups as functions of a
``pymilvus.Collection`` and arrays, with memlm's result types.

Which collection to ask (the alias, the generations, a retry after a switch) is
:class:`memlm.memory.milvus_collection.MilvusCollection`'s business; these functions ask
the one they are given, once, and turn its rows into ``Neighbours``, ``Scanned`` and
``Provenance``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from memlm.memory.base import Neighbours, Provenance, Scanned, empty_neighbours
from memlm.memory.milvus_client import MAX_POSITION, Collection

# Query vectors per search call (Milvus accepts up to 16,384; results must fit a message).
SEARCH_BATCH = 1024
MAX_TOPK = 16384  # Milvus's limit on k
# Bytes of one search answer at most (gRPC's limit is 64 MB), and of one hit without its
# key (id, distance, value, framing).
REPLY_BYTES = 32 * 1024 * 1024
HIT_BYTES = 32


def search_batch(fetch: int, key_dim: int) -> int:
    """Queries per search call when each brings ``fetch`` hits back, with their float32
    keys of ``key_dim`` dimensions (0: without keys). A re-rank brings every candidate's
    key back (1,024 candidates of d=576 are 2.4 MB a query): each answer stays under
    gRPC's message limit."""
    per_query = fetch * (4 * key_dim + HIT_BYTES)
    return max(1, min(SEARCH_BATCH, REPLY_BYTES // per_query))


Page = tuple[
    npt.NDArray[np.float32],
    npt.NDArray[np.int32],
    npt.NDArray[np.int64],
    npt.NDArray[np.int32],
    npt.NDArray[np.int32],
]


def search_in(
    coll: Collection,
    q: npt.NDArray[np.float32],
    k: int,
    *,
    fetch: int,
    param: dict[str, Any],
    rerank: bool,
    consistency: str,
    timeout: int,
) -> Neighbours:
    """One search call (at most ``SEARCH_BATCH`` queries, ``fetch`` <= ``MAX_TOPK``
    candidates each); ``rerank``: order the candidates exactly from their stored keys and
    keep ``k``. Rows with fewer hits are padded (-1 ids)."""
    assert len(q) <= SEARCH_BATCH and fetch <= MAX_TOPK, (len(q), fetch)
    out = empty_neighbours(len(q), k)
    res = coll.search(
        q,
        "key",
        param,
        limit=fetch,
        output_fields=["value", "key"] if rerank else ["value"],
        consistency_level=consistency,
        timeout=timeout,
    )
    for r, hits in enumerate(res):
        m = len(hits)
        if not m:
            continue
        ids = np.fromiter(hits.ids, np.int64, m)
        dist = np.fromiter(hits.distances, np.float32, m)
        vals = np.fromiter((h.entity.get("value") for h in hits), np.int32, m)
        if rerank:
            keys = np.array([h.entity.get("key") for h in hits], np.float32)
            diff = keys - q[r]
            dist = np.einsum("ij,ij->i", diff, diff).astype(np.float32)
            order = np.argsort(dist, kind="stable")[:k]
            ids, dist, vals = ids[order], dist[order], vals[order]
        w = min(k, len(ids))
        out.distances[r, :w] = dist[:w]
        out.ids[r, :w] = ids[:w]
        out.values[r, :w] = vals[:w]
    return out


def count_in(coll: Collection, expr: str, timeout: int) -> int:
    """Live rows matching ``expr`` ("" : all), as of now (strong consistency)."""
    res = coll.query(expr, output_fields=["count(*)"], consistency_level="Strong", timeout=timeout)
    return int(res[0]["count(*)"]) if res else 0


def documents_in(coll: Collection) -> set[int]:
    """The distinct document ids that hold rows (reads the doc_id column)."""
    out: set[int] = set()
    it = coll.query_iterator(
        batch_size=16384, expr="", output_fields=["doc_id"], consistency_level="Strong"
    )
    try:
        while page := it.next():
            out.update(int(r["doc_id"]) for r in page)
    finally:
        it.close()
    return out


def days_in(coll: Collection, timeout: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]]:
    """Every live row's id and day, in id order (two int columns; no keys)."""
    ids: list[int] = []
    days: list[int] = []
    it = coll.query_iterator(
        batch_size=16384,
        expr="",
        output_fields=["day"],
        consistency_level="Strong",
        timeout=timeout,
    )
    try:
        while page := it.next():
            ids.extend(int(r["id"]) for r in page)
            days.extend(int(r["day"]) for r in page)
    finally:
        it.close()
    out, d = np.asarray(ids, np.int64), np.asarray(days, np.int32)
    order = np.argsort(out, kind="stable")
    return out[order], d[order]


def pages(coll: Collection, dim: int, batch_size: int, timeout: int) -> Iterator[Page]:
    """Every row, a page at a time: (keys float32 (n, dim), values, documents, positions,
    days)."""
    it = coll.query_iterator(
        batch_size=batch_size,
        expr="",
        output_fields=["value", "doc_id", "position", "day", "key"],
        consistency_level="Strong",
        timeout=timeout,
    )
    try:
        while page := it.next():
            yield (
                np.array([r["key"] for r in page], np.float32).reshape(-1, dim),
                np.array([r["value"] for r in page], np.int32),
                np.array([r["doc_id"] for r in page], np.int64),
                np.array([r["position"] for r in page], np.int32),
                np.array([r["day"] for r in page], np.int32),
            )
    finally:
        it.close()


def scan_in(coll: Collection, cursor: int, limit: int, dim: int, timeout: int) -> Scanned:
    """Live rows with ids >= ``cursor``, in id order (a query with a limit returns the
    smallest primary keys, as pymilvus's query iterator relies on)."""
    rows = coll.query(
        f"id >= {max(0, int(cursor))}",
        limit=int(limit),
        output_fields=["id", "value", "key"],
        consistency_level="Strong",
        timeout=timeout,
    )
    rows = sorted(rows, key=lambda r: int(r["id"]))
    ids = np.array([int(r["id"]) for r in rows], np.int64)
    keys = np.array([r["key"] for r in rows], np.float32).reshape(-1, dim)
    values = np.array([r["value"] for r in rows], np.int32)
    nxt = int(ids[-1]) + 1 if len(ids) == limit and len(ids) else 0
    return Scanned(ids, keys, values, nxt)


def successors_in(
    coll: Collection,
    q: npt.NDArray[np.float32],
    prev: npt.NDArray[np.int64],
    consistency: str,
    timeout: int,
) -> Neighbours:
    """Row ``prev + 1`` of each neighbour where its document stored it: one query for
    all rows, exact distances from the stored float32 keys."""
    out = empty_neighbours(*prev.shape)
    last = MAX_POSITION - 1  # id + 1 of a document's last position is another document
    want = np.unique(prev[(prev >= 0) & ((prev & last) < last)] + 1)
    if not len(want):
        return out
    rows = coll.query(
        f"id in {want.tolist()}",
        output_fields=["value", "key"],
        consistency_level=consistency,
        timeout=timeout,
    )
    found = {int(r["id"]): r for r in rows}
    for r in range(prev.shape[0]):
        hits = [found[int(i) + 1] for i in prev[r] if i >= 0 and int(i) + 1 in found]
        if not hits:
            continue
        keys = np.array([h["key"] for h in hits], np.float32)
        diff = keys - q[r]
        dist = np.einsum("ij,ij->i", diff, diff).astype(np.float32)
        order = np.argsort(dist, kind="stable")
        m = len(order)
        out.distances[r, :m] = dist[order]
        out.ids[r, :m] = [int(hits[j]["id"]) for j in order]
        out.values[r, :m] = [int(hits[j]["value"]) for j in order]
    return out


def provenance_in(
    coll: Collection, want: npt.NDArray[np.int64], consistency: str, timeout: int
) -> Provenance:
    """(document, position, day) of each id in ``want``; -1 where it is not stored."""
    docs = np.full(len(want), -1, np.int64)
    pos = np.full(len(want), -1, np.int64)
    days = np.full(len(want), -1, np.int32)
    if not len(want):
        return Provenance(docs, pos, days)
    rows = coll.query(
        f"id in {np.unique(want).tolist()}",
        output_fields=["doc_id", "position", "day"],
        consistency_level=consistency,
        timeout=timeout,
    )
    found = {int(r["id"]): r for r in rows}
    for i, e in enumerate(want.tolist()):
        r = found.get(e)
        if r is not None:
            docs[i], pos[i], days[i] = r["doc_id"], r["position"], r["day"]
    return Provenance(docs, pos, days)
