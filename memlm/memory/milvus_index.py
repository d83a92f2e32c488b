"""Which index a Milvus memory builds, and how it searches it.

``IndexParams`` names the index in both memories; the faiss memory builds ``flat`` and
``ivfpq``, the Milvus memory also ``ivfflat``, ``ivfsq8`` and ``hnsw`` (Milvus's IVF_FLAT,
IVF_SQ8 and HNSW). Milvus indexes every sealed segment on its own rows, so the IVF sizes
follow one segment, not the whole collection.

Below ``FLAT_THRESHOLD`` live entries a memory is searched exactly (FLAT). Above it the
URL's ``index`` option chooses (``DEFAULT_KIND`` when it says ``auto``); why the default is
what it is: docs/memory.md, "Which index on Milvus" (``benchmarks/bench_milvus_index.py``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from memlm.index import FLAT_THRESHOLD, IndexParams
from memlm.memory.url import INDEX_CHOICES

# index type -> IndexParams.kind, and back
MILVUS_TYPES = {
    "flat": "FLAT",
    "ivfflat": "IVF_FLAT",
    "ivfsq8": "IVF_SQ8",
    "ivfpq": "IVF_PQ",
    "hnsw": "HNSW",
}
KIND_OF_TYPE = {v: k for k, v in MILVUS_TYPES.items()}
# the measured choice (docs/memory.md, "Which index on Milvus"): HNSW searches the
# float32 keys (exact distances, no re-rank round trip); at 1M real keys recall@64 0.996
# at ef 128, batch-1 4.7 ms and batch-64 104 ms against IVF_FLAT's 0.994, 12.5 ms and
# 4.5 s (it reads ~72 MB of keys a query), /predict at 1.04x the bare forward
DEFAULT_KIND = "hnsw"
# lists probed per segment by IVF_FLAT and IVF_SQ8 (of 1,024 per segment at 100k entries,
# 2,048 from ~260k on): recall@64 0.975 at 100k, 0.994 at 1M; IVF_PQ keeps the faiss rule
IVF_NPROBE = 64


def kind_of(choice: str) -> str:
    """The ``IndexParams.kind`` of a URL's ``index`` option (one of ``INDEX_CHOICES``;
    ``auto``: ``DEFAULT_KIND``)."""
    if choice not in INDEX_CHOICES:
        raise ValueError(f"index must be one of {INDEX_CHOICES}, got {choice!r}")
    return DEFAULT_KIND if choice == "auto" else choice.replace("_", "")


def params_for(n: int, dim: int, segment_rows: int, choice: str = "auto") -> IndexParams:
    """The index of a memory of ``n`` live entries: FLAT below the faiss memory's
    threshold (or when the URL asks for it), else the URL's kind, its IVF lists sized to
    one segment (``IndexParams.for_size`` of at most ``segment_rows`` rows)."""
    kind = kind_of(choice)
    if n < FLAT_THRESHOLD or kind == "flat":
        return IndexParams.exact()
    base = IndexParams.for_size(max(FLAT_THRESHOLD, min(n, segment_rows)), dim)
    if kind == "ivfpq":
        return base
    if kind == "hnsw":
        return IndexParams(
            kind="hnsw", nlist=1, m=1, nprobe=1, train_size=0, rerank_factor=base.rerank_factor
        )
    return replace(base, kind=kind, m=1, nprobe=IVF_NPROBE)  # type: ignore[arg-type]


def milvus_index(params: IndexParams) -> dict[str, Any]:
    """The Milvus index of ``params`` (squared L2, as faiss)."""
    kind = params.kind
    if kind == "flat":
        build: dict[str, Any] = {}
    elif kind == "hnsw":
        build = {"M": params.hnsw_m, "efConstruction": params.ef_construction}
    elif kind == "ivfpq":
        build = {"nlist": params.nlist, "m": params.m, "nbits": params.nbits}
    else:
        build = {"nlist": params.nlist}
    return {"index_type": MILVUS_TYPES[kind], "metric_type": "L2", "params": build}


def from_index(index_type: str | None, raw: dict[str, Any]) -> IndexParams:
    """``IndexParams`` of an index Milvus holds (its type and build parameters; the search
    parameters are this module's rule: the IVF nprobe, HNSW's ef)."""
    kind = KIND_OF_TYPE.get(index_type or "FLAT")
    if kind is None or kind == "flat":
        return IndexParams.exact()  # (an index memlm does not build: searched as FLAT)
    if kind == "hnsw":
        return IndexParams(
            kind="hnsw",
            nlist=1,
            m=1,
            nprobe=1,
            train_size=0,
            hnsw_m=int(raw["M"]),
            ef_construction=int(raw["efConstruction"]),
        )
    nlist = int(raw["nlist"])
    if kind == "ivfpq":
        m, nbits = int(raw["m"]), int(raw.get("nbits", 8))
        nprobe = IndexParams.nprobe_for(nlist)  # as the faiss memory's IVF-PQ
        return IndexParams(kind="ivfpq", nlist=nlist, m=m, nbits=nbits, nprobe=nprobe)
    return IndexParams(
        kind=kind,  # type: ignore[arg-type]
        nlist=nlist,
        m=1,
        nprobe=IVF_NPROBE,
        train_size=nlist,
    )


def searched(params: IndexParams, ef: int | None, nprobe: int | None) -> IndexParams:
    """``params`` with the URL's search parameters where it names them and they apply
    (``ef`` to HNSW, ``nprobe`` to the IVF kinds)."""
    if ef is not None and params.kind == "hnsw":
        params = replace(params, ef=ef)
    if nprobe is not None and params.kind.startswith("ivf"):
        params = replace(params, nprobe=nprobe)
    return params


def search_param(params: IndexParams, fetch: int) -> dict[str, Any]:
    """The search parameters for ``fetch`` candidates a query: nprobe (IVF), ef (HNSW,
    at least ``fetch``: Milvus refuses a smaller one)."""
    if params.kind == "hnsw":
        return {"metric_type": "L2", "params": {"ef": max(params.ef, fetch)}}
    if params.kind == "flat":
        return {"metric_type": "L2", "params": {}}
    return {"metric_type": "L2", "params": {"nprobe": min(params.nprobe, params.nlist)}}


def describe(params: IndexParams) -> str:
    """A short label: ``HNSW M16/efC128/ef128``, ``IVF_SQ8 2048/64``, ``FLAT``."""
    t = MILVUS_TYPES[params.kind]
    if params.kind == "flat":
        return t
    if params.kind == "hnsw":
        return f"{t} M{params.hnsw_m}/efC{params.ef_construction}/ef{params.ef}"
    if params.kind == "ivfpq":
        return f"{t} {params.nlist}/m{params.m}/{params.nprobe}"
    return f"{t} {params.nlist}/{params.nprobe}"
