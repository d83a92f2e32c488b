"""Serving: :class:`MemoryIndex`, the CURRENT built version plus an exact fresh part.

The fresh part is an exact index over the entries appended since the served version's
snapshot, so an entry is searchable as soon as ``refresh`` ran after its append. Both
parts are searched and merged; deleted documents (and those ``hide_documents`` names,
before their deletion is committed) and entries a compaction removed are filtered from
every search, so a forget needs no build; for IVF-PQ candidates are re-ranked with exact
distances from the float16 keys of the live ones only.

Index ids are global datastore entry ids. Distances are **squared** L2 (the FAISS
convention), ascending; missing results are padded with (inf, -1).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import numpy.typing as npt
import torch

from memlm.datastore import Datastore
from memlm.index.params import BuildInfo, IndexFormatError
from memlm.index.params import f16_to_f32 as _f16_to_f32
from memlm.index.versions import current_version, load_version

# Re-rank full candidate lists (every id live) with one broadcast subtraction in torch,
# not numpy's per-candidate query copy: search_values 1.12-1.34x faster (`python
# benchmarks/bench_index.py --search-paths`, which switches it off for its baseline rows).
RERANK_BROADCAST = True

# The broadcast re-rank converts its float16 candidates to float32 this many elements at a
# time (256 KB: the piece stays in the core's cache while it is subtracted, squared and
# summed); 0 converts a block in one piece, as before. Same distances to the bit; the
# evaluation's held-out search at 2.5M real entries 1.67x faster (k 1,024; 1.10x at k 64:
# `benchmarks/bench_search_depth.py --one-piece`), 1.22x / 1.11x on 300k synthetic keys
# (`benchmarks/bench_index.py --search-paths`, which switches it off for its baseline rows).
RERANK_CHUNK_ELEMENTS = 1 << 16

# Flat searches with at least this many queries in one call go through BLAS: below it
# the direct scan is faster, above it BLAS wins by up to ~7x (table in docs/memory.md,
# from ``benchmarks/bench_index.py --crossover``). The knob is process-wide.
BLAS_MIN_QUERIES = 8
_BLAS_DEFAULT: int | None = None


def _set_blas_threshold(dim: int) -> None:
    """Make flat searches of >= BLAS_MIN_QUERIES queries use BLAS.

    faiss 1.15 compares ``nq * d`` with ``distance_compute_blas_threshold`` (default
    128,000: only batches of >= 222 queries at d=576); older versions compared ``nq``
    (default 20). The default tells which one this faiss does.
    """
    global _BLAS_DEFAULT
    if _BLAS_DEFAULT is None:
        _BLAS_DEFAULT = int(faiss.cvar.distance_compute_blas_threshold)
    per_query = dim if _BLAS_DEFAULT > 1000 else 1
    faiss.cvar.distance_compute_blas_threshold = BLAS_MIN_QUERIES * per_query


class _RWLock:
    """Many readers or one writer; searches read, ``refresh`` writes the fresh index."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0  # new readers wait for them: a stream of searches
        # must not starve refresh()

    @contextmanager
    def read(self) -> Iterator[None]:
        with self._cond:
            while self._writer or self._waiting_writers:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextmanager
    def write(self) -> Iterator[None]:
        with self._cond:
            self._waiting_writers += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._waiting_writers -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


@dataclass
class _State:
    built: faiss.Index | None
    info: BuildInfo | None
    valid_upto: int  # built ids < valid_upto are trusted; the fresh part starts here
    fresh: faiss.Index  # IndexIDMap(IndexFlatL2) over [valid_upto, fresh_upto)
    fresh_upto: int
    generation: int  # datastore generation that fresh_upto was read at


