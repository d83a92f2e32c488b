"""Consolidation at the nightly build (memlm.memory.consolidation) on every backend:
the leave-one-out test against a brute-force oracle, the rotating cursor, a crash at each
point, a forget racing it, and the memory budget."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from memlm.datastore import SimulatedCrash
from memlm.knnlm import KnnParams
from memlm.memory import MemoryBackend, open_memory
from memlm.memory.consolidation import (
    CONSOLIDATE_CRASH_POINTS,
    ConsolidationConfig,
    ConsolidationReport,
    consolidate,
    read_cursor,
    spread,
    water_fill,
)
from memlm.memory.usage import Usage

DIM = 16
DAY = 19000
PARAMS = KnnParams(k=4, temperature=1.0, lmbda=0.25)


@pytest.fixture(params=["faiss", pytest.param("milvus", marks=pytest.mark.milvus)])
def memory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MemoryBackend]:
    url = None if request.param == "faiss" else request.getfixturevalue("milvus_url")
    mem = open_memory(url, tmp_path / "data", DIM)
    yield mem
    mem.close()


def _fill(mem: MemoryBackend, seed: int = 0) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Three documents: near-copies of two contexts (same value: redundant), and
    scattered entries of distinct values (each one alone: kept)."""
    rng = np.random.default_rng(seed)
    docs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for doc in (1, 2):  # 4 near-copies of one key per document, value 7 or 8
        base = rng.standard_normal(DIM) * 20
        keys = base + 0.01 * rng.standard_normal((4, DIM))
        docs[doc] = (keys.astype(np.float32), np.full(4, 6 + doc))
    docs[3] = (
        (rng.standard_normal((8, DIM)) * 20).astype(np.float32),
        np.arange(100, 108),
    )
    with mem.writer():
        for doc, (keys, vals) in docs.items():
            mem.put_document(doc, keys, vals, np.arange(1, len(vals) + 1), DAY)
    mem.build()
    mem.reload()
    return docs


def _live(mem: MemoryBackend) -> dict[int, tuple[np.ndarray, int]]:
    """id -> (key, value) of every live entry (read through ``scan``)."""
    sc = mem.scan(0, 1000)
    return {int(i): (k, int(v)) for i, k, v in zip(sc.ids, sc.keys, sc.values, strict=True)}


def _oracle(entries: dict[int, tuple[np.ndarray, int]], delta: float) -> set[int]:
    """Brute force, in id order: retire an entry when its value's probability among its k
    nearest others (less those already retired) reaches exp(delta) (p_LM taken as 0)."""
    gone: set[int] = set()
    for i in sorted(entries):
        key, v = entries[i]
        others = [j for j in sorted(entries) if j != i and j not in gone]
        d = np.array([((entries[j][0].astype(np.float64) - key) ** 2).sum() for j in others])
        near = np.argsort(d, kind="stable")[: PARAMS.k]
        w = np.exp(-(d[near] - d[near].min()) / PARAMS.temperature)
        p = w[[entries[others[j]][1] == v for j in near]].sum() / w.sum()
        if p > 0 and np.log(PARAMS.lmbda * p) >= delta:
            gone.add(i)
    return gone


def test_retires_what_fails_the_test_and_keeps_what_passes(memory: MemoryBackend) -> None:
    _fill(memory)
    before = _live(memory)
    expected = _oracle(before, -1.5)
    assert len(expected) == 6  # 3 of each 4 near-copies; the scattered ones pass
    cfg = ConsolidationConfig(sample=100)
    rep = consolidate(memory, cfg, PARAMS, Usage())
    after = _live(memory)
    assert set(before) - set(after) == expected
    assert rep.examined == 16 and rep.failed == 6 and rep.retired == {"test": 6, "budget": 0}
    assert memory.count() == 10 and rep.live_after == 10
    memory.build()  # the next version holds only what is live
    memory.reload()
    assert memory.build().entries == 10
    # the survivor of each pair of near-copies still answers its context
    for doc in (1, 2):
        survivors = [i for i in after if after[i][1] == 6 + doc]
        assert len(survivors) == 1


