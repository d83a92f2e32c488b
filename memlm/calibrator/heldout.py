"""Held-out tokens for the served calibrator, recorded while documents are ingested.

Every document is scored against the memory served *before* its own entries are
appended, so its tokens are held out with respect to that memory, exactly as a dev
document searched at that moment would be. For a seeded share of documents (and the first
document of each day, so small streams get some) the engine keeps what the calibrator
trains on: per token log p_LM(gold), the distances and values of max(k, 10) neighbours,
the gold token, max log p_LM, the entropy, the lexical features before the document was
counted, the day and the document id (the fields of ``ServedCalibration.train``).

Each record is one file ``<root>/d<day>-doc<id>-n<tokens>.npz`` written as temp +
``os.replace``. The first record of a document wins: a document re-processed after a
crash between the datastore append and the database commit finds its record (or its
rows in the training set) and records nothing again. At the nightly rebuild the pending
records join the calibrator's training set and are deleted.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from memlm.datastore.durable import atomic_savez

PENDING_DIR = "calibrator-pending"
_NAME = re.compile(r"^d(-?\d+)-doc(-?\d+)-n(\d+)\.npz$")
# The arrays of one record; 2-D ones are (n, K) with K = max(k, 10) at recording time.
FIELDS = (
    "target_lm_logprob",
    "distances",
    "values",
    "gold",
    "top_logprob",
    "entropy",
    "lexical",
    "day",
    "doc",
)
# Kept since the evidence interpolation (memlm.calibrator.evidence); a record or training
# set written before lacks them and reads as: no query norm, no seen view.
#   qnorm: (n,) squared L2 norm of each query key; context: (n,) tokens before each;
#   seen_distances / seen_values: (n, K) the same search with the document's own stored
#   entries in memory (what a user asking along the text they just ingested gets).
OPTIONAL_FIELDS = ("qnorm", "context", "seen_distances", "seen_values")
# what a missing neighbour looks like
_PAD = {"distances": np.inf, "values": -1, "seen_distances": np.inf, "seen_values": -1}


def complete(part: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``part`` with every optional field (missing ones filled as "not recorded")."""
    n, width = part["values"].shape if part["values"].ndim == 2 else (len(part["day"]), 0)
    out = dict(part)
    out.setdefault("qnorm", np.full(n, np.nan, np.float32))
    out.setdefault("context", np.full(n, np.nan, np.float32))
    out.setdefault("seen_distances", np.full((n, width), np.inf, np.float32))
    out.setdefault("seen_values", np.full((n, width), -1, np.int32))
    return out


@dataclass(frozen=True)
class HeldOutConfig:
    """Which ingested documents the engine records for the calibrator, and when it trains."""

    enabled: bool = False  # the engine records nothing unless the service turns it on
    share: float = 0.05  # seeded share of documents (the paper holds out ~10 articles a day)
    day_tokens: int = 2048  # per day: ~1 MB of records at k = 64 (560 bytes per token)
    min_tokens: int = 1024  # below this the rebuild skips training (MEMLM_CALIBRATOR_MIN_TOKENS)
    # the training set keeps the newest this many tokens (64 days at the cap, ~70 MB)
    max_tokens: int = 131_072
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0:
            raise ValueError("the calibrator sample share must be in [0, 1]")
        if self.day_tokens < 1 or self.min_tokens < 1:
            raise ValueError("day_tokens and min_tokens must be >= 1")
        if self.max_tokens < self.min_tokens:
            raise ValueError(
                f"max_tokens ({self.max_tokens}) must be at least min_tokens ({self.min_tokens})"
            )


def sampled(cfg: HeldOutConfig, doc_id: int) -> bool:
    """The seeded draw of one document: the same answer every time it is processed."""
    draw = zlib.crc32(f"{cfg.seed}:{doc_id}".encode()) / 2**32
    return draw < cfg.share


