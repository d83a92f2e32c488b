"""Building index versions: a full build (train + fill) or an incremental one (a copy of
the CURRENT version, minus the entries removed since, plus those appended since).

A full build trains the IVF quantizer and the PQ codebooks on a sample of at most
256 x nlist live keys and adds every live entry. Every later build is incremental: it
reads the CURRENT version's file (a copy of what is served), drops the ids of forgotten
documents, compacted rows and truncated entries with ``remove_ids``, and adds the live
entries appended since that version's snapshot with ``add_with_ids``. It retrains (a
full build) when asked (``retrain=True``), when the live entries grew (or shrank)
RETRAIN_GROWTH times since the training in use, when the store outgrew the exact index,
when other ``params`` are asked for, or when the previous version cannot be read. The
reason is kept in the version's ``meta.json`` and the build record.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Literal

import faiss
import numpy as np
import numpy.typing as npt
from tqdm import tqdm

from memlm.datastore import Datastore, SimulatedCrash
from memlm.index.params import (
    FAISS_KINDS,
    INDEX_FILE,
    RETRAIN_GROWTH,
    BuildInfo,
    IndexFormatError,
    IndexParams,
    f16_to_f32,
)
from memlm.index.versions import current_version, next_version, publish, read_index, version_name

log = logging.getLogger(__name__)


class _BaseUnusable(Exception):
    """The CURRENT version cannot be built on; the message says why (a full build follows)."""


# Points where ``build_index(crash_at=...)`` raises ``SimulatedCrash``, in order, for a
# full build and for an incremental one.
BUILD_CRASH_POINTS = (
    "after_train",  # index trained, nothing written
    "after_add",  # all entries added, nothing written
    "after_write",  # tmp-... directory complete and fsynced, not renamed
    "after_rename",  # v000042 in place, CURRENT still names the old version
    "before_current",  # CURRENT's temp file written, not renamed over CURRENT
)
INCREMENTAL_CRASH_POINTS = (
    "after_copy",  # the CURRENT version's index read into the builder, nothing changed
    "after_remove",  # dead ids removed from the copy
    *BUILD_CRASH_POINTS[1:],
)


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
    # no precomputed table (nlist * m * 256 floats): see versions.read_index
    index.use_precomputed_table = -1
    return index


def _add(
    work: faiss.Index,
    ds: Datastore,
    live: npt.NDArray[np.int64],
    start: int,
    chunk: int,
    progress: bool,
) -> int:
    """Add the ``live`` ids >= ``start`` (all < the snapshot's length); returns how many."""
    upto = int(live[-1]) + 1 if len(live) else start
    added = 0
    with tqdm(
        total=max(0, upto - start), desc="index add", unit="key", disable=not progress
    ) as bar:
        for first, keys, _ in ds.iter_chunks(start, max(start, upto), chunk):
            # The live set was fixed at the snapshot: deletions during the build are
            # filtered at search time like any later deletion.
            lo, hi = np.searchsorted(live, [first, first + len(keys)])
            ids = live[lo:hi]
            if len(ids):
                work.add_with_ids(f16_to_f32(keys[ids - first]), ids)
                added += len(ids)
            bar.update(len(keys))
    return added


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
        size = min(len(live), params.train_sample)
        sample = np.sort(rng.choice(live, size=size, replace=False))
        work.train(f16_to_f32(ds.keys(sample)))  # (ntrain, d)
        del sample
    train_seconds = time.perf_counter() - t0
    if crash_at == "after_train":
        raise SimulatedCrash(crash_at)

    t0 = time.perf_counter()
    _add(work, ds, live, 0, chunk, progress)
    add_seconds = time.perf_counter() - t0
    if gpu:
        index = faiss.index_gpu_to_cpu(work)
        if isinstance(index, faiss.IndexIVFPQ):
            index.use_precomputed_table = -1
    del res
    return index, train_seconds, add_seconds


def _live_ids(ds: Datastore, upto: int) -> npt.NDArray[np.int64]:
    ids = np.arange(upto, dtype=np.int64)
    if not (ds.num_deleted_documents or ds.num_retired) or upto == 0:
        return ids
    return ids[ds.live_mask(ids)]


def _base(root: Path) -> tuple[BuildInfo | None, str]:
    """The CURRENT version's meta to build on, or (None, why a full build)."""
    try:
        version = current_version(root)
        if version is None:
            return None, "first build"
        return BuildInfo.read(root / version_name(version)), ""
    except (OSError, ValueError, TypeError, IndexFormatError) as exc:
        return None, f"the current version cannot be read ({exc})"


def retrain_reason(
    base: BuildInfo | None,
    live: int,
    dim: int,
    params: IndexParams | None,
    retrain: bool,
) -> str:
    """Why a build must train from scratch ('' when it may build on ``base``)."""
    if base is None:
        return "first build"
    if retrain:
        return "retrain requested"
    if base.dim != dim:
        return f"key dimension changed ({base.dim} -> {dim})"
    if params is not None:
        return "" if params == base.params else "other index parameters requested"
    if base.params.kind == "flat":  # nothing trained: exact until the store outgrows it
        if IndexParams.for_size(live, dim).kind == "flat":
            return ""
        return f"{live} live entries outgrew the exact index"
    trained = max(1, base.trained_entries or base.entries)
    if live >= RETRAIN_GROWTH * trained:
        return f"live entries grew {live / trained:.1f}x since training ({trained} -> {live})"
    if live * RETRAIN_GROWTH <= trained:
        return f"live entries shrank {trained / max(1, live):.1f}x since training"
    return ""


def build_index(
    datastore: Datastore,
    root: Path,
    params: IndexParams | None = None,
    *,
    retrain: bool = False,
    crash_at: str | None = None,
    use_gpu: bool | Literal["auto"] = "auto",
    progress: bool = True,
    chunk: int = 65536,
    threads: int | None = None,
) -> BuildInfo:
    """Build a new version over the live entries [0, len(datastore)) and make it CURRENT.

    Incremental on top of the CURRENT version unless :func:`retrain_reason` gives a
    reason to train. ``params`` (a full build) defaults to ``IndexParams.for_size(live
    entries, dim)``; an incremental build keeps its base's. Uses the GPU for a full
    build when ``use_gpu`` is True or "auto" and faiss sees one; otherwise the CPU, with
    ``threads`` (else MEMLM_THREADS, else faiss's default) OpenMP threads, process-wide.
    """
    threads = threads or int(os.environ.get("MEMLM_THREADS", "0")) or None
    if threads:
        faiss.omp_set_num_threads(threads)
    points = set(BUILD_CRASH_POINTS) | set(INCREMENTAL_CRASH_POINTS)
    if crash_at is not None and crash_at not in points:
        raise ValueError(f"crash_at must be one of {sorted(points)}, got {crash_at!r}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    upto, generation = datastore.snapshot()
    deleted = datastore.num_deleted_documents  # read before the live ids: never more
    live = _live_ids(datastore, upto)
    dim = datastore.dim
    base, reason = _base(root)
    reason = reason or retrain_reason(base, len(live), dim, params, retrain)
    stamp = {"upto": upto, "generation": generation, "dim": dim, "deleted_documents": deleted}
    info = None
    if not reason:
        assert base is not None
        try:
            info = _incremental(datastore, root, live, base, stamp, crash_at, progress, chunk)
        except _BaseUnusable as exc:
            reason = str(exc)
            log.warning("index build: %s; training from scratch", reason)
    if info is None:
        info = _full(
            datastore, root, live, params, reason, stamp, crash_at, use_gpu, progress, chunk
        )
    log.info(
        "built index %s (%s: %s): %d entries, +%d -%d, train %.1fs, add %.1fs",
        info.path,
        info.mode,
        info.reason,
        info.entries,
        info.added,
        info.removed,
        info.train_seconds,
        info.add_seconds,
    )
    return info


def _full(
    ds: Datastore,
    root: Path,
    live: npt.NDArray[np.int64],
    params: IndexParams | None,
    reason: str,
    stamp: dict[str, int],
    crash_at: str | None,
    use_gpu: bool | Literal["auto"],
    progress: bool,
    chunk: int,
) -> BuildInfo:
    dim = ds.dim
    if params is None:
        params = IndexParams.for_size(len(live), dim)
    if params.kind not in FAISS_KINDS:
        raise ValueError(
            f"the faiss memory builds {FAISS_KINDS} indexes, not {params.kind!r} (a Milvus one)"
        )
    if params.kind == "ivfpq" and len(live) < max(params.nlist, 2**params.nbits):
        raise ValueError(
            f"IVF-PQ with nlist={params.nlist} needs >= {max(params.nlist, 2**params.nbits)} "
            f"live entries, the snapshot has {len(live)}; use IndexParams.for_size"
        )
    index = None
    if params.kind == "ivfpq" and _gpu_available(use_gpu):
        try:
            index, train_s, add_s = _fill(
                ds, live, params, dim, chunk, progress, gpu=True, crash_at=crash_at
            )
        except SimulatedCrash:
            raise
        except Exception:  # noqa: BLE001 - e.g. an m or memory size faiss-gpu refuses
            log.warning("GPU build failed; building on the CPU", exc_info=True)
    if index is None:
        index, train_s, add_s = _fill(
            ds, live, params, dim, chunk, progress, gpu=False, crash_at=crash_at
        )
    if crash_at == "after_add":
        raise SimulatedCrash(crash_at)
    assert index.ntotal == len(live), (index.ntotal, len(live))
    version = next_version(root)
    info = BuildInfo(
        version=version,
        entries=len(live),
        params=params,
        train_seconds=train_s,
        add_seconds=add_s,
        path=root / version_name(version),
        mode="full",
        reason=reason,
        trained_entries=len(live),
        added=len(live),
        upto=stamp["upto"],
        generation=stamp["generation"],
        dim=stamp["dim"],
        deleted_documents=stamp["deleted_documents"],
    )
    publish(root, index, info, crash_at)
    return info


def _incremental(
    ds: Datastore,
    root: Path,
    live: npt.NDArray[np.int64],
    base: BuildInfo,
    stamp: dict[str, int],
    crash_at: str | None,
    progress: bool,
    chunk: int,
) -> BuildInfo:
    """Copy ``base``'s index, remove what is no longer live, add what was appended since."""
    try:  # the builder's own copy of the served index
        index = read_index(base.path / INDEX_FILE)
    except RuntimeError as exc:  # faiss: missing or truncated file
        raise _BaseUnusable(f"{base.path.name} cannot be read ({exc})") from exc
    if index.ntotal != base.entries or index.d != stamp["dim"]:
        raise _BaseUnusable(
            f"{base.path.name}: index has {index.ntotal} x {index.d}, "
            f"meta says {base.entries} x {stamp['dim']}"
        )
    if crash_at == "after_copy":
        raise SimulatedCrash(crash_at)
    # Ids the base holds that are no longer valid: a truncate since its snapshot replaced
    # ids >= valid; below it, entries of documents forgotten, entries retired by
    # consolidation (or rows compacted) since: fewer live ids below ``valid`` than it holds.
    valid = min(base.upto, ds.unchanged_below(base.generation), stamp["upto"])
    t0 = time.perf_counter()
    removed = 0
    died = int((live < valid).sum()) != base.entries
    if valid < base.upto or stamp["deleted_documents"] != base.deleted_documents or died:
        keep = np.zeros(base.upto, dtype=bool)
        keep[live[live < valid]] = True
        dead = np.flatnonzero(~keep).astype(np.int64)
        if len(dead):
            removed = int(index.remove_ids(faiss.IDSelectorBatch(dead)))
    remove_s = time.perf_counter() - t0
    if crash_at == "after_remove":
        raise SimulatedCrash(crash_at)
    t0 = time.perf_counter()
    added = _add(index, ds, live, valid, chunk, progress)
    add_s = time.perf_counter() - t0
    if crash_at == "after_add":
        raise SimulatedCrash(crash_at)
    # Every live id of the snapshot is in: those below ``valid`` were in the base (the
    # base indexed every id live at its snapshot, and none came back to life since).
    if index.ntotal != len(live):
        raise _BaseUnusable(
            f"{base.path.name} plus the appended entries holds {index.ntotal} entries, "
            f"the snapshot {len(live)} live ones"
        )
    version = next_version(root)
    info = BuildInfo(
        version=version,
        entries=len(live),
        params=base.params,
        train_seconds=0.0,
        add_seconds=add_s,
        path=root / version_name(version),
        mode="incremental",
        reason=f"added to {base.path.name}",
        base_version=base.version,
        trained_entries=base.trained_entries or base.entries,
        added=added,
        removed=removed,
        remove_seconds=remove_s,
        upto=stamp["upto"],
        generation=stamp["generation"],
        dim=stamp["dim"],
        deleted_documents=stamp["deleted_documents"],
    )
    publish(root, index, info, crash_at)
    return info
