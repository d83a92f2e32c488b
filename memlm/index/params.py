"""What an index version is built with (:class:`IndexParams`) and what a build wrote
(:class:`BuildInfo`, ``meta.json`` in the version directory)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch

CURRENT = "CURRENT"
INDEX_FILE = "index.faiss"
META_FILE = "meta.json"

# Below this many live entries the built index is exact: a flat scan of 50k keys at
# d=576 is ~30 MFLOP per query (a few ms, less batched), recall is 1.0, and there is
# nothing to train; IVF-PQ would need >= 39 * nlist k-means points and minutes of
# training to save memory that a 50k store (58 MB of float16 keys) does not need.
FLAT_THRESHOLD = 50_000
# k-means keys per inverted list: faiss subsamples to 256 per centroid itself (more
# never helps) and warns below 39. 64 keeps a full retrain at 1M entries within minutes
# on 2 cores (the coarse k-means is the bulk of it; see docs/memory.md).
TRAIN_PER_LIST = 64
MAX_TRAIN_PER_LIST = 256
# A full retrain happens when the live entries grew (or shrank) this much since the
# version whose quantizer and codebooks are reused was trained.
RETRAIN_GROWTH = 4.0


KINDS = ("flat", "ivfpq", "ivfflat", "ivfsq8", "hnsw")
FAISS_KINDS = ("flat", "ivfpq")  # what memlm.index builds; the rest are Milvus's


class IndexFormatError(RuntimeError):
    """An index directory is missing, malformed, or does not match the datastore."""


@dataclass(frozen=True)
class IndexParams:
    """How to build (and search) one index version. See :meth:`for_size`."""

    # "flat" is exact and needs no training; "ivfpq" compresses keys to m-byte codes.
    # The Milvus memory also builds "ivfflat" (inverted lists of the float32 keys: exact
    # distances), "ivfsq8" (one byte per dimension) and "hnsw" (a graph over the float32
    # keys); the faiss memory builds "flat" and "ivfpq" only (docs/memory.md, "Which
    # index on Milvus").
    kind: Literal["flat", "ivfpq", "ivfflat", "ivfsq8", "hnsw"] = "ivfpq"
    # ~4*sqrt(N) inverted lists (4096 near 1M, as in MoNIM A.2): ~250 keys per list.
    nlist: int = 4096
    # bytes per PQ code (= sub-quantizers); must divide dim. 48 at 1M: 56 B per entry
    # with its id, so the served index stays under 80 B per entry with the quantizer.
    m: int = 48
    # 8 bits per sub-quantizer (256 centroids): faiss's fastest PQ scan path.
    nbits: int = 8
    # lists scanned per query: 32 of 4096 (~0.8%, ~8k keys at 1M) as in MoNIM A.2.
    nprobe: int = 32
    # keys sampled for training (at most MAX_TRAIN_PER_LIST * nlist are used).
    train_size: int = TRAIN_PER_LIST * 4096
    # re-rank 4x k PQ candidates exactly: DATA.md measured recall@1024 0.72 -> 0.83.
    rerank_factor: int = 4
    # ... and at least this many: 48-byte PQ codes order a 576-d key's nearest 64 too
    # coarsely for 4x to hold them (recall@64 0.80 with 256 candidates, 0.905 with 1024,
    # at 1.1M stretched real keys: bench_scale.py --rerank-sweep); 1.2 MB read per query.
    rerank_min: int = 1024
    # seed of the training sample and of k-means, so a rebuild is reproducible.
    seed: int = 0
    # HNSW (Milvus): edges per node, the build's candidate list, the search's (at least k)
    hnsw_m: int = 16
    ef_construction: int = 128
    ef: int = 128

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        for name in (
            "nlist",
            "m",
            "nbits",
            "nprobe",
            "rerank_factor",
            "rerank_min",
            "hnsw_m",
            "ef_construction",
            "ef",
        ):
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
        # PQ encoding time is linear in m. 48 (not 64) from 600k on keeps RAM <= 80 B/entry.
        target = 16 if n < 200_000 else 32 if n < 600_000 else 48
        m = max(d for d in range(1, target + 1) if dim % d == 0)
        nprobe = cls.nprobe_for(nlist)
        return cls(kind="ivfpq", nlist=nlist, m=m, nprobe=nprobe, train_size=TRAIN_PER_LIST * nlist)

    @staticmethod
    def nprobe_for(nlist: int) -> int:
        """Lists an IVF-PQ search scans: nlist/128 (32 at 4096), at least 16 so small
        stores scan >= ~1%, at most 64."""
        return min(64, max(16, nlist // 128))

    @classmethod
    def exact(cls) -> IndexParams:
        """An exact flat index whatever the size (tests, small evaluations)."""
        return cls(kind="flat", nlist=1, m=1, nprobe=1, train_size=0, rerank_factor=1)

    def rerank_depth(self, k: int, depth: int | None = None) -> int:
        """PQ candidates a search of ``k`` neighbours re-ranks exactly: ``depth`` when the
        caller names one (never fewer than ``k``), else ``max(rerank_factor * k,
        rerank_min)`` (4,096 at k = 1,024; 1,024 at k <= 256)."""
        if depth is not None:
            if depth < 1:
                raise ValueError(f"depth must be >= 1, got {depth}")
            return max(k, depth)
        return max(self.rerank_factor * k, self.rerank_min)

    @property
    def train_sample(self) -> int:
        """Keys the training actually samples: ``train_size``, at most 256 per list."""
        return min(self.train_size, MAX_TRAIN_PER_LIST * self.nlist)

    @property
    def exact_distances(self) -> bool:
        """Whether the index returns exact squared L2 distances of the stored keys (no
        re-rank can improve its order): flat, and Milvus's IVF_FLAT and HNSW over float32
        keys; IVF-PQ and SQ8 distances are those of compressed codes."""
        return self.kind in ("flat", "ivfflat", "hnsw")

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
    # "full": trained (IVF-PQ) and filled from scratch; "incremental": a copy of the
    # previous version with the entries removed since (remove_ids) and added since
    mode: str = "full"
    reason: str = ""  # why this mode (a full build names what forced the retrain)
    base_version: int | None = None  # the version an incremental build copied
    # live entries when the quantizer and codebooks in use were trained: a full retrain
    # comes when the live entries grow RETRAIN_GROWTH times past it (or shrink as much)
    trained_entries: int = 0
    added: int = 0  # entries added by this build (all of them for a full one)
    removed: int = 0  # entries an incremental build removed from its copy
    remove_seconds: float = 0.0
    # what a memory whose index lives elsewhere did (Milvus: flush, compaction, index
    # re-created or not and how long the collection was unavailable), in the build record
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["params"] = self.params.to_json()
        out["path"] = self.path.name
        return out

    def record(self) -> dict[str, Any]:
        """What the build record (``index_builds.params["build"]``) keeps of it."""
        keys = ("mode", "reason", "base_version", "trained_entries", "added", "removed")
        out: dict[str, Any] = {k: getattr(self, k) for k in keys}
        out.update(
            train_seconds=round(self.train_seconds, 3),
            add_seconds=round(self.add_seconds, 3),
            remove_seconds=round(self.remove_seconds, 3),
        )
        if self.details:
            out["details"] = dict(self.details)
        return out

    @classmethod
    def read(cls, vdir: Path) -> BuildInfo:
        raw = json.loads((vdir / META_FILE).read_text(encoding="utf-8"))
        raw["params"] = IndexParams(**raw["params"])
        raw["path"] = vdir
        return cls(**raw)


def f16_to_f32(x: npt.NDArray[np.float16]) -> npt.NDArray[np.float32]:
    """float16 -> float32, exact, with torch's vectorised conversion: 0.44 ms per 4096 x 576
    block against 2.36 for faiss's fp16 decoder and 5.73 for numpy (AMD EPYC, 1 thread,
    `python benchmarks/bench_index.py --f16 --k 1024`); every re-rank converts its
    candidates' keys."""
    x = np.ascontiguousarray(x)
    if not x.flags.writeable:  # torch warns on read-only buffers (a read-only memmap)
        x = x.copy()
    out: npt.NDArray[np.float32] = torch.from_numpy(x).float().numpy()
    return out