def test_a_known_lm_probability_retires_more(memory: MemoryBackend) -> None:
    """With p_LM known, an entry the LM alone already predicts (log p >= delta) fails."""
    _fill(memory)
    live = _live(memory)
    scattered = sorted(i for i in live if live[i][1] >= 100)
    lm = {i: (-0.1 if i in scattered[:3] else -20.0) for i in live}
    rep = consolidate(
        memory,
        ConsolidationConfig(sample=100),
        PARAMS,
        Usage(),
        lm_logprob=lambda ids: np.array([lm[int(i)] for i in ids]),
    )
    assert rep.retired["test"] == 6 + 3
    assert not set(scattered[:3]) & set(_live(memory))


def test_the_cursor_rotates_and_bounds_the_work(memory: MemoryBackend) -> None:
    _fill(memory)
    cfg = ConsolidationConfig(sample=5, delta=10.0)  # delta 10: nothing fails
    seen: list[tuple[int, int]] = []
    examined = []
    for _ in range(4):
        rep = consolidate(memory, cfg, PARAMS, Usage())
        seen.append(rep.cursor)
        examined.append(rep.examined)
    ids = sorted(_live(memory))
    assert examined == [5, 5, 5, 1]  # 16 entries: 5 + 5 + 5 + the last one, then wrap
    assert seen[0][0] == 0 and seen[1][0] == ids[5] and seen[2][0] == ids[10]
    assert seen[3] == (ids[15], 0) and read_cursor(memory.root) == 0
    assert consolidate(memory, cfg, PARAMS, Usage()).cursor == (0, ids[5])


@pytest.mark.parametrize("point", CONSOLIDATE_CRASH_POINTS)
def test_a_crash_at_each_point_counts_nothing_twice(
    memory: MemoryBackend, tmp_path: Path, point: str
) -> None:
    _fill(memory)
    served = memory.served_version
    cfg = ConsolidationConfig(sample=100, budget=8)
    with pytest.raises(SimulatedCrash):
        consolidate(memory, cfg, PARAMS, Usage(), crash_at=point)
    assert memory.served_version == served  # no build ran: the version served stays
    mem = memory
    if mem.name == "faiss":  # the crashed handle is closed: a new writer opens the path
        mem.close()
        mem = open_memory(None, tmp_path / "data", DIM)
    after_crash = mem.count()
    rep = consolidate(mem, cfg, PARAMS, Usage())
    done_before = 16 - after_crash
    assert done_before + rep.retired["test"] + rep.retired["budget"] == 16 - 8
    assert mem.count() == 8
    if point == "consolidate_after_test":
        assert done_before == 0 and rep.retired == {"test": 6, "budget": 2}
    if point == "consolidate_after_retire":  # the same window again: nothing new fails
        assert done_before == 6 and rep.retired == {"test": 0, "budget": 2}
    if point == "consolidate_after_budget":
        assert done_before == 8 and rep.retired == {"test": 0, "budget": 0}
    if mem is not memory:
        mem.close()


def forget_racing_consolidation(
    memory: MemoryBackend,
) -> tuple[dict[int, tuple[np.ndarray, np.ndarray]], ConsolidationReport]:
    """The three documents stored, then consolidated; document 1 forgotten after the
    consolidation read its window (also scripts/stress_milvus_forget.py)."""
    docs = _fill(memory)
    scan = memory.scan

    def scan_then_forget(cursor: int, limit: int):  # type: ignore[no-untyped-def]
        out = scan(cursor, limit)
        with memory.writer():
            memory.delete_document(1)
        return out

    memory.scan = scan_then_forget  # type: ignore[method-assign]
    try:
        return docs, consolidate(memory, ConsolidationConfig(sample=100), PARAMS, Usage())
    finally:
        del memory.scan


def test_a_forget_racing_consolidation_never_brings_entries_back(memory: MemoryBackend) -> None:
    """Document 1 is forgotten after consolidation read its window, before it retires:
    its entries stay gone, and are counted by neither."""
    docs, rep = forget_racing_consolidation(memory)
    # searched after the forget, document 1's near-copies have no neighbours left to
    # make them redundant (they pass); document 2's 3 of 4 fail and are retired
    assert rep.failed == 3 and rep.retired["test"] == 3
    assert memory.count() == 16 - 4 - 3
    memory.compact()
    memory.build()
    memory.reload()
    _, ids, _ = memory.search(docs[1][0], 4)
    found = memory.provenance(ids[ids >= 0]).documents
    assert 1 not in set(found.tolist())
    assert memory.count() == 9