class MemoryIndex:
    """The served memory: the CURRENT built version plus an exact fresh index.

    ``search`` may run from many threads; ``refresh`` and ``reload`` from one writer.
    """

    def __init__(self, datastore: Datastore, root: Path) -> None:
        self.datastore = datastore
        self.root = Path(root)
        _set_blas_threshold(datastore.dim)
        self._writer = threading.Lock()  # serialises refresh/reload
        self._fresh_lock = _RWLock()  # searches vs in-place adds to the fresh index
        # documents hidden before the datastore's tombstone exists (a forget requested and
        # not yet applied by the writer); replaced, never mutated, so searches read it as is
        self._hidden = np.empty(0, dtype=np.int64)
        self._state = self._load(current_version(self.root))

    def hide_documents(self, doc_ids: npt.ArrayLike) -> int:
        """Hide these documents' entries from every search from now on; returns how many
        documents are hidden this way. Ones the datastore already deletes leave the set:
        its tombstone hides them (and survives restarts, which this set does not)."""
        with self._writer:
            ids = np.union1d(self._hidden, np.asarray(doc_ids, dtype=np.int64).reshape(-1))
            deleted = np.fromiter(self.datastore.deleted_documents, np.int64)
            self._hidden = np.setdiff1d(ids, deleted)
            return len(self._hidden)

    def _dead(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
        """True where a (valid, >= 0) id must not be served: its document is deleted or
        hidden, consolidation retired it, or a compaction removed it."""
        hidden = self._hidden
        ds = self.datastore
        if not (ds.num_deleted_documents or ds.num_retired or len(hidden)) or not ids.size:
            return np.zeros(ids.shape, dtype=bool)
        return ~self.datastore.live_mask(ids, hidden).reshape(ids.shape)

    # --- state changes ---------------------------------------------------------------

    def _new_fresh(self, start: int, stop: int) -> faiss.Index:
        fresh = faiss.IndexIDMap(faiss.IndexFlatL2(self.datastore.dim))
        self._add_fresh(fresh, start, stop)
        return fresh

    def _add_fresh(self, fresh: faiss.Index, start: int, stop: int) -> None:
        for first, keys, _ in self.datastore.iter_chunks(start, stop):
            ids = np.arange(first, first + len(keys), dtype=np.int64)
            fresh.add_with_ids(_f16_to_f32(keys), ids)

    def _load(self, version: int | None) -> _State:
        built, info = (None, None) if version is None else load_version(self.root, version)
        if info is not None and info.dim != self.datastore.dim:
            raise IndexFormatError(f"index dim {info.dim} != datastore dim {self.datastore.dim}")
        n, gen = self.datastore.snapshot()
        valid = 0
        if info is not None:
            valid = min(info.upto, self.datastore.unchanged_below(info.generation), n)
        return _State(built, info, valid, self._new_fresh(valid, n), n, gen)

    def refresh(self) -> int:
        """Make entries appended since the last call searchable; returns how many.

        Call it after every append or truncate (a read-only datastore handle first
        reloads the writer's manifest).
        """
        with self._writer:
            self.datastore.reload()
            st = self._state
            n, gen = self.datastore.snapshot()
            cut = self.datastore.unchanged_below(st.generation)
            if cut < st.fresh_upto:
                # A truncate replaced ids we indexed: rebuild the affected parts.
                valid = min(st.valid_upto, cut)
                new = replace(
                    st,
                    valid_upto=valid,
                    fresh=self._new_fresh(valid, n),
                    fresh_upto=n,
                    generation=gen,
                )
                self._state = new
                return n - valid
            if n == st.fresh_upto:
                st.generation = gen
                return 0
            added = n - st.fresh_upto
            # In-place add: exclusive against searches for the (short) copy into faiss.
            with self._fresh_lock.write():
                self._add_fresh(st.fresh, st.fresh_upto, n)
                st.fresh_upto, st.generation = n, gen
            return added

    def reload(self) -> bool:
        """Switch to the version CURRENT names when it differs from the served one (a new
        build, or an operator pointing CURRENT back); returns whether it switched."""
        with self._writer:
            self.datastore.reload()
            version = current_version(self.root)
            if version is None or version == self.version:
                return False
            new = self._load(version)  # searches keep using the old state meanwhile
            self._state = new
            return True

    def serve(self, version: int | None) -> None:
        """Serve ``version`` (None: the fresh part alone), whatever CURRENT names."""
        with self._writer:
            self.datastore.reload()
            self._state = self._load(version)

    # --- reading ----------------------------------------------------------------------

    @property
    def version(self) -> int | None:
        info = self._state.info
        return None if info is None else info.version

    @property
    def num_entries(self) -> int:
        """Entries the memory holds (built + fresh; deleted ones are filtered at search)."""
        st = self._state
        built = 0 if st.built is None else st.built.ntotal
        return int(built + st.fresh.ntotal)

    def stats(self) -> dict[str, Any]:
        st = self._state
        return {
            "version": self.version,
            "kind": None if st.info is None else st.info.params.kind,
            "built_entries": 0 if st.built is None else int(st.built.ntotal),
            "built_upto": 0 if st.info is None else st.info.upto,
            "valid_upto": st.valid_upto,
            "fresh_entries": int(st.fresh.ntotal),
            "fresh_upto": st.fresh_upto,
        }

    def search(
        self,
        queries: npt.ArrayLike,
        k: int,
        *,
        rerank: bool | None = None,
        depth: int | None = None,
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
        """k nearest live entries of each query: (squared L2 distances (nq, k), ids (nq, k)).

        Rows are ascending; padded with (inf, -1) when fewer than k live entries exist.
        ``rerank`` (default: on for IVF-PQ) fetches ``depth`` PQ candidates (None: the
        version's ``rerank_factor * k``, at least ``rerank_min``; never fewer than k) and
        orders them by exact distances from the float16 keys; without it the built
        part's distances are PQ approximations. ``depth`` is per call: a caller that needs
        64 neighbours need not pay for the 4,096 candidates of one that needs 1,024.
        """
        if depth is not None and depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        q = np.ascontiguousarray(queries, dtype=np.float32)
        dim = self.datastore.dim
        if q.ndim != 2 or q.shape[1] != dim:
            raise ValueError(f"queries: expected shape (nq, {dim}), got {q.shape}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        st = self._state  # one consistent state for the whole call
        nq = q.shape[0]
        total = int((0 if st.built is None else st.built.ntotal) + st.fresh.ntotal)
        fetch = k
        while True:
            dist, ids = self._search_once(st, q, fetch, rerank, depth)
            # Drop stale built ids (-2) and deleted entries only now, after the merge: the
            # top ``fetch`` of the union minus dead ones are the nearest live ones.
            keep = (ids >= 0) & (ids < len(self.datastore))  # < len: truncated, no refresh
            keep[keep] = ~self._dead(ids[keep])
            if not keep.all():
                dist = np.where(keep, dist, np.inf).astype(np.float32)
                ids = np.where(keep, ids, -1)
                order = np.argsort(dist, axis=1, kind="stable")
                dist = np.take_along_axis(dist, order, 1)
                ids = np.take_along_axis(ids, order, 1)
            found = (ids[:, :k] >= 0).sum(1)
            if found.min(initial=k) >= k or fetch >= total or nq == 0:
                break
            fetch = min(total, fetch * 4)
        out_d = np.full((nq, k), np.inf, dtype=np.float32)
        out_i = np.full((nq, k), -1, dtype=np.int64)
        w = min(k, dist.shape[1])
        out_d[:, :w], out_i[:, :w] = dist[:, :w], ids[:, :w]
        return out_d, out_i

    def search_values(
        self, queries: npt.ArrayLike, k: int, *, depth: int | None = None
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64], npt.NDArray[np.int32]]:
        """:meth:`search` plus each neighbour's value (next token); -1 pads ids and values.

        An empty memory or no query gives padded (inf, -1, -1) arrays without searching.
        ``depth``: the re-rank depth of this call (see :meth:`search`).
        """
        q = np.ascontiguousarray(queries, dtype=np.float32)
        n = len(q)
        if n == 0 or self.num_entries == 0:
            return (
                np.full((n, k), np.inf, np.float32),
                np.full((n, k), -1, np.int64),
                np.full((n, k), -1, np.int32),
            )
        dist, ids = self.search(q, k, depth=depth)
        vals = np.full(ids.shape, -1, np.int32)
        ok = ids >= 0
        vals[ok] = self.datastore.values(ids[ok])
        return dist, ids, vals

    def successors(
        self, queries: npt.ArrayLike, ids: npt.ArrayLike
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64], npt.NDArray[np.int32]]:
        """The entries that follow ``ids`` in their documents, with exact distances to the
        row's query: (distances, ids, values), each (nq, m), ascending, padded (inf, -1, -1).

        Entry ``i + 1`` follows ``i`` when it is the same document's entry of the next
        position (a document's entries are appended in one run, so its ids are
        consecutive; a policy that skipped the next token leaves ``i`` without one) and
        it is searchable now: live, and appended before the last ``refresh``. Distances are squared L2 from
        the float16 keys, as the re-rank computes them. ``ids`` (nq, m): -1 pads.
        """
        q = np.ascontiguousarray(queries, dtype=np.float32)
        prev = np.asarray(ids, dtype=np.int64)
        if q.ndim != 2 or q.shape[1] != self.datastore.dim or prev.shape[:1] != q.shape[:1]:
            raise ValueError(f"queries {q.shape} and ids {prev.shape} do not match")
        nxt = np.where(prev >= 0, prev + 1, -1)
        st = self._state
        ok = (prev >= 0) & (nxt < min(st.fresh_upto, len(self.datastore)))
        ok[ok] = ~self._dead(nxt[ok])
        ok[ok] = ~self._dead(prev[ok])
        if ok.any():
            d0, p0, _ = self.datastore.provenance(prev[ok])
            d1, p1, _ = self.datastore.provenance(nxt[ok])
            ok[ok] = (d0 == d1) & (p1 == p0 + 1)
        nxt = np.where(ok, nxt, -1)
        dist = self._exact_distances(q, nxt)
        order = np.argsort(dist, axis=1, kind="stable")
        dist, nxt = np.take_along_axis(dist, order, 1), np.take_along_axis(nxt, order, 1)
        vals = np.full(nxt.shape, -1, np.int32)
        found = nxt >= 0
        vals[found] = self.datastore.values(nxt[found])
        return dist, nxt, vals

    def _search_once(
        self,
        st: _State,
        q: npt.NDArray[np.float32],
        k: int,
        rerank: bool | None,
        depth: int | None = None,
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
        parts_d, parts_i = [], []
        if st.built is not None and st.built.ntotal and st.info is not None:
            d, i = self._search_built(st, q, k, rerank, depth)
            parts_d.append(d)
            parts_i.append(i)
        with self._fresh_lock.read():
            if st.fresh.ntotal:
                d, i = st.fresh.search(q, min(k, st.fresh.ntotal))
                parts_d.append(d)
                parts_i.append(i)
        if not parts_d:
            return (
                np.full((q.shape[0], 0), np.inf, np.float32),
                np.full((q.shape[0], 0), -1, np.int64),
            )
        dist = np.concatenate(parts_d, axis=1)
        ids = np.concatenate(parts_i, axis=1)
        dist[ids == -1] = np.inf  # faiss pads with -1 and a huge finite distance
        order = np.argsort(dist, axis=1, kind="stable")[:, :k]
        return np.take_along_axis(dist, order, 1), np.take_along_axis(ids, order, 1)

    def _search_built(
        self,
        st: _State,
        q: npt.NDArray[np.float32],
        k: int,
        rerank: bool | None,
        depth: int | None = None,
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
        assert st.built is not None and st.info is not None
        p = st.info.params
        if p.kind == "flat":
            d, i = st.built.search(q, min(k, st.built.ntotal))
            return self._drop_stale(st, d, i)
        do_rerank = p.rerank_factor > 1 if rerank is None else rerank
        fetch = min(p.rerank_depth(k, depth) if do_rerank else k, st.built.ntotal)
        # Scan enough lists that ~2x ``fetch`` codes are visited on average.
        per_list = max(1.0, st.built.ntotal / p.nlist)
        nprobe = min(p.nlist, max(p.nprobe, math.ceil(2 * fetch / per_list)))
        sp = faiss.SearchParametersIVF()
        sp.nprobe = nprobe  # per call: several threads may search with different nprobe
        d, i = st.built.search(q, fetch, params=sp)
        d, i = self._drop_stale(st, d, i)
        # Dead candidates go before the re-rank reads keys: a compaction may have removed
        # theirs, and a forgotten document's keys are not read again.
        ok = i >= 0
        ok[ok] = ~self._dead(i[ok])
        i = np.where(ok | (i < 0), i, -2)
        if do_rerank:
            d = self._exact_distances(q, i)
            order = np.argsort(d, axis=1, kind="stable")
            d, i = np.take_along_axis(d, order, 1), np.take_along_axis(i, order, 1)
        return d, i

    def _drop_stale(
        self, st: _State, d: npt.NDArray[np.float32], i: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
        """Mark with id -2 (distance kept) the ids that a truncate after the snapshot
        replaced (or cut, before refresh() ran); they hold their place in the merge and
        are dropped after it."""
        return d, np.where(i >= min(st.valid_upto, len(self.datastore)), -2, i)

    def _exact_distances(
        self, q: npt.NDArray[np.float32], ids: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.float32]:
        """Squared L2 from the float16 keys; inf where ids are negative."""
        out = np.full(ids.shape, np.inf, dtype=np.float32)
        # Blocks of ~2M elements: converting float16 in cache-sized pieces is ~3x faster
        # than one big array, whose fresh pages cost a page fault each.
        rows = max(1, (1 << 21) // max(1, ids.shape[1] * q.shape[1]))
        for r0 in range(0, q.shape[0], rows):
            blk = ids[r0 : r0 + rows]
            ok = blk >= 0
            if not ok.any():
                continue
            if RERANK_BROADCAST and ok.all():  # the usual case: one broadcast subtraction
                keys16 = self.datastore.keys(blk.reshape(-1)).reshape(*blk.shape, -1)
                out[r0 : r0 + rows] = _broadcast_distances(keys16, q[r0 : r0 + rows])
                continue
            keys = _f16_to_f32(self.datastore.keys(blk[ok]))  # (n_ok, d)
            owner = np.repeat(np.arange(len(blk)), ok.sum(1))  # query row of each key
            keys -= q[r0 + owner]
            out[r0 : r0 + rows][ok] = np.einsum("ij,ij->i", keys, keys)
        return out


def _broadcast_distances(
    keys16: npt.NDArray[np.float16], q: npt.NDArray[np.float32]
) -> npt.NDArray[np.float32]:
    """Squared L2 from each query row to its own candidates: ``keys16`` (rows, n, d)
    float16, ``q`` (rows, d) -> (rows, n), in float32 (exact conversions, one sum per
    candidate over its d dims: the same values whatever the piece size)."""
    if not keys16.flags.writeable:  # torch warns on read-only buffers (a read-only memmap)
        keys16 = keys16.copy()
    keys = torch.from_numpy(keys16)
    qt = torch.from_numpy(q)[:, None, :]
    rows, n, dim = keys.shape
    step = n if RERANK_CHUNK_ELEMENTS <= 0 else max(1, RERANK_CHUNK_ELEMENTS // (rows * dim))
    out = torch.empty((rows, n), dtype=torch.float32)
    for s in range(0, n, step):
        piece = keys[:, s : s + step].float()
        piece -= qt
        out[:, s : s + step] = piece.square_().sum(-1)
    return out.numpy()
