"""RetoMaton's pointers (memlm.memory.pointers) against the full search they stand in for."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from memlm.datastore import Datastore
from memlm.index import IndexParams, MemoryIndex, build_index
from memlm.memory import open_memory
from memlm.memory.pointers import PointerConfig, PointerSearch

DIM = 16
COPIES = 4  # the memory holds the text this many times: its top 4 are those copies


def _memory(tmp_path: Path) -> tuple[MemoryIndex, np.ndarray, np.ndarray]:
    """An exact memory holding one text (keys, next tokens) in COPIES documents, plus 2,000
    unrelated entries of other documents."""
    rng = np.random.default_rng(0)
    n = 60
    keys = (rng.standard_normal((n, DIM)) * 4).astype(np.float16)
    gold = rng.integers(0, 50, n)
    ds = Datastore.open(tmp_path / "ds", dim=DIM)
    for doc in range(COPIES):
        ds.append(keys, gold, doc, np.arange(1, n + 1), 0)
    other = rng.standard_normal((2000, DIM)).astype(np.float16)
    ds.append(other, rng.integers(0, 50, 2000), 10 + np.arange(2000) // 100, np.arange(2000), 0)
    build_index(ds, tmp_path / "ix", IndexParams.exact(), progress=False)
    return MemoryIndex(ds, tmp_path / "ix"), keys.astype(np.float32), gold


def test_successors_are_the_next_position_of_the_same_document(tmp_path: Path) -> None:
    index, keys, gold = _memory(tmp_path)
    q = keys[:3]
    prev = np.array([[0, 60, 59], [119, -1, 240], [5, 6, -1]])  # 59, 119: a document's last
    d, ids, vals = index.successors(q, prev)
    assert [sorted(r[r >= 0].tolist()) for r in ids] == [[1, 61], [241], [6, 7]]
    found = ids >= 0
    exact = (index.datastore.keys(ids[found]).astype(np.float32) - q[np.nonzero(found)[0]]) ** 2
    np.testing.assert_allclose(d[found], exact.sum(1), rtol=1e-5)
    np.testing.assert_array_equal(vals[found], index.datastore.values(ids[found]))
    assert all((np.diff(r[np.isfinite(r)]) >= 0).all() for r in d) and np.isinf(d[~found]).all()
    index.datastore.delete_document(1)  # forgotten: its entries are never followed
    _, ids, _ = index.successors(q, prev)
    assert sorted(ids[0][ids[0] >= 0].tolist()) == [1]


def test_pointers_give_the_full_search_where_they_answer_and_fall_back_elsewhere(
    tmp_path: Path,
) -> None:
    index, keys, gold = _memory(tmp_path)
    full = lambda q, k: index.search_values(q, k)  # noqa: E731
    ps = PointerSearch(full, index.successors, COPIES, PointerConfig(min_hits=COPIES, slack=2.0))
    # a text the memory holds: after the first token (searched), the copies' successors
    d, ids, vals, followed = ps.document(keys, gold)
    fd, fids, fvals = index.search_values(keys, COPIES)
    assert followed[0] == False and followed[1:].sum() >= 50  # noqa: E712
    np.testing.assert_array_equal(np.sort(ids[followed], 1), np.sort(fids[followed], 1))
    np.testing.assert_allclose(d[followed], fd[followed], atol=1e-3)  # BLAS rounding
    np.testing.assert_array_equal(vals[~followed], fvals[~followed])
    assert ps.stats.searched == ps.stats.tokens - ps.stats.followed == int((~followed).sum())
    # a text it does not hold: every token falls back to the search
    other = np.random.default_rng(9).standard_normal((30, DIM)).astype(np.float32) * 4
    before = ps.stats.searched
    d, ids, vals, followed = ps.document(other, np.arange(30))
    assert not followed.any() and ps.stats.searched == before + 30
    fd, fids, _ = index.search_values(other, COPIES)
    np.testing.assert_array_equal(ids, fids)


def test_the_text_goes_elsewhere_half_way(tmp_path: Path) -> None:
    """The copies' successors stop where the text leaves them: the search takes over."""
    index, keys, gold = _memory(tmp_path)
    full = lambda q, k: index.search_values(q, k)  # noqa: E731
    ps = PointerSearch(full, index.successors, COPIES, PointerConfig(min_hits=2, slack=2.0))
    mixed = keys.copy()
    mixed[30:] = np.random.default_rng(5).standard_normal((30, DIM)) * 4
    _, _, _, followed = ps.document(mixed, gold)
    assert followed[1:30].all() and not followed[30:].any()


def test_the_threshold_must_be_beaten_and_block_searches_ahead(tmp_path: Path) -> None:
    index, keys, gold = _memory(tmp_path)
    calls: list[int] = []

    def full(q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        calls.append(len(q))
        return index.search_values(q, k)

    strict = PointerSearch(full, index.successors, COPIES, PointerConfig(min_hits=COPIES + 1))
    _, _, _, followed = strict.document(keys, gold)  # 4 copies can never give 5 hits
    assert not followed.any() and calls == [1] * len(keys)
    calls.clear()
    block = PointerSearch(full, index.successors, COPIES, PointerConfig(min_hits=100, block=8))
    block.document(keys, gold)
    assert calls == [8] * 7 + [4] and block.stats.searched == 60
    with pytest.raises(ValueError):
        PointerConfig(min_hits=0)


def test_the_faiss_memory_follows_like_its_index(tmp_path: Path) -> None:
    mem = open_memory(None, tmp_path / "data", DIM)
    rng = np.random.default_rng(1)
    keys = rng.standard_normal((20, DIM)).astype(np.float32)
    with mem.writer():
        mem.put_document(3, keys, np.arange(20), np.arange(1, 21), 19000)
        mem.put_document(4, keys, np.arange(20), np.arange(1, 21), 19000)
    d, ids, vals = mem.successors(keys[1:3], np.array([[0, 20], [19, 39]]))
    assert ids.tolist() == [[1, 21], [-1, -1]]
    assert vals.tolist() == [[1, 1], [-1, -1]]
    mem.close()


def test_documents_from_two_threads_at_once(tmp_path: Path) -> None:
    """The engine's /score and its ingest worker share one pointer state."""
    import threading

    index, keys, gold = _memory(tmp_path)
    ps = PointerSearch(
        lambda q, k: index.search_values(q, k), index.successors, COPIES, PointerConfig(2, 2.0)
    )
    solo = PointerSearch(
        lambda q, k: index.search_values(q, k), index.successors, COPIES, PointerConfig(2, 2.0)
    )
    solo.document(keys, gold)
    expected = solo.document(keys, gold)  # with a threshold learned, as in the threads
    ps.document(keys, gold)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(20):
                got = ps.document(keys, gold)
                np.testing.assert_array_equal(got[1], expected[1])
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and ps.stats.tokens == 41 * len(keys)