@pytest.mark.parametrize("criterion", ["usage", "age", "redundancy", "random", "spread"])
def test_the_budget_is_kept_after_a_build(memory: MemoryBackend, criterion: str) -> None:
    _fill(memory)
    usage = Usage(block=1)
    live = _live(memory)
    scattered = sorted(i for i in live if live[i][1] >= 100)
    # the scattered entries were retrieved and helped, except the last two
    used = np.array(scattered[:-2], np.int64)
    usage.add(used.reshape(-1, 1), np.array([[live[i][1]] for i in used]), used * 0 + 0)
    usage.add(
        used.reshape(-1, 1), np.array([[live[i][1]] for i in used]), [live[i][1] for i in used]
    )
    cfg = ConsolidationConfig(sample=0, budget=10, criterion=criterion)  # type: ignore[arg-type]
    rep = consolidate(memory, cfg, PARAMS, usage)
    assert rep.retired == {"test": 0, "budget": 6} and memory.count() == 10
    memory.build()
    memory.reload()
    assert memory.count() == 10
    gone = set(live) - set(_live(memory))
    if criterion == "age":
        assert gone == set(sorted(live)[:6])
    if criterion == "usage":  # never-used first: the 8 near-copies and 2 scattered ones
        assert not gone & set(used.tolist())
    assert consolidate(memory, cfg, PARAMS, usage).retired == {"test": 0, "budget": 0}


def test_an_age_budget_retires_the_oldest_wherever_the_cursor_is(memory: MemoryBackend) -> None:
    _fill(memory)
    live = sorted(_live(memory))
    cfg = ConsolidationConfig(sample=5, delta=10.0, budget=12, criterion="age")
    rep = consolidate(memory, cfg, PARAMS, Usage())  # the window moves the cursor to 5
    assert rep.cursor == (0, live[5]) and rep.retired == {"test": 0, "budget": 4}
    assert sorted(_live(memory)) == live[4:]


@pytest.mark.parametrize("seed", range(20))
def test_water_fill_keeps_the_total_at_one_level(seed: int) -> None:
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 30, size=int(rng.integers(1, 12)))
    total = int(rng.integers(0, counts.sum() + 3))
    keep = water_fill(counts, total)
    assert keep.sum() == min(total, counts.sum()) and (keep <= counts).all() and (keep >= 0).all()
    short = keep < counts  # the groups that gave: all at the level, or one above it
    if short.any():
        level = keep[short].min()
        assert keep[short].max() <= level + 1 and (counts[~short] <= level + 1).all()


def _spread_oracle(ids, days, excess, recent, rank):  # type: ignore[no-untyped-def]
    """One at a time: the day (of the older entries) keeping the most gives its lowest
    ranked (then oldest) entry; ties between days: the older day gives."""
    old = max(0, len(ids) - recent)
    if excess >= old:
        return set(ids[:excess].tolist())
    left = {
        d: sorted((rank[i], ids[i]) for i in range(old) if days[i] == d)
        for d in set(days[:old].tolist())
    }
    gone: set[int] = set()
    for _ in range(excess):
        d = max(sorted(left), key=lambda d: len(left[d]))  # first of the largest: the oldest
        gone.add(int(left[d].pop(0)[1]))
    return gone


