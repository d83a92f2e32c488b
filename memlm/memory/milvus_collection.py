"""One Milvus collection as a kNN-LM memory's store, through ``pymilvus``.

Collection ``<name>``: ``id`` (INT64 primary key), ``value`` (next token), ``doc_id``,
``position``, ``day`` and ``key`` (FLOAT_VECTOR: Milvus 2.3 has no float16 vectors).

- Entry ids are deterministic, ``doc_id * 2**24 + position``, and a document's entries are
  written in one ``append`` that first deletes whatever the document held, then upserts:
  writing a document again (a worker killed between its insert and its database commit,
  then the retry) replaces its entries instead of adding a second copy.
- New entries are searchable through Milvus's growing segments (scanned exactly) as soon
  as the query node consumed them (~0.2 s, one time tick); ``build_index`` flushes, so they
  are sealed and indexed, and compacts away deleted rows. Between builds a handle seals
  every ``url.seal`` rows it wrote (``_sealed``), so that the rows searched without the
  collection's index stay bounded (docs/memory.md, "Milvus between builds").
- The collection is a generation behind an alias named as the URL's collection
  (:mod:`memlm.memory.milvus_generations`): a build that needs another index fills the
  next generation beside the served one, loads it, switches the alias and drops the old
  one, so searches never meet a released collection. Writes reach every generation.
- Sealed segments are indexed separately by Milvus: FLAT below ``FLAT_THRESHOLD`` live
  entries, else the index the URL's ``index`` option names (``auto``: the measured
  default, :mod:`memlm.memory.milvus_index`), IVF lists sized to one segment's rows.
- HNSW and IVF_FLAT search the stored float32 keys: their distances are exact. The exact
  re-rank of the faiss memory is skipped by default (``rerank=False``) for the compressed
  kinds too (IVF_SQ8, IVF_PQ: approximate distances); ``rerank=True`` fetches
  ``rerank_factor * k`` candidates with their stored keys and orders them exactly
  (recall and cost of both: benchmarks/bench_memory_backends.py).
- How one physical collection is searched and read lives in
  :mod:`memlm.memory.milvus_reads`; this class picks which collection to ask.

:class:`memlm.memory.milvus_builds.MilvusIndexed` adds the builds (in place, or the
blue-green switch); :class:`memlm.memory.milvus_backend.MilvusMemory` adds what the
engine asks of a memory (the version records of its builds, rollback, forgetting).
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
import numpy as np
import numpy.typing as npt

from memlm.index import IndexParams
from memlm.memory.base import Neighbours, Provenance, Scanned, empty_neighbours
from memlm.memory.milvus_client import (
    FIELDS,
    Collection,
    MilvusException,
    MilvusMemoryError,
    connections,
    entry_ids,
    mapped,
    new_schema,
    served_params,
    server_away,
    utility,
)
from memlm.memory.milvus_deletes import DeleteJournal, LostDeleteLog
from memlm.memory.milvus_generations import (
    generation_name,
    generations,
    gone,
    resolve,
    switch,
)
from memlm.memory.milvus_index import milvus_index, params_for, search_param, searched
from memlm.memory.milvus_reads import (
    MAX_TOPK,
    Page,
    count_in,
    days_in,
    documents_in,
    pages,
    provenance_in,
    scan_in,
    search_batch,
    search_in,
    successors_in,
)
from memlm.memory.url import MilvusURL
from memlm.unavailable import MemoryUnavailable

log = logging.getLogger(__name__)

# Rows per insert call: ~19 MB of float32 keys at d=576, under gRPC's 64 MB message limit.
INSERT_BATCH = 8192
# Rows of a sealed segment: Milvus's default segment.maxSize (512 MB) of raw float32 keys.
SEGMENT_BYTES = 512 * 1024 * 1024
_aliases = itertools.count()
_T = TypeVar("_T")


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
        self._unsealed = 0  # rows this handle wrote since it last sealed (``_sealed``)
        # lasting deletes since the last build (a data directory's file: MilvusMemory)
        self.deletes = DeleteJournal(None)
        self.lost_deletes = LostDeleteLog()  # one warning a minute, not one a search
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

    def _searched(self) -> IndexParams:
        """The served index with the URL's search parameters (``ef``, ``nprobe``)."""
        return searched(self.params, self.url.ef, self.url.nprobe)

    def params_for(self, n: int) -> IndexParams:
        """FLAT below the faiss memory's threshold, else the URL's index (``auto``: the
        measured default), its IVF lists sized to one segment."""
        return params_for(n, self.dim, self.segment_rows(), self.url.index)

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
        self._sealed(len(ids))
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
        self._sealed(len(ids))
        return ids

    def _sealed(self, wrote: int) -> None:
        """Seal the growing segments once this handle wrote ``url.seal`` rows since it last
        did. Milvus searches a growing segment without the collection's index (exactly,
        or through its interim IVF_FLAT) and seals one by itself only at 0.23 x 512 MB
        (~51k rows at d=576), after 10 idle minutes or after 24 h, so between builds the
        searches paid for the new rows (docs/memory.md, "Milvus between builds"). A
        sealed segment gets the collection's index; its rows stay searchable throughout.
        The flush costs an index build per sealed segment on the server."""
        self._unsealed += wrote
        if not self.url.seal or self._unsealed < self.url.seal:
            return
        self._unsealed = 0
        self._write(lambda coll: coll.flush(timeout=self.timeout))

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
    def delete_entries(self, doc_id: int, *, lasting: bool = False) -> int:
        """Delete a document's entries; returns how many it held (0 when none).
        ``lasting`` (a forget): written to the delete journal first, so that the next
        build deletes again what a server may lose (``memlm.memory.milvus_deletes``)."""
        doc_id = int(doc_id)
        if lasting:
            self.deletes.record("doc_id", [doc_id])
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
        ids = np.unique(np.asarray(ids, np.int64).reshape(-1))
        self.deletes.record("id", ids.tolist())  # final: kept to delete again (see above)
        return self._delete_in("id", ids)

    def _delete_in(self, field: str, values: npt.ArrayLike) -> int:
        """Delete the entries whose ``field`` is one of ``values``, 1,000 values a call;
        returns how many were live."""
        return sum(n for _, n in self._delete_groups(field, values))

    def _delete_groups(self, field: str, values: npt.ArrayLike) -> Iterator[tuple[list[int], int]]:
        """``_delete_in``, a group of (at most) 1,000 values at a time: each group and how
        many live entries it deleted."""
        values = np.asarray(values, np.int64)
        for a in range(0, len(values), 1000):
            part = values[a : a + 1000].tolist()
            n = self._count(f"{field} in {part}")
            if n:
                self._delete_expr(f"{field} in {part}")
            yield part, n

    # --- reading ---------------------------------------------------------------------------

    def _count(self, expr: str = "") -> int:
        return self._read(lambda coll: count_in(coll, expr, self.timeout))

    @mapped
    def count(self) -> int:
        """Live entries (deleted ones excluded), as of now (strong consistency)."""
        return self._count()

    @mapped
    def documents(self) -> npt.NDArray[np.int64]:
        """The distinct document ids that hold entries (reads the doc_id column)."""
        return np.array(sorted(self._read(documents_in)), dtype=np.int64)

    def entries(self, batch_size: int = 2048) -> Iterator[Page]:
        """Every entry, a page at a time: (keys float32 (n, dim), values, documents,
        positions, days), as stored (a backup reads them; ``upsert`` writes them back).

        2048 rows a page: 4.7 MB of keys at d=576, well inside a gRPC message."""
        yield from self._pages(self.collection, batch_size)

    def _pages(self, coll: Collection, batch_size: int = 2048) -> Iterator[Page]:
        """``coll``'s rows a page at a time, without those the delete journal names (a
        backup, a migration and a re-created generation's copy never carry a delete the
        server lost)."""
        for page in pages(coll, self.dim, batch_size, self.timeout):
            kept = self.deletes.without(page)
            if kept is not None:
                yield kept

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
        """``depth`` (this call's re-rank depth): re-rank that many IVF_SQ8 / IVF_PQ
        candidates from their stored keys even where the URL leaves re-ranking off; None:
        the URL's choice, ``rerank_factor * k`` candidates when ``rerank=1``. (IVF_FLAT,
        HNSW and FLAT return exact distances: nothing to re-rank.)"""
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
        p = self._searched()
        # only compressed codes' distances are approximate: IVF_FLAT and HNSW search the
        # float32 keys themselves, so a re-rank would reorder nothing
        rerank = bool((self.url.rerank or depth is not None) and not p.exact_distances)
        wanted = (k * p.rerank_factor if depth is None else max(k, depth)) if rerank else k
        fetch = min(MAX_TOPK, wanted)
        param = search_param(p, fetch)
        batch = search_batch(fetch, self.dim if rerank else 0)
        for a in range(0, nq, batch):
            part = self._read(
                lambda coll: search_in(
                    coll,
                    q[a : a + batch],  # noqa: B023 - called at once, in this iteration
                    k,
                    fetch=fetch,
                    param=param,
                    rerank=rerank,
                    consistency=self.url.consistency,
                    timeout=self.timeout,
                )
            )
            b = a + len(part.ids)
            out.distances[a:b], out.ids[a:b], out.values[a:b] = (
                part.distances,
                part.ids,
                part.values,
            )
        return self._hide_deleted(out)

    def _hide_deleted(self, found: Neighbours) -> Neighbours:
        """``found`` without the entries that the delete journal names (forgotten or
        retired, not yet settled by a build): none where the server applied the deletes;
        where it lost one, the row's others move up and it ends padded (inf, -1, -1)."""
        kept, hidden = self.deletes.hide(found)
        self.lost_deletes.note(self.collection.name, hidden)
        return kept

    @mapped
    def scan(self, cursor: int, limit: int) -> Scanned:
        """Live entries with ids >= ``cursor``, in id order."""
        return self._read(lambda coll: scan_in(coll, cursor, limit, self.dim, self.timeout))

    def successors(self, queries: npt.ArrayLike, ids: npt.ArrayLike) -> Neighbours:
        """Entry ``doc_id * 2**24 + position + 1`` where the document stored it: one query
        for all rows, exact distances from the stored float32 keys."""
        q = np.ascontiguousarray(queries, dtype=np.float32)
        prev = np.asarray(ids, np.int64)
        if q.ndim != 2 or q.shape[1] != self.dim or prev.shape[:1] != q.shape[:1]:
            raise ValueError(f"queries {q.shape} and ids {prev.shape} do not match")
        return self._hide_deleted(
            successors_in(self.collection, q, prev, self.url.consistency, self.timeout)
        )

    @mapped
    def live_days(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]]:
        return self._read(lambda coll: days_in(coll, self.timeout))

    @mapped
    def provenance(self, ids: npt.ArrayLike) -> Provenance:
        want = np.asarray(ids, np.int64).reshape(-1)
        if not len(want):
            return provenance_in(self.collection, want, self.url.consistency, self.timeout)
        return self._read(
            lambda coll: provenance_in(coll, want, self.url.consistency, self.timeout)
        )

    @mapped
    def stats(self) -> dict[str, Any]:
        built = milvus_index(self.params)
        return {
            "backend": self.name,
            "entries": self.count(),
            "url": str(self.url),
            "server_version": self.server_version,
            "consistency": self.url.consistency,
            "rerank": self.url.rerank,
            "collection": self.collection.name,
            "index": {
                "kind": self.params.kind,
                "type": built["index_type"],
                "choice": self.url.index,
                **built["params"],
                **search_param(self._searched(), 0)["params"],
            },
        }

    def close(self) -> None:
        connections.disconnect(self.alias)
