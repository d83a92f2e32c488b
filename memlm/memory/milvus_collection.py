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
- The collection is a generation behind an alias named as the URL's collection
  (:mod:`memlm.memory.milvus_generations`): a build that needs another index fills the
  next generation beside the served one, loads it, switches the alias and drops the old
  one, so searches never meet a released collection. Writes reach every generation.
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
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
import numpy as np
import numpy.typing as npt

from memlm.datastore import SimulatedCrash
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
    server_away,
    utility,
)
from memlm.memory.milvus_generations import (
    drop_extra,
    generation_name,
    generation_of,
    generations,
    gone,
    resolve,
    switch,
)
from memlm.memory.url import MilvusURL
from memlm.unavailable import MemoryUnavailable

log = logging.getLogger(__name__)

# Rows per insert call: ~19 MB of float32 keys at d=576, under gRPC's 64 MB message limit.
INSERT_BATCH = 8192
# Query vectors per search call (Milvus accepts up to 16,384; results must fit a message).
SEARCH_BATCH = 1024
MAX_TOPK = 16384  # Milvus's limit on k
# Rows of a sealed segment: Milvus's default segment.maxSize (512 MB) of raw float32 keys.
SEGMENT_BYTES = 512 * 1024 * 1024
_aliases = itertools.count()
# Where a build that re-creates the index may stop (tests kill it at each): the new
# generation filled, indexed and loaded but not named; the alias switched, the old
# generation not dropped yet.
SWAP_CRASH_POINTS = ("after_copy", "after_switch")
_T = TypeVar("_T")
# Seconds the old generation stays after the switch before it is dropped: searches of
# this process already under way on it end there (a search that meets the drop fails
# after ~0.8 s, "delegator closed", and is retried on the new one).
DROP_GRACE_S = 1.0


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
        self.base = url.collection
        self._handles: dict[str, Collection] = {}
        served = resolve(self.base, self.alias, self.timeout)
        if served is None:
            if dim is None:
                raise MilvusMemoryError(f"collection {url.collection!r} does not exist")
            self._dim = int(dim)
            served = self._create(generation_name(self.base, 1), IndexParams.exact())
            try:
                switch(self.base, served, self.alias, self.timeout)
            except MilvusException:  # another process named its own first: serve that
                served = resolve(self.base, self.alias, self.timeout) or served
        self._serve(served)
        self._dim = self._check_schema(dim)
        self.collection.load(timeout=self.timeout)

    @property
    def dim(self) -> int:
        return self._dim

    # --- schema --------------------------------------------------------------------------

    def _create(self, name: str, params: IndexParams, timeout: int | None = None) -> str:
        coll = Collection(name, new_schema(self.dim), using=self.alias, timeout=self.timeout)
        self._handles[name] = coll
        coll.create_index("key", milvus_index(params), timeout=timeout or self.timeout)
        log.info("created Milvus collection %s (dim %d) for %s", name, self.dim, self.url)
        return name

    def _handle(self, name: str) -> Collection:
        coll = self._handles.get(name)
        if coll is None:
            coll = self._handles[name] = Collection(name, using=self.alias)
        return coll

    def _serve(self, name: str) -> None:
        """Search ``name`` from now on (a physical collection, never the alias)."""
        coll = self._handle(name)
        self.params = served_params(coll, self.timeout)
        self.collection = coll

    def _follow(self) -> bool:
        """Serve the collection the alias names now; returns whether it changed."""
        name = resolve(self.base, self.alias, self.timeout)
        if name is None:
            raise MemoryUnavailable(f"the Milvus memory {self.url} has no collection")
        if name == self.collection.name:
            return False
        self._serve(name)
        return True

    def _read(self, fn: Callable[[Collection], _T]) -> _T:
        """``fn`` on the served collection. Where it fails and the alias names another
        collection now (a switch: the old one was dropped, or closed its channels under a
        search in flight, "delegator closed"), or the collection is gone or not loaded,
        the alias is resolved again and ``fn`` tried once more; a collection still not
        there makes the memory unavailable (503 in the API, a paused retry in the
        worker)."""
        used = self.collection
        try:
            return fn(used)
        except MilvusException as exc:
            if server_away(exc):  # no other collection to ask: 503 (``mapped``) at once
                raise
            self._follow()
            if self.collection.name == used.name and not gone(exc):
                raise
        try:
            return fn(self.collection)
        except MilvusException as exc:
            if not gone(exc):
                raise
            raise MemoryUnavailable(
                f"the Milvus collection {self.collection.name} of {self.url} is not loaded"
            ) from exc

    def _write(self, fn: Callable[[Collection], _T]) -> _T:
        """``fn`` on every generation, oldest first, then on those that appeared meanwhile
        (a build creates its generation before it copies: a write either lands before the
        copy reads, or meets the new generation here). Returns the served one's result."""
        done: set[str] = set()
        result: _T | None = None
        wrote = False
        while True:
            names = generations(self.base, self.alias, self.timeout)
            todo = [n for n in names if n not in done]
            if not todo:
                break
            for name in todo:
                try:
                    out = fn(self._handle(name))
                except MilvusException as exc:
                    # dropped by a switch meanwhile: what it held lives in the newer one
                    if gone(exc) and name not in generations(self.base, self.alias, self.timeout):
                        self._handles.pop(name, None)
                        done.add(name)
                        continue
                    raise
                done.add(name)
                if not wrote or name == self.collection.name:
                    result, wrote = out, True
        if not wrote:
            raise MemoryUnavailable(f"the Milvus memory {self.url} has no collection")
        return result  # type: ignore[return-value]

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
        ids = self._check(keys, values, docs, positions, days)
        uniq = np.unique(docs).tolist()

        def put(coll: Collection) -> None:
            if uniq:
                coll.delete(f"doc_id in {uniq}", timeout=self.timeout)
            self._upsert_into(coll, ids, keys, values, docs, positions, days)

        self._write(put)
        return ids

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
        self._write(
            lambda coll: self._upsert_into(coll, ids, keys, values, documents, positions, days)
        )
        return ids

    def _upsert_into(
        self,
        coll: Collection,
        ids: npt.NDArray[np.int64],
        keys: npt.ArrayLike,
        values: npt.ArrayLike,
        documents: npt.ArrayLike,
        positions: npt.ArrayLike,
        days: npt.ArrayLike,
    ) -> None:
        k = np.ascontiguousarray(keys, dtype=np.float32)
        cols = [np.asarray(c, np.int64) for c in (values, documents, positions, days)]
        for a in range(0, len(k), INSERT_BATCH):
            b = min(len(k), a + INSERT_BATCH)
            coll.upsert(
                [ids[a:b].tolist(), *(c[a:b].tolist() for c in cols), k[a:b]],
                timeout=self.timeout,
            )

    def _delete_expr(self, expr: str) -> int:
        """Delete on every generation; the count is the served one's."""
        return self._write(lambda coll: int(coll.delete(expr, timeout=self.timeout).delete_count))

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
        return self._delete_in("doc_id", drop)

    @mapped
    def retire(self, ids: npt.ArrayLike, *, crash_at: str | None = None) -> int:
        """Delete single entries by id (one call: nothing to crash between, so
        ``crash_at`` has no points here); returns how many were live."""
        return self._delete_in("id", np.unique(np.asarray(ids, np.int64).reshape(-1)))

    def _delete_in(self, field: str, values: npt.NDArray[np.int64]) -> int:
        """Delete the entries whose ``field`` is one of ``values``, 1,000 values a call;
        returns how many were live."""
        total = 0
        for a in range(0, len(values), 1000):
            part = values[a : a + 1000].tolist()
            n = self._count(f"{field} in {part}")
            if n:
                self._delete_expr(f"{field} in {part}")
                total += n
        return total

    # --- reading ---------------------------------------------------------------------------

    def _count(self, expr: str = "") -> int:
        res = self._read(
            lambda coll: coll.query(
                expr, output_fields=["count(*)"], consistency_level="Strong", timeout=self.timeout
            )
        )
        return int(res[0]["count(*)"]) if res else 0

    @mapped
    def count(self) -> int:
        """Live entries (deleted ones excluded), as of now (strong consistency)."""
        return self._count()

    @mapped
    def documents(self) -> npt.NDArray[np.int64]:
        """The distinct document ids that hold entries (reads the doc_id column)."""

        def read(coll: Collection) -> set[int]:
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

        return np.array(sorted(self._read(read)), dtype=np.int64)

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
        yield from self._pages(self.collection, batch_size)

    def _pages(
        self, coll: Collection, batch_size: int = 2048
    ) -> Iterator[
        tuple[
            npt.NDArray[np.float32],
            npt.NDArray[np.int32],
            npt.NDArray[np.int64],
            npt.NDArray[np.int32],
            npt.NDArray[np.int32],
        ]
    ]:
        it = coll.query_iterator(
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

    def unavailable(self) -> str | None:
        """Why no search can run now: the server away, no collection, or the served one
        not loaded (a restarted server loads it again; an operator released it)."""
        try:
            self._follow()
            state = utility.load_state(self.collection.name, using=self.alias, timeout=self.timeout)
        except MemoryUnavailable as exc:
            return str(exc)
        except MilvusException as exc:
            return f"the Milvus memory {self.url} cannot be read: {exc}"
        except grpc.RpcError as exc:  # the server away (``mapped`` covers the others)
            return f"the Milvus server of {self.url} is unavailable: {exc.code()}"
        if state.name != "Loaded":
            return f"the Milvus collection {self.collection.name} of {self.url} is {state.name}"
        return None

    @mapped
    def refresh(self) -> int:
        """Follow a switch another process made (a build: the alias names a new
        generation) and the index it holds; the query nodes follow inserts by themselves
        (growing segments), so nothing else is read. Returns 0."""
        if not self._follow():
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
            res = self._read(
                lambda coll: coll.search(
                    q[a : a + SEARCH_BATCH],  # noqa: B023 - called at once, in this iteration
                    "key",
                    param,
                    limit=fetch,
                    output_fields=fields,
                    consistency_level=self.url.consistency,
                    timeout=self.timeout,
                )
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
        rows = self._read(
            lambda coll: coll.query(
                f"id >= {max(0, int(cursor))}",
                limit=int(limit),
                output_fields=["id", "value", "key"],
                consistency_level="Strong",
                timeout=self.timeout,
            )
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
        rows = self._read(
            lambda coll: coll.query(
                f"id in {np.unique(want).tolist()}",
                output_fields=["doc_id", "position", "day"],
                consistency_level=self.url.consistency,
                timeout=self.timeout,
            )
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
        self,
        params: IndexParams | None = None,
        *,
        retrain: bool = False,
        crash_at: str | None = None,
    ) -> dict[str, Any]:
        """Index what the memory holds: in place (flush, so new rows are sealed and
        indexed, and compact deleted rows away) while the index stays the same; when the
        size calls for other parameters, or ``retrain`` asks to train IVF_PQ again, in the
        next generation beside the served one (``_rebuild_beside``), which is served
        throughout. ``crash_at``: one of ``SWAP_CRASH_POINTS`` (tests)."""
        if crash_at is not None and crash_at not in SWAP_CRASH_POINTS:
            raise ValueError(f"crash_at must be one of {SWAP_CRASH_POINTS}, got {crash_at!r}")
        # Long server-side steps wait at least 10 minutes. An int: pymilvus stops waiting
        # for an index build only at an int timeout (a float one waits forever).
        long_wait = math.ceil(max(self.timeout, 600))
        with self._lock:
            t0 = time.perf_counter()
            self._follow()  # what the alias names now (another process may have switched)
            n = self.count()
            want = params or self.params_for(n)
            other = milvus_index(want) != milvus_index(self.params)
            recreated = other or (retrain and want.kind == "ivfpq")
            steps: dict[str, Any] = {}
            if recreated:
                # the new generation is compacted by construction: only live rows are
                # copied. Its index may take an hour: nothing is unavailable meanwhile,
                # a slow (or shared) index node only delays the switch.
                steps = self._rebuild_beside(want, max(long_wait, 3600), crash_at)
                n = self.count()
            else:
                steps["flush_seconds"] = round(self.flush(), 3)
                t1 = time.perf_counter()
                try:
                    self.collection.compact(timeout=self.timeout)
                    self.collection.wait_for_compaction_completed(timeout=long_wait)
                except MilvusException as exc:
                    # Milvus 2.3 may refuse a compaction right after a flush ("segment in
                    # flushed state not found"). Compaction only merges segments and drops
                    # deleted rows, which searches filter anyway: the build goes on, the
                    # next one compacts.
                    log.warning("Milvus compaction skipped: %s", exc)
                steps["compact_seconds"] = round(time.perf_counter() - t1, 3)
            t2 = time.perf_counter()
            if not recreated:  # (a new generation is indexed before its switch; a
                # compaction of its upserts may index a merged segment again afterwards,
                # searched meanwhile by brute force: nothing to wait for)
                utility.wait_for_index_building_complete(
                    self.collection.name, using=self.alias, timeout=long_wait
                )
            self.params = want  # the index Milvus holds now, and its nprobe
            return {
                "backend": self.name,
                "entries": n,
                "params": self.params.to_json(),
                "index_recreated": recreated,
                "collection": self.collection.name,
                # searches never wait for a build: the served collection stays loaded
                "unavailable_seconds": 0.0,
                **steps,
                "index_wait_seconds": round(time.perf_counter() - t2, 3),
                "seconds": round(time.perf_counter() - t0, 3),
            }

    def _rebuild_beside(
        self, want: IndexParams, long_wait: int, crash_at: str | None
    ) -> dict[str, Any]:
        """The blue-green switch: the next generation created with ``want``'s index and
        loaded, every live entry copied into it (writes reach it from its creation on:
        ``_write``), the rows that a forget took from the served one during the copy
        deleted, its index built and loaded; then the alias names it (one call), this
        process serves it and the old generation is dropped. Until the switch the old one
        serves every search; a failure before it drops the new one, a kill leaves it to
        the next start's ``cleanup``."""
        old = self.collection
        last = max(
            generation_of(self.base, n) or 0
            for n in generations(self.base, self.alias, self.timeout)
        )
        name = generation_name(self.base, last + 1)
        t0 = time.perf_counter()
        try:
            new = self._handle(self._create(name, want, long_wait))
            new.load(timeout=long_wait)
            copied = 0
            for keys, values, docs, pos, days in self._pages(old):
                self._upsert_into(new, entry_ids(docs, pos), keys, values, docs, pos, days)
                copied += len(values)
            copy_s = time.perf_counter() - t0
            new.flush(timeout=long_wait)
            # rows a forget deleted while the copy was running
            removed = drop_extra(new, old, long_wait)
            utility.wait_for_index_building_complete(name, using=self.alias, timeout=long_wait)
            utility.wait_for_loading_complete(name, using=self.alias, timeout=long_wait)
        except SimulatedCrash:
            raise
        except BaseException:
            self._drop_quietly(name)
            raise
        index_s = time.perf_counter() - t0 - copy_s
        if crash_at == "after_copy":
            raise SimulatedCrash(crash_at)
        t1 = time.perf_counter()
        switch(self.base, name, self.alias, self.timeout)
        switch_s = time.perf_counter() - t1
        if crash_at == "after_switch":
            raise SimulatedCrash(crash_at)
        self._serve(name)
        time.sleep(DROP_GRACE_S)
        # searches of other processes still on the old one resolve the alias again when
        # it is gone (``_read``); if the drop fails, the next start's cleanup drops it
        self._drop_quietly(old.name)
        log.info(
            "Milvus generation %s serves %s: %d entries copied in %.1f s, %d forgotten meanwhile",
            name,
            self.url,
            copied,
            copy_s,
            removed,
        )
        return {
            "previous_collection": old.name,
            "copied": copied,
            "removed_after_copy": removed,
            "copy_seconds": round(copy_s, 3),
            # flush, the forgotten rows deleted, the index built and loaded
            "index_seconds": round(index_s, 3),
            "switch_seconds": round(switch_s, 3),
        }

    def _drop_quietly(self, name: str) -> None:
        self._handles.pop(name, None)
        try:
            utility.drop_collection(name, timeout=self.timeout, using=self.alias)
        except Exception as exc:  # noqa: BLE001 - the next start's cleanup drops it
            log.warning("could not drop Milvus collection %s: %s", name, exc)

    @mapped
    def cleanup(self, keep: str | None = None) -> list[str]:
        """Serve ``keep`` (the collection a recorded version names) when it still exists
        and the alias names another (a build killed after its switch, before its record),
        and drop every other generation (builds killed before their switch, old ones a
        killed build did not drop). Run by the single builder, at its start."""
        names = generations(self.base, self.alias, self.timeout)
        self._follow()
        if keep is not None and keep in names and keep != self.collection.name:
            log.warning(
                "serving %s again: the build that switched away from it was not recorded", keep
            )
            switch(self.base, keep, self.alias, self.timeout)
            self._serve(keep)
        dropped = [n for n in names if n != self.collection.name]
        for n in dropped:
            log.warning("dropping Milvus collection %s, left by a build that did not finish", n)
            self._drop_quietly(n)
        return dropped

    @mapped
    def stats(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "entries": self.count(),
            "url": str(self.url),
            "server_version": self.server_version,
            "consistency": self.url.consistency,
            "rerank": self.url.rerank,
            "collection": self.collection.name,
            "index": {"kind": self.params.kind, **milvus_index(self.params)["params"]}
            | ({"nprobe": self.params.nprobe} if self.params.kind == "ivfpq" else {}),
        }

    def drop(self) -> None:
        """Delete the whole memory: the alias and every generation (tests,
        ``migrate-memory --replace``)."""
        names = generations(self.base, self.alias, self.timeout)
        if self.base not in names and utility.has_collection(
            self.base, using=self.alias, timeout=self.timeout
        ):
            utility.drop_alias(self.base, timeout=self.timeout, using=self.alias)
        for n in names:
            self._drop_quietly(n)

    def close(self) -> None:
        connections.disconnect(self.alias)
