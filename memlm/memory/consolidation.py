"""Consolidation at the nightly build: re-test a bounded window of stored entries against
today's memory and retire those that would not be stored today; then keep the memory
budget by retiring what costs least.

Bounded work: each night reads ``sample`` live entries from a cursor persisted under the
memory's root (``consolidation.json``, temp + ``os.replace``) and moves it on, wrapping
at the end, so the whole memory is re-tested once every ``live / sample`` nights and a
night's cost does not grow with the memory. The budget step reads the excess beyond the
budget (itself about one day of ingest) from the memory's first ids under ``age``, and
twice the excess from the cursor on, scored like the window, under the other criteria.

Retiring is ``MemoryBackend.retire`` (faiss: the datastore's retired log, filtered from
every search at once and removed by the build's compaction, like a forgotten document;
Milvus: deleted by id). Crash safety: the cursor moves only after the retirement is
committed; a crash before that re-tests the same window next time, where the entries
already retired are no longer live, so nothing is counted twice (a crashed night's
retirements are counted in no build record: an under-count, never a double one). A
forget racing consolidation: retiring an entry of a forgotten document counts 0 and
brings nothing back (both are deletions).

The test is ``memlm.knnlm.consolidate``; what the budget retires first is ``criterion``:
``spread`` (the default, measured best: docs/results/slice14d-spread): the newest
``recent`` share of the budget stays whole and every older day is thinned to the same
size (:func:`spread`), the entries the LM predicts best going first within a day
(``within``; p_LM per entry: ``memlm.memory.entry_lm``; where it is unknown, the
oldest). Spread retires by day, not by age, so no month is forgotten before the others;
it scores nothing: its cost is one read of every live entry's id and day
(``MemoryBackend.live_days``). Also ``age`` (the oldest ids first; it forgets the earlier
months), ``usage`` (fewest hits of its block, ``memlm.memory.usage``, then most
redundant), ``redundancy`` (highest leave-one-out log-probability today), ``random``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import numpy.typing as npt

from memlm.datastore import SimulatedCrash
from memlm.knnlm import KnnParams
from memlm.knnlm.consolidate import (
    DEFAULT_BUDGET_CRITERION,
    DEFAULT_BUDGET_RECENT,
    Criterion,
    leave_one_out,
    retire_in_turn,
    todays_logprob,
)
from memlm.knnlm.policy import DEFAULT_DELTA
from memlm.memory.base import MemoryBackend
from memlm.memory.usage import Usage

STATE_FILE = "consolidation.json"
LAST_FILE = "consolidation-last.json"  # the last night's report (``/admin/stats``)
# Where ``consolidate(crash_at=...)`` stops, in order.
CONSOLIDATE_CRASH_POINTS = (
    "consolidate_after_test",  # the window tested, nothing retired
    "consolidate_after_retire",  # the failures retired, the cursor not moved
    "consolidate_after_budget",  # the budget's retirements done, the cursor moved
)
CRITERIA: tuple[str, ...] = get_args(Criterion)
# How spread orders a day's entries (what goes first): lm, the best predicted by the LM
# where p_LM is known (else the oldest); oldest; usage, the fewest hits of the block (then
# the best predicted); random. lm measured best (docs/results/slice14d-spread).
SpreadRank = Literal["lm", "oldest", "usage", "random"]
SPREAD_RANKS: tuple[str, ...] = get_args(SpreadRank)


@dataclass(frozen=True)
class ConsolidationConfig:
    """What the nightly consolidation does (``Settings``: MEMLM_CONSOLIDATE_*,
    MEMLM_MEMORY_BUDGET_ENTRIES)."""

    # entries re-tested a night; 0: no re-test (the budget alone). 4096 searches are
    # ~30 s on one CPU thread at k=64 (about what 6 documents of ingest cost)
    sample: int = 0
    delta: float = DEFAULT_DELTA  # MoNIM's threshold, the one the policy stores with
    budget: int | None = None  # live entries kept after a build; None: no budget
    # measured best on slice14d (docs/results/slice14d-spread; Settings.budget_criterion)
    criterion: Criterion = DEFAULT_BUDGET_CRITERION
    seed: int = 0  # the random criterion's
    # spread: the share of the budget that keeps the newest entries whole; the rest is
    # shared evenly by the older days (``spread``)
    recent: float = DEFAULT_BUDGET_RECENT
    within: SpreadRank = "lm"  # spread: what goes first within a day

    @property
    def active(self) -> bool:
        return self.sample > 0 or self.budget is not None

    @property
    def spread_recent(self) -> float | None:
        """The share of the budget kept for the newest entries (None: not spread)."""
        return self.recent if self.criterion == "spread" else None


@dataclass
class ConsolidationReport:
    """What one night's consolidation did (the build record's ``consolidation``)."""

    examined: int = 0  # entries re-tested
    failed: int = 0  # of them, would not be stored today
    retired: dict[str, int] = field(default_factory=lambda: {"test": 0, "budget": 0})
    cursor: tuple[int, int] = (0, 0)  # (from, to)
    wrapped: bool = False  # the window reached the end of the memory
    budget: int | None = None
    criterion: str = DEFAULT_BUDGET_CRITERION
    recent: float | None = None  # spread: the share of the budget kept for the newest
    live_before: int = 0
    live_after: int = 0
    seconds: float = 0.0
    # hits and retrievals (of their blocks) of what was retired, per reason
    retired_usage: dict[str, list[int]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["cursor"] = list(self.cursor)
        return out


def _crash(crash_at: str | None, point: str) -> None:
    if crash_at == point:
        raise SimulatedCrash(f"consolidation: {point}")


def read_cursor(root: Path) -> int:
    path = root / STATE_FILE
    if not path.exists():
        return 0
    return int(json.loads(path.read_text(encoding="utf-8")).get("cursor", 0))


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_cursor(root: Path, cursor: int) -> None:
    _write_json(root / STATE_FILE, {"cursor": int(cursor)})


def read_last(root: Path) -> dict[str, Any] | None:
    """The last night's report saved by ``consolidate`` (None before the first)."""
    path = root / LAST_FILE
    if not path.exists():
        return None
    out: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return out