@pytest.mark.parametrize("seed", range(30))
def test_spread_thins_the_older_days_evenly_as_one_at_a_time_would(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    ids = np.sort(rng.choice(1000, size=n, replace=False)).astype(np.int64)
    days = np.sort(rng.integers(0, 6, size=n)).astype(np.int32)  # appended day by day
    rank = rng.integers(0, 3, size=n).astype(np.float64)
    excess, recent = int(rng.integers(0, n + 1)), int(rng.integers(0, n + 1))
    got = spread(ids, days, excess, recent, rank)
    assert len(got) == excess and set(got.tolist()) == _spread_oracle(
        ids, days, excess, recent, rank
    )


def test_a_spread_budget_keeps_the_newest_and_thins_every_older_day(memory: MemoryBackend) -> None:
    rng = np.random.default_rng(3)
    sizes = {1: 20, 2: 10, 3: 20, 4: 6}  # document (= day offset) -> entries
    with memory.writer():
        for doc, n in sizes.items():
            keys = (rng.standard_normal((n, DIM)) * 20).astype(np.float32)
            memory.put_document(doc, keys, np.arange(n) + 100, np.arange(1, n + 1), DAY + doc)
    memory.build()
    memory.reload()
    cfg = ConsolidationConfig(budget=30, criterion="spread", recent=0.2)  # the newest 6 whole
    rep = consolidate(memory, cfg, PARAMS, Usage())
    assert rep.retired == {"test": 0, "budget": 26} and memory.count() == 30
    ids, days = memory.live_days()
    kept = {d - DAY: int(n) for d, n in zip(*np.unique(days, return_counts=True), strict=True)}
    assert kept == {1: 8, 2: 8, 3: 8, 4: 6}  # 24 for the three older days, 8 each
    assert len(ids) == 30 and (np.diff(ids) > 0).all()


def test_a_spread_budget_retires_what_the_lm_predicts_best_within_a_day(
    memory: MemoryBackend,
) -> None:
    rng = np.random.default_rng(4)
    with memory.writer():
        for doc in (1, 2):
            keys = (rng.standard_normal((10, DIM)) * 20).astype(np.float32)
            memory.put_document(doc, keys, np.arange(10) + 100, np.arange(1, 11), DAY + doc)
    memory.build()
    memory.reload()
    ids, _ = memory.live_days()
    good = set(ids[[1, 4, 6, 13, 17]].tolist())  # the LM predicts these well: they go first

    def lm_logprob(want: np.ndarray) -> np.ndarray:
        return np.array([-0.1 if int(i) in good else -5.0 for i in want])

    cfg = ConsolidationConfig(budget=14, criterion="spread", recent=0.0)
    rep = consolidate(memory, cfg, PARAMS, Usage(), lm_logprob=lm_logprob)
    assert rep.retired["budget"] == 6 and rep.recent == 0.0
    gone = set(ids.tolist()) - set(memory.live_days()[0].tolist())
    assert good <= gone and len(gone & set(ids[:10].tolist())) == 3  # 7 kept a day


@pytest.mark.parametrize("within", ["lm", "oldest", "usage", "random"])
def test_each_within_day_rank_of_spread(within: str) -> None:
    from memlm.memory.consolidation import _within_day

    ids = np.arange(6, dtype=np.int64)
    usage = Usage(block=1)
    usage.add(ids[:3].reshape(-1, 1), np.full((3, 1), 5, np.int32), np.full(3, 5))  # 0-2 hit
    lp = np.array([-0.1, -3.0, -0.2, -4.0, -0.3, -5.0])
    cfg = ConsolidationConfig(budget=1, criterion="spread", within=within)  # type: ignore[arg-type]
    rank = _within_day(cfg, ids, usage, lambda want: lp[want])
    first = list(np.lexsort((ids, rank)))
    if within == "lm":
        assert first == [0, 2, 4, 1, 3, 5]
    if within == "oldest":
        assert first == list(range(6))
        assert (_within_day(cfg, ids, usage, None) == 0).all()
    if within == "usage":
        assert first == [4, 3, 5, 0, 2, 1]  # no hits first, then the best predicted
    if within == "random":
        assert sorted(first) == list(range(6))
    lm_cfg = ConsolidationConfig(budget=1, criterion="spread", within="lm")
    assert (_within_day(lm_cfg, ids, usage, None) == 0).all()  # no p_LM: the oldest


def test_a_forget_racing_a_spread_budget_counts_nothing_twice(memory: MemoryBackend) -> None:
    """Document 1 is forgotten after the spread budget read the live entries, before it
    retires: its entries stay gone, the budget's count is of what it really retired, and
    the memory ends at or under the budget."""
    docs = _fill(memory)
    live_days = memory.live_days

    def read_then_forget():  # type: ignore[no-untyped-def]
        out = live_days()
        with memory.writer():
            memory.delete_document(1)
        return out

    memory.live_days = read_then_forget  # type: ignore[method-assign]
    cfg = ConsolidationConfig(budget=10, criterion="spread", recent=0.0, within="oldest")
    rep = consolidate(memory, cfg, PARAMS, Usage())
    del memory.live_days
    # the 6 oldest (document 1's 4 and 2 of document 2) were chosen; 4 were already gone
    assert rep.retired["budget"] == 2 and rep.live_after == memory.count() == 10
    memory.compact()
    memory.build()
    memory.reload()
    _, ids, _ = memory.search(docs[1][0], 4)
    assert 1 not in set(memory.provenance(ids[ids >= 0]).documents.tolist())
    assert memory.count() == 10
