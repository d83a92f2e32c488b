"""One Milvus collection as a kNN-LM memory's store, through ``pymilvus``.

Collection ``<name>``: ``id`` (INT64 primary key), ``value`` (next token), ``doc_id``,
``position``, ``day`` and ``key`` (FLOAT_VECTOR: Milvus 2.3 has no float16 vectors).

- Entry ids are deterministic, ``doc_id * 2**24 + position``, and a document's entries are
  written in one ``append`` that first deletes whatever the document held, then upserts:
  writing a document again (a worker killed between its insert and its database commit,
  then the retry) replaces its entries instead of adding a second copy.
- New entries are searchable through Milvus's growing segments (scanned exactly) as soon
  as the query node consumed them (~0.2 s, one time tick); ``build_index`` flushes, so they
  are sealed and indexed, and compacts away deleted rows.
- Sealed segments are indexed separately by Milvus: FLAT below ``FLAT_THRESHOLD`` live
  entries, else IVF_PQ with ``IndexParams.for_size`` of the rows of one segment (the
  lists must be filled from one segment's rows) and the same nprobe as the faiss memory.
- The exact re-rank of the faiss memory is skipped by default (``rerank=False``): the
  distances of IVF_PQ hits are PQ approximations; ``rerank=True`` fetches
  ``rerank_factor * k`` candidates with their stored keys and orders them exactly
  (recall and cost of both: benchmarks/bench_memory_backends.py).

:class:`memlm.memory.milvus_backend.MilvusMemory` adds what the engine asks of a memory
(the version records of its builds, rollback, forgetting).
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from memlm.index import FLAT_THRESHOLD, IndexParams
from memlm.memory.base import Neighbours, Provenance, Scanned, empty_neighbours
from memlm.memory.milvus_client import (
    FIELDS,
    MAX_POSITION,
    Collection,
    MilvusException,
    MilvusMemoryError,
    connections,
    entry_ids,
    mapped,
    milvus_index,
    new_schema,
    served_params,
    utility,
)
from memlm.memory.url import MilvusURL

log = logging.getLogger(__name__)

# Rows per insert call: ~19 MB of float32 keys at d=576, under gRPC's 64 MB message limit.
INSERT_BATCH = 8192
# Query vectors per search call (Milvus accepts up to 16,384; results must fit a message).
SEARCH_BATCH = 1024
MAX_TOPK = 16384  # Milvus's limit on k
# Rows of a sealed segment: Milvus's default segment.maxSize (512 MB) of raw float32 keys.
SEGMENT_BYTES = 512 * 1024 * 1024
_aliases = itertools.count()


class MilvusCollection:
    """A memory's entries in one Milvus collection (see the module docstring)."""

    name = "milvus"

    def __init__(self, url: MilvusURL, dim: int | None) -> None:
        self.url = url
        # pymilvus bounds its retries of a failed call by ``timeout`` only when it is an
        # int; a float means 75 retries (about 3.5 minutes against a dead server)
        self.timeout = max(1, math.ceil(url.timeout))
        self.alias = f"memlm-{next(_aliases)}-{id(self):x}"
        connections.connect(alias=self.alias, host=url.host, port=url.port, timeout=url.timeout)
        self.server_version = str(utility.get_server_version(using=self.alias))
        self._lock = threading.Lock()  # build_index() vs itself; searches never wait for it
        if utility.has_collection(url.collection, using=self.alias, timeout=self.timeout):
            self.collection = Collection(url.collection, using=self.alias)
            self._dim = self._check_schema(dim)
        else:
            if dim is None:
                raise MilvusMemoryError(f"collection {url.collection!r} does not exist")
            self._dim = int(dim)
            self.collection = self._create()
        self.params = self._index_params()
        self.collection.load(timeout=self.timeout)

    @property
    def dim(self) -> int:
        return self._dim

    # --- schema --------------------------------------------------------------------------

    def _create(self) -> Collection:
        schema = new_schema(self.dim)
        coll = Collection(self.url.collection, schema, using=self.alias, timeout=self.timeout)
        coll.create_index("key", milvus_index(IndexParams.exact()), timeout=self.timeout)
        log.info("created Milvus collection %s (dim %d)", self.url, self.dim)
        return coll

    def _check_schema(self, dim: int | None) -> int:
        schema = self.collection.schema
        names = [f.name for f in schema.fields]
        if names != FIELDS:
            raise MilvusMemoryError(
                f"collection {self.url.collection!r} is not a memlm memory (fields {names})"
            )
        have = int(schema.fields[-1].params["dim"])
        if dim is not None and have != dim:
            raise MilvusMemoryError(
                f"collection {self.url.collection!r} holds dim {have} keys, the model has {dim}"
            )
        return have

    def _index_params(self) -> IndexParams:
        """The served index as ``IndexParams`` (nprobe as ``params_for`` chooses it)."""
        return served_params(self.collection, self.timeout)

    def segment_rows(self) -> int:
        return SEGMENT_BYTES // (4 * self.dim + 24)

    def params_for(self, n: int) -> IndexParams:
        """FLAT below the faiss memory's threshold, else IVF_PQ sized to one segment."""
        if n < FLAT_THRESHOLD:
            return IndexParams.exact()
        return IndexParams.for_size(max(FLAT_THRESHOLD, min(n, self.segment_rows())), self.dim)

    # --- writing ---------------------------------------------------------------------------

    @mapped
    def append(
        self,
        keys: npt.ArrayLike,
        values: npt.ArrayLike,
        documents: npt.ArrayLike,
        positions: npt.ArrayLike,
        days: npt.ArrayLike,
    ) -> npt.NDArray[np.int64]:
        """Write entries (all of each of their documents): the documents' earlier entries
        are deleted first, then these are upserted; returns their deterministic ids."""
        docs = np.asarray(documents, np.int64)
        self._check(keys, values, docs, positions, days)
        uniq = np.unique(docs)
        if len(uniq):
            self._delete_expr(f"doc_id in {uniq.tolist()}")
        return self.upsert(keys, values, docs, positions, days)

    def _check(
        self,
        keys: npt.ArrayLike,
        values: npt.ArrayLike,
        documents: npt.ArrayLike,
        positions: npt.ArrayLike,
        days: npt.ArrayLike,
    ) -> npt.NDArray[np.int64]:
        k = np.asarray(keys)
        n = len(k)
        if k.ndim != 2 or k.shape[1] != self.dim:
            raise ValueError(f"keys: expected shape (n, {self.dim}), got {k.shape}")
        if not (len(values) == len(documents) == len(positions) == len(days) == n):  # type: ignore[arg-type]
            raise ValueError("keys, values, documents, positions and days differ in length")
        ids = entry_ids(documents, positions)
        if len(np.unique(ids)) != n:
            raise ValueError("two entries with the same (document, position)")
        return ids

    @mapped
    def upsert(
        self,
        keys: npt.ArrayLike,
        values: npt.ArrayLike,
        documents: npt.ArrayLike,
        positions: npt.ArrayLike,
        days: npt.ArrayLike,
    ) -> npt.NDArray[np.int64]:
        """Insert or replace entries by their deterministic ids (idempotent); a document may
        span several calls (``migrate``); returns the ids."""
        ids = self._check(keys, values, documents, positions, days)
        k = np.ascontiguousarray(keys, dtype=np.float32)
        cols = [np.asarray(c, np.int64) for c in (values, documents, positions, days)]
        for a in range(0, len(k), INSERT_BATCH):
            b = min(len(k), a + INSERT_BATCH)
            self.collection.upsert(
                [ids[a:b].tolist(), *(c[a:b].tolist() for c in cols), k[a:b]],
                timeout=self.timeout,
            )
        return ids

    def _delete_expr(self, expr: str) -> int:
        res = self.collection.delete(expr, timeout=self.timeout)
        return int(res.delete_count)

    @mapped
    def delete_entries(self, doc_id: int) -> int:
        """Delete a document's entries; returns how many it held (0 when none)."""
        doc_id = int(doc_id)
        held = self._count(f"doc_id == {doc_id}")
        if held:
            self._delete_expr(f"doc_id == {doc_id}")
        return held

    @mapped
    def delete_documents_except(self, keep: npt.ArrayLike, documents: npt.ArrayLike) -> int:
        """Delete the entries of ``documents`` that are not in ``keep`` (cleanup of entries
        whose documents never committed); returns how many were deleted."""
        drop = np.setdiff1d(np.asarray(documents, np.int64), np.asarray(keep, np.int64))
        total = 0
        for a in range(0, len(drop), 1000):
            part = drop[a : a + 1000].tolist()
            n = self._count(f"doc_id in {part}")
            if n:
                self._delete_expr(f"doc_id in {part}")
                total += n
        return total

    @mapped
    def retire(self, ids: npt.ArrayLike, *, crash_at: str | None = None) -> int:
        """Delete single entries by id (one call: nothing to crash between, so
        ``crash_at`` has no points here); returns how many were live."""
        want = np.unique(np.asarray(ids, np.int64).reshape(-1))
        total = 0
        for a in range(0, len(want), 1000):
            part = want[a : a + 1000].tolist()
            n = self._count(f"id in {part}")
            if n:
                self._delete_expr(f"id in {part}")
                total += n
        return total

    # --- reading ---------------------------------------------------------------------------

    def _count(self, expr: str = "") -> int:
        res = self.collection.query(
            expr, output_fields=["count(*)"], consistency_level="Strong", timeout=self.timeout
        )
        return int(res[0]["count(*)"]) if res else 0

    @mapped
    def count(self) -> int:
        """Live entries (deleted ones excluded), as of now (strong consistency)."""
        return self._count()

    @mapped
    def documents(self) -> npt.NDArray[np.int64]:
        """The distinct document ids that hold entries (reads the doc_id column)."""
        out: set[int] = set()
        it = self.collection.query_iterator(
            batch_size=16384, expr="", output_fields=["doc_id"], consistency_level="Strong"
        )
        try:
            while True:
                page = it.next()
                if not page:
                    break
                out.update(int(r["doc_id"]) for r in page)
        finally:
            it.close()
        return np.array(sorted(out), dtype=np.int64)

    def entries(
        self, batch_size: int = 2048
    ) -> Iterator[
        tuple[
            npt.NDArray[np.float32],
            npt.NDArray[np.int32],
            npt.NDArray[np.int64],
            npt.NDArray[np.int32],
            npt.NDArray[np.int32],
        ]
    ]:
        """Every entry, a page at a time: (keys float32 (n, dim), values, documents,
        positions, days), as stored (a backup reads them; ``upsert`` writes them back).

        2048 rows a page: 4.7 MB of keys at d=576, well inside a gRPC message."""
        it = self.collection.query_iterator(
            batch_size=batch_size,
            expr="",
            output_fields=["value", "doc_id", "position", "day", "key"],
            consistency_level="Strong",
            timeout=self.timeout,
        )
        try:
            while page := it.next():
                yield (
                    np.array([r["key"] for r in page], np.float32).reshape(-1, self.dim),
                    np.array([r["value"] for r in page], np.int32),
                    np.array([r["doc_id"] for r in page], np.int64),
                    np.array([r["position"] for r in page], np.int32),
                    np.array([r["day"] for r in page], np.int32),
                )
        finally:
            it.close()

    @mapped
    def refresh(self) -> int:
        """Follow an index another process re-created (a build); the query nodes follow
        inserts by themselves (growing segments), so nothing else is read. Returns 0."""
        served = self._index_params()
        if milvus_index(served) != milvus_index(self.params):
            self.params = served
        return 0

    @mapped
    def search(self, queries: npt.ArrayLike, k: int, *, depth: int | None = None) -> Neighbours:
        """``depth`` (this call's re-rank depth): re-rank that many IVF_PQ candidates from
        their stored keys even where the URL leaves re-ranking off; None: the URL's choice,
        ``rerank_factor * k`` candidates when ``rerank=1``."""
        q = np.ascontiguousarray(queries, dtype=np.float32)
        if q.ndim != 2 or q.shape[1] != self.dim:
            raise ValueError(f"queries: expected shape (nq, {self.dim}), got {q.shape}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if depth is not None and depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        nq = len(q)
        out = empty_neighbours(nq, k)
        if nq == 0:
            return out
        p = self.params
        rerank = (self.url.rerank or depth is not None) and p.kind == "ivfpq"
        wanted = (k * p.rerank_factor if depth is None else max(k, depth)) if rerank else k
        fetch = min(MAX_TOPK, wanted)
        param = {"metric_type": "L2", "params": {"nprobe": p.nprobe} if p.kind == "ivfpq" else {}}
        fields = ["value", "key"] if rerank else ["value"]
        for a in range(0, nq, SEARCH_BATCH):
            res = self.collection.search(
                q[a : a + SEARCH_BATCH],
                "key",
                param,
                limit=fetch,
                output_fields=fields,
                consistency_level=self.url.consistency,
                timeout=self.timeout,
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
                    diff = keys - q[a + r]
                    dist = np.einsum("ij,ij->i", diff, diff).astype(np.float32)
                    order = np.argsort(dist, kind="stable")[:k]
                    ids, dist, vals = ids[order], dist[order], vals[order]
                w = min(k, len(ids))
                out.distances[a + r, :w] = dist[:w]
                out.ids[a + r, :w] = ids[:w]
                out.values[a + r, :w] = vals[:w]
        return out

    @mapped
    def scan(self, cursor: int, limit: int) -> Scanned:
        """Live entries with ids >= ``cursor``, in id order (a query with a limit returns
        the smallest primary keys, as pymilvus's query iterator relies on)."""
        rows = self.collection.query(
            f"id >= {max(0, int(cursor))}",
            limit=int(limit),
            output_fields=["id", "value", "key"],
            consistency_level="Strong",
            timeout=self.timeout,
        )
        rows = sorted(rows, key=lambda r: int(r["id"]))
        ids = np.array([int(r["id"]) for r in rows], np.int64)
        keys = np.array([r["key"] for r in rows], np.float32).reshape(-1, self.dim)
        values = np.array([r["value"] for r in rows], np.int32)
        nxt = int(ids[-1]) + 1 if len(ids) == limit and len(ids) else 0
        return Scanned(ids, keys, values, nxt)

    def successors(self, queries: npt.ArrayLike, ids: npt.ArrayLike) -> Neighbours:
        """Entry ``doc_id * 2**24 + position + 1`` where the document stored it: one query
        for all rows, exact distances from the stored float32 keys."""
        q = np.ascontiguousarray(queries, dtype=np.float32)
        prev = np.asarray(ids, np.int64)
        if q.ndim != 2 or q.shape[1] != self.dim or prev.shape[:1] != q.shape[:1]:
            raise ValueError(f"queries {q.shape} and ids {prev.shape} do not match")
        out = empty_neighbours(*prev.shape)
        last = MAX_POSITION - 1  # id + 1 of a document's last position is another document
        want = np.unique(prev[(prev >= 0) & ((prev & last) < last)] + 1)
        if not len(want):
            return out
        rows = self.collection.query(
            f"id in {want.tolist()}",
            output_fields=["value", "key"],
            consistency_level=self.url.consistency,
            timeout=self.timeout,
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

    @mapped
    def provenance(self, ids: npt.ArrayLike) -> Provenance:
        want = np.asarray(ids, np.int64).reshape(-1)
        docs = np.full(len(want), -1, np.int64)
        pos = np.full(len(want), -1, np.int64)
        days = np.full(len(want), -1, np.int32)
        if not len(want):
            return Provenance(docs, pos, days)
        rows = self.collection.query(
            f"id in {np.unique(want).tolist()}",
            output_fields=["doc_id", "position", "day"],
            consistency_level=self.url.consistency,
            timeout=self.timeout,
        )
        found = {int(r["id"]): r for r in rows}
        for i, e in enumerate(want.tolist()):
            r = found.get(e)
            if r is not None:
                docs[i], pos[i], days[i] = r["doc_id"], r["position"], r["day"]
        return Provenance(docs, pos, days)

    # --- maintenance -----------------------------------------------------------------------

    @mapped
    def flush(self) -> float:
        """Seal the growing segments (they get indexed); returns the seconds it took."""
        t0 = time.perf_counter()
        self.collection.flush(timeout=self.timeout)
        return time.perf_counter() - t0

    @mapped
    def build_index(
        self, params: IndexParams | None = None, *, retrain: bool = False
    ) -> dict[str, Any]:
        """Flush, compact deleted rows away, and re-create the index when the size calls
        for other parameters, or (``retrain``) to train IVF_PQ again on what it holds now
        (the collection is released meanwhile: searches fail until it is loaded again,
        ``unavailable_seconds``)."""
        # Long server-side steps wait at least 10 minutes. An int: pymilvus stops waiting
        # for an index build only at an int timeout (a float one waits forever).
        long_wait = math.ceil(max(self.timeout, 600))
        with self._lock:
            t0 = time.perf_counter()
            flush_s = self.flush()
            t1 = time.perf_counter()
            try:
                self.collection.compact(timeout=self.timeout)
                self.collection.wait_for_compaction_completed(timeout=long_wait)
            except MilvusException as exc:
                # Milvus 2.3 may refuse a compaction right after a flush ("segment in flushed
                # state not found"). Compaction only merges segments and drops deleted rows,
                # which searches filter anyway: the build goes on, the next one compacts.
                log.warning("Milvus compaction skipped: %s", exc)
            compact_s = time.perf_counter() - t1
            n = self.count()
            want = params or self.params_for(n)
            recreated, unavailable = False, 0.0
            other = milvus_index(want) != milvus_index(self.params)
            if other or (retrain and want.kind == "ivfpq"):
                t1 = time.perf_counter()
                self.collection.release(timeout=self.timeout)
                try:
                    self.collection.drop_index(timeout=self.timeout)
                    # a build past long_wait raises: it never hangs
                    self.collection.create_index("key", milvus_index(want), timeout=long_wait)
                finally:
                    # searchable again even when the build failed or timed out (Milvus
                    # searches segments whose index is not built yet by brute force)
                    self.collection.load(timeout=long_wait)
                unavailable = time.perf_counter() - t1
                recreated = True
            t2 = time.perf_counter()
            utility.wait_for_index_building_complete(
                self.url.collection, using=self.alias, timeout=long_wait
            )
            index_s = time.perf_counter() - t2
            self.params = want  # the index Milvus holds now, and its nprobe
            return {
                "backend": self.name,
                "entries": n,
                "params": self.params.to_json(),
                "index_recreated": recreated,
                "unavailable_seconds": round(unavailable, 3),
                "flush_seconds": round(flush_s, 3),
                "compact_seconds": round(compact_s, 3),
                "index_wait_seconds": round(index_s, 3),
                "seconds": round(time.perf_counter() - t0, 3),
            }

    @mapped
    def stats(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "entries": self.count(),
            "url": str(self.url),
            "server_version": self.server_version,
            "consistency": self.url.consistency,
            "rerank": self.url.rerank,
            "index": {"kind": self.params.kind, **milvus_index(self.params)["params"]}
            | ({"nprobe": self.params.nprobe} if self.params.kind == "ivfpq" else {}),
        }

    def drop(self) -> None:
        """Delete the whole collection (tests, ``migrate-memory --replace``)."""
        self.collection.drop(timeout=self.timeout)

    def close(self) -> None:
        connections.disconnect(self.alias)