def score_today(
    memory: MemoryBackend,
    ids: npt.NDArray[np.int64],
    keys: npt.NDArray[np.float32],
    values: npt.NDArray[np.int32],
    params: KnnParams,
    lm_logprob: Callable[[npt.NDArray[np.int64]], np.ndarray] | None = None,
) -> np.ndarray:
    """(n,) log p(value) of each stored entry under today's memory with itself left out."""
    if not len(ids):
        return np.empty(0)
    nb = memory.search(keys, params.k + 1)
    n_ids, n_d, n_v = leave_one_out(ids, nb.ids, nb.distances, nb.values, params.k)
    lm = None if lm_logprob is None else lm_logprob(ids)
    return todays_logprob(values, n_ids, n_d, n_v, params, lm)


def _rank(
    cfg: ConsolidationConfig, ids: np.ndarray, lp: np.ndarray, usage: Usage
) -> npt.NDArray[np.intp]:
    """Order in which the budget retires the pool: what costs least first."""
    if cfg.criterion == "random":
        return np.random.default_rng([cfg.seed, len(ids)]).permutation(len(ids))
    if cfg.criterion == "redundancy":
        return np.lexsort((ids, -lp))
    hits, _ = usage.of(ids)
    return np.lexsort((ids, -lp, hits))  # fewest hits, then most redundant, then oldest


def _within_day(
    cfg: ConsolidationConfig,
    ids: npt.NDArray[np.int64],
    usage: Usage,
    lm_logprob: Callable[[npt.NDArray[np.int64]], np.ndarray] | None,
) -> np.ndarray:
    """The spread budget's order within a day: the lowest goes first (ties: the oldest)."""
    if cfg.within == "random":
        return np.random.default_rng([cfg.seed, len(ids)]).random(len(ids))
    lm = None if lm_logprob is None or cfg.within == "oldest" else lm_logprob(ids)
    if cfg.within == "usage":
        hits = usage.of(ids)[0].astype(np.float64)
        return hits if lm is None else hits - 1e-3 * np.exp(lm)
    if cfg.within == "lm" and lm is not None:
        return -np.asarray(lm, np.float64)
    return np.zeros(len(ids))  # oldest, or lm without p_LM (NaN ranks last: kept)


def _pool(
    memory: MemoryBackend,
    root: Path,
    ids: npt.NDArray[np.int64],
    lp: np.ndarray,
    want: int,
    live: int,
    params: KnnParams,
    lm_logprob: Callable[[npt.NDArray[np.int64]], np.ndarray] | None,
) -> tuple[npt.NDArray[np.int64], np.ndarray]:
    """The budget's candidates: the night's re-tested survivors, then entries read (and
    scored) from the cursor on until ``want`` of them, or the whole memory once."""
    pos, seen = read_cursor(root), 0
    while len(ids) < want and seen < live:
        sc = memory.scan(pos, want - len(ids))
        if not len(sc.ids) and pos == 0:
            break  # nothing live at all
        seen += len(sc.ids)
        new = ~np.isin(sc.ids, ids)
        more = score_today(memory, sc.ids[new], sc.keys[new], sc.values[new], params, lm_logprob)
        ids, lp = np.concatenate([ids, sc.ids[new]]), np.concatenate([lp, more])
        pos = sc.next_cursor
    return ids, lp


def water_fill(counts: npt.NDArray[np.int64], total: int) -> npt.NDArray[np.int64]:
    """How many of each group to keep so that ``total`` are kept and no group keeps more
    than it has: every group keeps min(its count, c) for one level c, and the remainder
    goes one each to the last groups over the level."""
    counts = np.asarray(counts, np.int64)
    if total >= counts.sum():
        return counts.copy()
    lo, hi = 0, int(counts.max())  # the largest c with sum(min(counts, c)) <= total
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if np.minimum(counts, mid).sum() <= total:
            lo = mid
        else:
            hi = mid - 1
    keep = np.minimum(counts, lo)
    extra = np.flatnonzero(counts > lo)[::-1][: max(0, total - int(keep.sum()))]
    keep[extra] += 1
    return keep


