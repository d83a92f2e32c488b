"""No leakage between memory and evaluation: exact and near-duplicate documents.

Exact duplicates share the hash of their normalised text (case-folded, words only).
Near-duplicates share word 13-grams: a document whose 13-grams are contained in one
earlier document's at ``near_threshold`` or more is dropped from the stream.  Exact
13-gram sets (hashed to 64 bits with blake2b, so runs are reproducible) fit easily at the
bundled stream's size (3,744 documents, ~2.2M 13-grams); MinHash would only pay off far
beyond it.

After planning, every held-out (dev or test) document is compared with the union of the
13-grams of all ingested documents of the plan, every day's: the forgetting re-scores
search the memory of later months too.  Held-out documents over ``eval_threshold`` are
moved out of dev and test and listed in the report, so the headline is on unseen text.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from memlm.corpus import Document
from memlm.evaluate.plan import DayPlan

NGRAM = 13
NEAR_THRESHOLD = 0.5  # share of a document's 13-grams found in one earlier document
EVAL_THRESHOLD = 0.05  # share of a held-out document's 13-grams found in memory

_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    """Case-folded word tokens (punctuation and whitespace dropped)."""
    return _WORD.findall(text.casefold())


def text_hash(text: str) -> str:
    """Hash of the normalised text: equal for texts that differ only in case or punctuation."""
    return hashlib.sha1(" ".join(words(text)).encode()).hexdigest()


def ngrams(text: str, n: int = NGRAM) -> np.ndarray:
    """Sorted unique 64-bit hashes of the word n-grams (a shorter text: its whole word list)."""
    w = words(text)
    grams = [" ".join(w[i : i + n]) for i in range(max(1, len(w) - n + 1))] if w else []
    hashes = {
        int.from_bytes(hashlib.blake2b(g.encode(), digest_size=8).digest(), "little") for g in grams
    }
    return np.array(sorted(hashes), dtype=np.uint64)


@dataclass(frozen=True)
class Dropped:
    doc_id: str
    kind: str  # "exact" or "near"
    duplicate_of: str
    overlap: float  # share of this document's 13-grams in the kept one (1.0 for exact)


@dataclass
class DedupResult:
    kept: list[Document]
    dropped: list[Dropped] = field(default_factory=list)

    def summary(self) -> dict[str, object]:
        return {
            "documents_in": len(self.kept) + len(self.dropped),
            "dropped_exact": sum(d.kind == "exact" for d in self.dropped),
            "dropped_near": sum(d.kind == "near" for d in self.dropped),
            "dropped": [vars(d) for d in self.dropped],
        }


def dedup_stream(
    docs: Sequence[Document], *, near_threshold: float = NEAR_THRESHOLD, n: int = NGRAM
) -> DedupResult:
    """Keep the first of each group of duplicates in stream order (date, then id)."""
    out = DedupResult(kept=[])
    by_hash: dict[str, str] = {}
    owner: dict[int, int] = {}  # 13-gram -> index of the first kept document holding it
    for d in docs:
        h = text_hash(d.text)
        if h in by_hash:
            out.dropped.append(Dropped(d.id, "exact", by_hash[h], 1.0))
            continue
        grams = ngrams(d.text, n)
        hits = Counter(owner[g] for g in grams.tolist() if g in owner)
        if hits and len(grams):
            j, shared = hits.most_common(1)[0]
            if shared / len(grams) >= near_threshold:
                out.dropped.append(Dropped(d.id, "near", out.kept[j].id, shared / len(grams)))
                continue
        by_hash[h] = d.id
        idx = len(out.kept)
        for g in grams.tolist():
            owner.setdefault(g, idx)
        out.kept.append(d)
    return out


def memory_overlap(held_out: Document, memory: np.ndarray, n: int = NGRAM) -> float:
    """Share of ``held_out``'s n-grams found in ``memory`` (sorted unique hashes)."""
    grams = ngrams(held_out.text, n)
    if not len(grams) or not len(memory):
        return 0.0
    return float(np.isin(grams, memory, assume_unique=True).mean())


def union(texts: Iterable[str], n: int = NGRAM) -> np.ndarray:
    parts = [ngrams(t, n) for t in texts]
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.uint64)


def screen_held_out(
    plans: Sequence[DayPlan], *, threshold: float = EVAL_THRESHOLD, n: int = NGRAM
) -> tuple[list[DayPlan], list[dict[str, object]]]:
    """Plans without the held-out documents that overlap the memory by more than ``threshold``.

    The memory is every ingested document of the plan (all days).  Returns the new plans
    and, for every held-out document, its split, day and overlap (``excluded`` when moved).
    """
    memory = union(d.text for p in plans for d in p.train)
    rows: list[dict[str, object]] = []
    new: list[DayPlan] = []
    for p in plans:
        keep: dict[str, list[Document]] = {"dev": [], "test": []}
        for split in ("dev", "test"):
            for d in getattr(p, split):
                share = memory_overlap(d, memory, n)
                excluded = share > threshold
                rows.append(
                    {
                        "doc_id": d.id,
                        "split": split,
                        "day": p.day.isoformat(),
                        "overlap": round(share, 4),
                        "excluded": excluded,
                    }
                )
                if not excluded:
                    keep[split].append(d)
        new.append(replace(p, dev=keep["dev"], test=keep["test"]))
    return new, rows
