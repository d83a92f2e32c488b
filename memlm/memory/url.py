"""``MEMLM_MEMORY_URL``: which memory backend serves (the contract other tools set).

Unset, empty or ``faiss``: the embedded files in the data directory.
``milvus://host[:port]/collection[?options]``: a Milvus server (standalone or Distributed,
any node that serves the gRPC API, port 19530 by default); options ``consistency=Session``,
``rerank=1``, ``timeout=30``, ``seal=20000``, ``index=auto``, ``ef=128``, ``nprobe=64``
(``MilvusURL`` says what each does).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

DEFAULT_PORT = 19530
# Milvus collection names: a letter or underscore, then letters, digits, underscores.
_COLLECTION = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,254}$")
CONSISTENCY_LEVELS = ("Strong", "Session", "Bounded", "Eventually")
# the URL's ``index`` option (memlm.memory.milvus_index maps each to an index)
INDEX_CHOICES = ("auto", "flat", "ivf_flat", "ivf_sq8", "ivf_pq", "hnsw")
DEFAULT_SEAL = 20_000  # ~46 MB of float32 keys at d=576 (benchmarks/bench_ingest_growth.py)


@dataclass(frozen=True)
class MilvusURL:
    host: str
    port: int
    collection: str
    # Session: a worker's searches see its own inserts at once, others' within ~0.2 s
    # (the time tick); Strong would make every search wait for the next tick.
    consistency: str = "Session"
    # see MilvusCollection: re-rank IVF_SQ8 / IVF_PQ candidates from their stored keys
    rerank: bool = False
    timeout: float = 60.0  # seconds per call; a server that hangs is an error, not a wait
    # Rows a handle writes before it seals the growing segments (0: never; Milvus seals
    # only by size or age): growing segments are searched by brute force, row by row,
    # sealed ones are indexed. See MilvusCollection and docs/memory.md (item 4).
    seal: int = DEFAULT_SEAL
    # the index above 50k entries: auto (the measured default), flat, ivf_flat, ivf_sq8,
    # ivf_pq or hnsw (memlm.memory.milvus_index; docs/memory.md, "Which index on Milvus")
    index: str = "auto"
    # search parameters over the index's own (None: memlm.memory.milvus_index's rule):
    # HNSW's ef (at least k anyway) and the IVF kinds' lists probed per segment
    ef: int | None = None
    nprobe: int | None = None

    def __str__(self) -> str:
        return f"milvus://{self.host}:{self.port}/{self.collection}"


def parse_memory_url(url: str | None) -> MilvusURL | None:
    """None for the embedded faiss memory; the Milvus address otherwise.

    Raises ``ValueError`` naming what is wrong (settings validate it at start-up).
    """
    if url is None or url.strip() in ("", "faiss"):
        return None
    parts = urlsplit(url.strip())
    if parts.scheme != "milvus":
        raise ValueError(
            f"memory URL must be 'faiss' or milvus://host:port/collection, got {url!r}"
        )
    if not parts.hostname:
        raise ValueError(f"memory URL {url!r} names no host")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError as exc:
        raise ValueError(f"memory URL {url!r}: bad port") from exc
    collection = parts.path.lstrip("/")
    if not _COLLECTION.match(collection):
        raise ValueError(
            f"memory URL {url!r}: the path must be a Milvus collection name "
            "(letters, digits and underscores, not starting with a digit)"
        )
    opts = {k: v[-1] for k, v in parse_qs(parts.query, strict_parsing=False).items()}
    unknown = set(opts) - {"consistency", "rerank", "timeout", "seal", "index", "ef", "nprobe"}
    if unknown:
        raise ValueError(f"memory URL {url!r}: unknown options {sorted(unknown)}")
    consistency = opts.get("consistency", "Session")
    if consistency not in CONSISTENCY_LEVELS:
        raise ValueError(f"memory URL: consistency must be one of {CONSISTENCY_LEVELS}")
    rerank = opts.get("rerank", "0")
    if rerank not in ("0", "1"):
        raise ValueError("memory URL: rerank must be 0 or 1")
    try:
        timeout = float(opts.get("timeout", "60"))
    except ValueError as exc:
        raise ValueError("memory URL: timeout must be a number of seconds") from exc
    if timeout <= 0:
        raise ValueError("memory URL: timeout must be > 0")
    try:
        seal = int(opts.get("seal", str(DEFAULT_SEAL)))
    except ValueError as exc:
        raise ValueError("memory URL: seal must be a number of rows") from exc
    if seal < 0:
        raise ValueError("memory URL: seal must be >= 0")
    index = opts.get("index", "auto")
    if index not in INDEX_CHOICES:
        raise ValueError(f"memory URL: index must be one of {INDEX_CHOICES}, got {index!r}")
    search = {}
    for name in ("ef", "nprobe"):
        if name in opts:
            try:
                search[name] = int(opts[name])
            except ValueError as exc:
                raise ValueError(f"memory URL: {name} must be a whole number") from exc
            if search[name] < 1:
                raise ValueError(f"memory URL: {name} must be >= 1")
    return MilvusURL(
        parts.hostname,
        port,
        collection,
        consistency,
        rerank == "1",
        timeout,
        seal,
        index,
        search.get("ef"),
        search.get("nprobe"),
    )
