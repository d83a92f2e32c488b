"""FAISS memory over a :class:`~memlm.datastore.Datastore`: built versions + a fresh part.

- :func:`build_index` trains and fills an index (exact ``flat`` for small stores, IVF-PQ
  otherwise) from a snapshot of the live entries, writes it into ``root/tmp-...``, renames
  that to ``root/v000042`` and atomically points ``root/CURRENT`` at it.
- :class:`MemoryIndex` serves the current version plus an exact "fresh" index over the
  entries appended since that version's snapshot, merges both, hides deleted documents
  (and those ``hide_documents`` names, before their deletion is committed) and entries a
  compaction removed, and (for IVF-PQ) re-ranks candidates with exact distances from the
  float16 keys of the live ones only.

Index ids are global datastore entry ids. Distances are **squared** L2 (the FAISS
convention), ascending; missing results are padded with (inf, -1).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import threading
import time
import uuid
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import faiss
import numpy as np
import numpy.typing as npt
from tqdm import tqdm

from memlm.datastore import Datastore, SimulatedCrash, atomic_write_text, fsync_dir

log = logging.getLogger(__name__)

CURRENT = "CURRENT"
INDEX_FILE = "index.faiss"
META_FILE = "meta.json"

# Points where ``build_index(crash_at=...)`` raises ``SimulatedCrash``, in order.
BUILD_CRASH_POINTS = (
    "after_train",  # index trained, nothing written
    "after_add",  # all entries added, nothing written
    "after_write",  # tmp-... directory complete and fsynced, not renamed
    "after_rename",  # v000042 in place, CURRENT still names the old version
    "before_current",  # CURRENT's temp file written, not renamed over CURRENT
)

# Below this many live entries the built index is exact: a flat scan of 50k keys at
# d=576 is ~30 MFLOP per query (a few ms, less batched), recall is 1.0, and there is
# nothing to train; IVF-PQ would need >= 39 * nlist k-means points and minutes of
# training to save memory that a 50k store (58 MB of float16 keys) does not need.
FLAT_THRESHOLD = 50_000
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


class IndexFormatError(RuntimeError):
    """An index directory is missing, malformed, or does not match the datastore."""


@dataclass(frozen=True)
class IndexParams:
    """How to build (and search) one index version. See :meth:`for_size`."""

    # "flat" is exact and needs no training; "ivfpq" compresses keys to m-byte codes.
    kind: Literal["flat", "ivfpq"] = "ivfpq"
    # ~4*sqrt(N) inverted lists (4096 near 1M, as in MoNIM A.2): ~250 keys per list.
    nlist: int = 4096
    # bytes per PQ code (= sub-quantizers); 64 at 1M as in MoNIM A.2; must divide dim.
    m: int = 64
    # 8 bits per sub-quantizer (256 centroids): faiss's fastest PQ scan path.
    nbits: int = 8
    # lists scanned per query: 32 of 4096 (~0.8%, ~8k keys at 1M) as in MoNIM A.2.
    nprobe: int = 32
    # keys sampled for training: 1M as in MoNIM A.2 (k-means uses <= 256 per centroid).
    train_size: int = 1_000_000
    # re-rank 4x k PQ candidates exactly: DATA.md measured recall@1024 0.72 -> 0.83.
    rerank_factor: int = 4
    # seed of the training sample and of k-means, so a rebuild is reproducible.
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("flat", "ivfpq"):
            raise ValueError(f"kind must be 'flat' or 'ivfpq', got {self.kind!r}")
        for name in ("nlist", "m", "nbits", "nprobe", "rerank_factor"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.kind == "ivfpq" and self.train_size < max(self.nlist, 2**self.nbits):
            raise ValueError("train_size must be >= max(nlist, 2**nbits) for IVF-PQ")

    @classmethod
    def for_size(cls, n: int, dim: int) -> IndexParams:
        """Parameters for a store of ``n`` live entries of dimension ``dim``."""
        if n < FLAT_THRESHOLD:
            return cls.exact()
        # nlist: 4*sqrt(n) rounded (in log scale) to a power of two: 4096 for 525k..2.1M.
        nlist = 2 ** round(math.log2(4 * math.sqrt(n)))
        # Code bytes grow with n: small stores are rebuilt often and re-ranked exactly, and
        # PQ encoding time is linear in m (~230 us/key at m=64, d=576 per DATA.md).
        target = 16 if n < 200_000 else 32 if n < 600_000 else 64
        m = max(d for d in range(1, target + 1) if dim % d == 0)
        # nlist/128 lists per query (32 at 4096), at least 16 so small stores scan >= ~1%.
        nprobe = min(64, max(16, nlist // 128))
        return cls(kind="ivfpq", nlist=nlist, m=m, nprobe=nprobe, train_size=1_000_000)

    @classmethod
    def exact(cls) -> IndexParams:
        """An exact flat index whatever the size (tests, small evaluations)."""
        return cls(kind="flat", nlist=1, m=1, nprobe=1, train_size=0, rerank_factor=1)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class BuildInfo:
    """What :func:`build_index` wrote (also stored as ``meta.json`` in the version dir)."""

    version: int
    entries: int  # live entries indexed
    upto: int  # datastore length covered by the snapshot
    params: IndexParams
    train_seconds: float
    add_seconds: float
    path: Path
    generation: int = 0  # datastore generation at the snapshot (see unchanged_below)
    dim: int = 0
    # documents the datastore had deleted at the snapshot: a version built before a later
    # deletion holds that document's keys (and its lexical statistics), see ``prune``
    deleted_documents: int = 0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["params"] = self.params.to_json()
        out["path"] = self.path.name
        return out

    @classmethod
    def read(cls, vdir: Path) -> BuildInfo:
        raw = json.loads((vdir / META_FILE).read_text(encoding="utf-8"))
        raw["params"] = IndexParams(**raw["params"])
        raw["path"] = vdir
        return cls(**raw)


def _version_name(version: int) -> str:
    return f"v{version:06d}"


def list_versions(root: Path) -> list[int]:
    """Complete version directories under ``root``, ascending."""
    if not root.exists():
        return []
    out = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith("v") and p.name[1:].isdigit():
            out.append(int(p.name[1:]))
    return sorted(out)


def current_version(root: Path) -> int | None:
    """The version ``root/CURRENT`` names, or None before the first build."""
    cur = Path(root) / CURRENT
    if not cur.exists():
        return None
    name = cur.read_text(encoding="utf-8").strip()
    if not (name.startswith("v") and name[1:].isdigit()):
        raise IndexFormatError(f"{cur}: malformed content {name!r}")
    return int(name[1:])


def prune(root: Path, keep: int = 3, *, deleted_documents: int | None = None) -> list[Path]:
    """Delete all but the newest ``keep`` versions (never CURRENT's) and stale tmp dirs.

    ``deleted_documents`` (the datastore's count now): also delete every version built
    when fewer documents were deleted, since it still holds a forgotten document's keys
    (codes, or float32 keys in a flat index) and lexical statistics. A version whose
    meta cannot be read counts as such. Only call it from the single builder: a tmp dir
    of a build in progress would go too.
    """
    root = Path(root)
    cur = current_version(root)
    versions = list_versions(root)
    doomed = [v for v in versions[: max(0, len(versions) - keep)] if v != cur]
    if deleted_documents:
        for v in versions:
            if v == cur or v in doomed:
                continue
            try:
                built_with = BuildInfo.read(root / _version_name(v)).deleted_documents
            except (OSError, ValueError, TypeError):
                built_with = -1
            if built_with < deleted_documents:
                doomed.append(v)
    removed = [root / _version_name(v) for v in doomed]
    removed += [p for p in root.iterdir() if p.name.startswith("tmp-")] if root.exists() else []
    for p in removed:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    if removed:
        fsync_dir(root)
    return removed


def newest_recorded(root: Path, recorded: Collection[int]) -> int | None:
    """The newest version directory under ``root`` that the build records vouch for."""
    kept = [v for v in list_versions(Path(root)) if v in set(recorded)]
    return max(kept) if kept else None


def remove_orphan_versions(root: Path, recorded: Collection[int]) -> list[int]:
    """Delete version directories that no build record names; point CURRENT at the newest
    recorded one (remove it when there is none). Returns the deleted versions, ascending.

    An orphan is a build killed after writing its directory (or CURRENT) and before the
    database recorded it: its request is still marked running and is built again. Only
    the single builder may call this, holding the build lock (a build in progress has an
    unrecorded directory too).
    """
    root = Path(root)
    orphans = [v for v in list_versions(root) if v not in set(recorded)]
    keep = newest_recorded(root, recorded)
    cur = root / CURRENT
    if keep is None:
        if cur.exists():
            cur.unlink()
    elif current_version(root) != keep:
        atomic_write_text(cur, _version_name(keep) + "\n")
    for v in orphans:  # CURRENT no longer names them: a crash here leaves only orphans
        shutil.rmtree(root / _version_name(v))
    if root.exists():
        fsync_dir(root)
    return orphans


# --- building ------------------------------------------------------------------------


def _gpu_available(use_gpu: bool | str) -> bool:
    if use_gpu is False:
        return False
    has = hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0
    if use_gpu is True and not has:
        log.warning("use_gpu=True but faiss has no GPU support or sees no GPU; using CPU")
    return has


def _new_index(params: IndexParams, dim: int) -> faiss.Index:
    if params.kind == "flat":
        return faiss.IndexIDMap(faiss.IndexFlatL2(dim))
    if dim % params.m:
        raise ValueError(f"m={params.m} must divide dim={dim}")
    quantizer = faiss.IndexFlatL2(dim)
    index = faiss.IndexIVFPQ(quantizer, dim, params.nlist, params.m, params.nbits)
    index.cp.seed = params.seed
    index.pq.cp.seed = params.seed
    return index


def _fill(
    ds: Datastore,
    live: npt.NDArray[np.int64],
    params: IndexParams,
    dim: int,
    chunk: int,
    progress: bool,
    *,
    gpu: bool,
    crash_at: str | None,
) -> tuple[faiss.Index, float, float]:
    """Train (IVF-PQ) and add the ``live`` ids; returns (CPU index, train s, add s)."""
    index = _new_index(params, dim)
    work, res = index, None
    if gpu:
        res = faiss.StandardGpuResources()
        opts = faiss.GpuClonerOptions()
        opts.useFloat16 = True  # 64-byte codes need float16 lookup tables on the GPU
        work = faiss.index_cpu_to_gpu(res, 0, index, opts)

    t0 = time.perf_counter()
    if params.kind == "ivfpq":
        rng = np.random.default_rng(params.seed)
        sample = np.sort(rng.choice(live, size=min(len(live), params.train_size), replace=False))
        work.train(_f16_to_f32(ds.keys(sample)))  # (ntrain, d)
        del sample
    train_seconds = time.perf_counter() - t0
    if crash_at == "after_train":
        raise SimulatedCrash(crash_at)

    t0 = time.perf_counter()
    upto = int(live[-1]) + 1 if len(live) else 0
    with tqdm(total=upto, desc="index add", unit="key", disable=not progress) as bar:
        for first, keys, _ in ds.iter_chunks(0, upto, chunk):
            # The live set was fixed at the snapshot: deletions during the build are
            # filtered at search time like any later deletion.
            lo, hi = np.searchsorted(live, [first, first + len(keys)])
            ids = live[lo:hi]
            if len(ids):
                work.add_with_ids(_f16_to_f32(keys[ids - first]), ids)
            bar.update(len(keys))
    add_seconds = time.perf_counter() - t0
    if gpu:
        index = faiss.index_gpu_to_cpu(work)
    del res
    return index, train_seconds, add_seconds


def _live_ids(ds: Datastore, upto: int) -> npt.NDArray[np.int64]:
    ids = np.arange(upto, dtype=np.int64)
    if not ds.num_deleted_documents or upto == 0:
        return ids
    return ids[ds.live_mask(ids)]


def _next_version(root: Path) -> int:
    versions = list_versions(root)
    cur = current_version(root)
    return max([0, *versions, *([cur] if cur is not None else [])]) + 1


def build_index(
    datastore: Datastore,
    root: Path,
    params: IndexParams | None = None,
    *,
    crash_at: str | None = None,
    use_gpu: bool | Literal["auto"] = "auto",
    progress: bool = True,
    chunk: int = 65536,
    threads: int | None = None,
) -> BuildInfo:
    """Build a new version from the live entries [0, len(datastore)) and make it CURRENT.

    ``params`` defaults to ``IndexParams.for_size(live entries, dim)``. Uses the GPU when
    ``use_gpu`` is True or "auto" and faiss sees one; otherwise the CPU, with ``threads``
    (else MEMLM_THREADS, else faiss's default) OpenMP threads, set process-wide.
    """
    threads = threads or int(os.environ.get("MEMLM_THREADS", "0")) or None
    if threads:
        faiss.omp_set_num_threads(threads)
    if crash_at is not None and crash_at not in BUILD_CRASH_POINTS:
        raise ValueError(f"crash_at must be one of {BUILD_CRASH_POINTS}, got {crash_at!r}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    upto, generation = datastore.snapshot()
    deleted = datastore.num_deleted_documents  # read before the live ids: never more
    live = _live_ids(datastore, upto)
    dim = datastore.dim
    if params is None:
        params = IndexParams.for_size(len(live), dim)
    if params.kind == "ivfpq" and len(live) < max(params.nlist, 2**params.nbits):
        raise ValueError(
            f"IVF-PQ with nlist={params.nlist} needs >= {max(params.nlist, 2**params.nbits)} "
            f"live entries, the snapshot has {len(live)}; use IndexParams.for_size"
        )
    index = None
    if params.kind == "ivfpq" and _gpu_available(use_gpu):
        try:
            index, train_seconds, add_seconds = _fill(
                datastore, live, params, dim, chunk, progress, gpu=True, crash_at=crash_at
            )
        except SimulatedCrash:
            raise
        except Exception:  # noqa: BLE001 - e.g. an m or memory size faiss-gpu refuses
            log.warning("GPU build failed; building on the CPU", exc_info=True)
    if index is None:
        index, train_seconds, add_seconds = _fill(
            datastore, live, params, dim, chunk, progress, gpu=False, crash_at=crash_at
        )
    if crash_at == "after_add":
        raise SimulatedCrash(crash_at)
    assert index.ntotal == len(live), (index.ntotal, len(live))

    version = _next_version(root)
    final = root / _version_name(version)
    tmp = root / f"tmp-{_version_name(version)}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    faiss.write_index(index, str(tmp / INDEX_FILE))
    info = BuildInfo(
        version=version,
        entries=len(live),
        upto=upto,
        params=params,
        train_seconds=train_seconds,
        add_seconds=add_seconds,
        path=final,
        generation=generation,
        dim=dim,
        deleted_documents=deleted,
    )
    (tmp / META_FILE).write_text(json.dumps(info.to_json(), indent=1), encoding="utf-8")
    for name in (INDEX_FILE, META_FILE):
        with open(tmp / name, "rb") as f:
            os.fsync(f.fileno())
    fsync_dir(tmp)
    if crash_at == "after_write":
        raise SimulatedCrash(crash_at)
    os.replace(tmp, final)
    fsync_dir(root)
    if crash_at == "after_rename":
        raise SimulatedCrash(crash_at)
    atomic_write_text(
        root / CURRENT,
        _version_name(version) + "\n",
        crash_at="before_current" if crash_at == "before_current" else None,
    )
    log.info(
        "built index %s: %d entries, train %.1fs, add %.1fs",
        final,
        len(live),
        train_seconds,
        add_seconds,
    )
    return info


def load_version(root: Path, version: int) -> tuple[faiss.Index, BuildInfo]:
    """Read one version's index and metadata, checking that they agree."""
    vdir = Path(root) / _version_name(version)
    info = BuildInfo.read(vdir)
    index = faiss.read_index(str(vdir / INDEX_FILE))
    if index.ntotal != info.entries or index.d != info.dim:
        raise IndexFormatError(
            f"{vdir}: index has {index.ntotal} x {index.d}, meta says {info.entries} x {info.dim}"
        )
    return index, info


# --- serving ---------------------------------------------------------------------------


def _f16_to_f32(x: npt.NDArray[np.float16]) -> npt.NDArray[np.float32]:
    """float16 -> float32 with faiss's SIMD decoder (measured 1.9 vs numpy's 3.1 ns/value)."""
    sq = faiss.ScalarQuantizer(x.shape[1], faiss.ScalarQuantizer.QT_fp16)
    out: npt.NDArray[np.float32] = sq.decode(np.ascontiguousarray(x).view(np.uint8))
    return out


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
        hidden, or a compaction removed it."""
        hidden = self._hidden
        if not (self.datastore.num_deleted_documents or len(hidden)) or not ids.size:
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
        self, queries: npt.ArrayLike, k: int, *, rerank: bool | None = None
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
        """k nearest live entries of each query: (squared L2 distances (nq, k), ids (nq, k)).

        Rows are ascending; padded with (inf, -1) when fewer than k live entries exist.
        ``rerank`` (default: on for IVF-PQ) fetches ``rerank_factor * k`` PQ candidates
        and orders them by exact distances from the float16 keys; without it the built
        part's distances are PQ approximations.
        """
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
            dist, ids = self._search_once(st, q, fetch, rerank)
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
        self, queries: npt.ArrayLike, k: int
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64], npt.NDArray[np.int32]]:
        """:meth:`search` plus each neighbour's value (next token); -1 pads ids and values.

        An empty memory or no query gives padded (inf, -1, -1) arrays without searching.
        """
        q = np.ascontiguousarray(queries, dtype=np.float32)
        n = len(q)
        if n == 0 or self.num_entries == 0:
            return (
                np.full((n, k), np.inf, np.float32),
                np.full((n, k), -1, np.int64),
                np.full((n, k), -1, np.int32),
            )
        dist, ids = self.search(q, k)
        vals = np.full(ids.shape, -1, np.int32)
        ok = ids >= 0
        vals[ok] = self.datastore.values(ids[ok])
        return dist, ids, vals

    def _search_once(
        self, st: _State, q: npt.NDArray[np.float32], k: int, rerank: bool | None
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
        parts_d, parts_i = [], []
        if st.built is not None and st.built.ntotal and st.info is not None:
            d, i = self._search_built(st, q, k, rerank)
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
        self, st: _State, q: npt.NDArray[np.float32], k: int, rerank: bool | None
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
        assert st.built is not None and st.info is not None
        p = st.info.params
        if p.kind == "flat":
            d, i = st.built.search(q, min(k, st.built.ntotal))
            return self._drop_stale(st, d, i)
        do_rerank = p.rerank_factor > 1 if rerank is None else rerank
        fetch = min(k * (p.rerank_factor if do_rerank else 1), st.built.ntotal)
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
            keys = _f16_to_f32(self.datastore.keys(blk[ok]))  # (n_ok, d)
            owner = np.repeat(np.arange(len(blk)), ok.sum(1))  # query row of each key
            keys -= q[r0 + owner]
            out[r0 : r0 + rows][ok] = np.einsum("ij,ij->i", keys, keys)
        return out