def stack(parts: Iterable[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Concatenate records; neighbour arrays of different widths are padded to the widest."""
    parts = [complete(p) for p in parts if len(p["day"])]
    if not parts:
        return {}
    width = max(max(p["values"].shape[1], p["seen_values"].shape[1]) for p in parts)
    out: dict[str, list[np.ndarray]] = {k: [] for k in parts[0]}
    for p in parts:
        for k, v in p.items():
            if k in _PAD and v.shape[1] < width:
                v = np.pad(v, ((0, 0), (0, width - v.shape[1])), constant_values=_PAD[k])
            out[k].append(v)
    return {k: np.concatenate(v) for k, v in out.items()}


@dataclass(frozen=True)
class Pending:
    """The records waiting for the next rebuild: their files and tokens per day."""

    paths: tuple[Path, ...]
    docs: frozenset[int]
    day_tokens: dict[int, int]

    @property
    def tokens(self) -> int:
        return sum(self.day_tokens.values())


class HeldOutRecorder:
    """Decides which documents to record and writes their records (single writer)."""

    def __init__(self, root: Path, cfg: HeldOutConfig):
        self.root = Path(root)
        self.cfg = cfg

    def pending(self) -> Pending:
        """The records on disk now (read from the file names only)."""
        paths: list[Path] = []
        docs: set[int] = set()
        days: dict[int, int] = {}
        if self.root.exists():
            for p in sorted(self.root.iterdir()):
                m = _NAME.match(p.name)
                if m is None:
                    continue
                day, doc, n = (int(g) for g in m.groups())
                paths.append(p)
                docs.add(doc)
                days[day] = days.get(day, 0) + n
        return Pending(tuple(paths), frozenset(docs), days)

    def budget(
        self, doc_id: int, day: int, trained_docs: set[int], trained_day_tokens: dict[int, int]
    ) -> int:
        """How many of the document's tokens to record (0: none).

        ``trained_docs`` and ``trained_day_tokens`` describe the calibrator's training set,
        so a document already merged is not recorded again and the day cap counts it.
        """
        if not self.cfg.enabled or doc_id in trained_docs:
            return 0
        pend = self.pending()
        if doc_id in pend.docs:  # first record wins (a re-run after a crash)
            return 0
        used = pend.day_tokens.get(day, 0) + trained_day_tokens.get(day, 0)
        if used and not sampled(self.cfg, doc_id):
            return 0
        return max(0, self.cfg.day_tokens - used)

    def rows(self, doc_id: int, n: int, budget: int) -> np.ndarray:
        """The token rows to keep: all of them, or a seeded spread of ``budget`` of them."""
        if n <= budget:
            return np.arange(n)
        rng = np.random.default_rng([self.cfg.seed, zlib.crc32(str(doc_id).encode())])
        return np.sort(rng.choice(n, budget, replace=False))

    def record(self, doc_id: int, day: int, arrays: dict[str, np.ndarray]) -> Path:
        """Write one document's record atomically."""
        assert set(FIELDS) <= set(arrays) <= set(FIELDS + OPTIONAL_FIELDS), sorted(arrays)
        n = len(arrays["day"])
        assert all(len(v) == n for v in arrays.values())
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f"d{day}-doc{doc_id}-n{n}.npz"
        atomic_savez(path, self.root / f".tmp-{path.name}", dict(arrays))
        return path

    @staticmethod
    def load(paths: Iterable[Path]) -> dict[str, np.ndarray]:
        """The records of ``paths`` as one set of arrays (empty dict when there are none)."""
        parts = []
        for p in paths:
            with np.load(p) as z:
                parts.append({k: z[k] for k in FIELDS + OPTIONAL_FIELDS if k in z.files})
        return stack(parts)

    def remove(self, paths: Iterable[Path]) -> None:
        """Delete merged records (and temp files a crash left half written)."""
        for p in paths:
            p.unlink(missing_ok=True)
        if self.root.exists():
            for p in self.root.glob(".tmp-*"):
                p.unlink(missing_ok=True)

    def drop_document(self, doc_id: int) -> int:
        """Delete the pending record of a forgotten document; returns its token count."""
        gone = 0
        for p in self.pending().paths:
            m = _NAME.match(p.name)
            if m is not None and int(m.group(2)) == doc_id:
                gone += int(m.group(3))
                p.unlink(missing_ok=True)
        return gone