def spread(
    ids: npt.NDArray[np.int64],
    days: npt.NDArray[np.int32],
    excess: int,
    recent: int,
    rank: npt.NDArray[np.float64],
) -> npt.NDArray[np.int64]:
    """The ``excess`` entries a spread budget retires. ``ids`` (ascending) and ``days``:
    every live entry. The newest ``recent`` entries are kept whole; the older ones are
    thinned so that each day keeps the same number of entries at most
    (:func:`water_fill`), so no day (no month) is forgotten before the others. Within a
    day, the lowest ``rank`` goes first (then the oldest)."""
    old = max(0, len(ids) - recent)
    if excess >= old:  # the older days cannot give enough: the newest go by age
        return ids[: min(excess, len(ids))]
    _, inv, counts = np.unique(days[:old], return_inverse=True, return_counts=True)
    give = counts - water_fill(counts, old - excess)
    order = np.lexsort((ids[:old], rank[:old], inv))  # by day, then rank, then id
    start = np.concatenate([[0], np.cumsum(counts)[:-1]])
    nth = np.arange(old) - start[inv[order]]  # place of each entry within its day
    return np.sort(ids[:old][order][nth < give[inv[order]]])


def consolidate(
    memory: MemoryBackend,
    cfg: ConsolidationConfig,
    params: KnnParams,
    usage: Usage,
    *,
    state: Path | None = None,
    lm_logprob: Callable[[npt.NDArray[np.int64]], np.ndarray] | None = None,
    crash_at: str | None = None,
) -> ConsolidationReport:
    """One night's consolidation of ``memory`` (the caller holds the build lock and is
    the memory's writer). ``state``: where the cursor lives (default: the memory's root).
    ``lm_logprob``: log p_LM of each entry's value, where known (``todays_logprob``)."""
    if crash_at is not None and crash_at not in CONSOLIDATE_CRASH_POINTS:
        raise ValueError(f"crash_at must be one of {CONSOLIDATE_CRASH_POINTS}, got {crash_at!r}")
    t0 = time.perf_counter()
    root = state or memory.root
    rep = ConsolidationReport(budget=cfg.budget, criterion=cfg.criterion, recent=cfg.spread_recent)
    rep.live_before = memory.count()
    start = read_cursor(root)
    pool_ids = np.empty(0, np.int64)
    pool_lp = np.empty(0)
    if cfg.sample > 0:
        sc = memory.scan(start, cfg.sample)
        fail, lp = np.zeros(0, dtype=bool), np.empty(0)
        if len(sc.ids):
            # 2k + 1 neighbours: the entry itself and a margin for retired ones
            nb = memory.search(sc.keys, 2 * params.k + 1)
            lm = None if lm_logprob is None else lm_logprob(sc.ids)
            fail, lp = retire_in_turn(
                sc.ids, sc.values, nb.ids, nb.distances, nb.values, params, cfg.delta, lm
            )
        rep.examined, rep.failed = len(sc.ids), int(fail.sum())
        _crash(crash_at, "consolidate_after_test")
        rep.retired["test"] = memory.retire(sc.ids[fail]) if fail.any() else 0
        rep.retired_usage["test"] = [int(x.sum()) for x in usage.of(sc.ids[fail])]
        _crash(crash_at, "consolidate_after_retire")
        rep.cursor, rep.wrapped = (start, sc.next_cursor), sc.next_cursor == 0
        write_cursor(root, sc.next_cursor)
        pool_ids, pool_lp = sc.ids[~fail], lp[~fail]
    live = memory.count()
    if cfg.budget is not None and live > cfg.budget:
        excess = live - cfg.budget
        if cfg.criterion == "age":  # the oldest live entries: the first ids, nothing to score
            chosen = memory.scan(0, excess).ids
        elif cfg.criterion == "spread":  # no search: the days, and p_LM where known
            ids, days = memory.live_days()
            rank = _within_day(cfg, ids, usage, lm_logprob)
            chosen = spread(ids, days, excess, int(cfg.recent * cfg.budget), rank)
        else:
            pool_ids, pool_lp = _pool(
                memory, root, pool_ids, pool_lp, 2 * excess, live, params, lm_logprob
            )
            chosen = pool_ids[_rank(cfg, pool_ids, pool_lp, usage)[:excess]]
        rep.retired["budget"] = memory.retire(chosen)
        rep.retired_usage["budget"] = [int(x.sum()) for x in usage.of(chosen)]
        _crash(crash_at, "consolidate_after_budget")
    rep.live_after = memory.count()
    rep.seconds = round(time.perf_counter() - t0, 3)
    _write_json(root / LAST_FILE, rep.to_json())
    return rep
