"""The memory protocol (memlm.memory.base) on every backend, below the engine: rolling back
what the database did not commit, the records of builds, forgetting and pruning.

The same expectations on the faiss files and on a real Milvus collection; random keys of
16 floats, a few hundred entries.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from memlm.index import list_versions
from memlm.memory import MemoryBackend, open_memory

DIM = 16
DAY = 19000


class Recorded:
    """The database's side in these tests: the documents done and the ranges they own."""

    def __init__(self) -> None:
        self.done: dict[int, range | None] = {}

    def end(self) -> int:
        return max((r.stop for r in self.done.values() if r is not None), default=0)

    def holds(self, doc_ids: Sequence[int]) -> set[int]:
        return {d for d in doc_ids if d in self.done}


@pytest.fixture(params=["faiss", pytest.param("milvus", marks=pytest.mark.milvus)])
def memory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MemoryBackend]:
    url = None if request.param == "faiss" else request.getfixturevalue("milvus_url")
    mem = open_memory(url, tmp_path / "data", DIM)
    yield mem
    mem.close()


def _put(mem: MemoryBackend, doc: int, n: int, seed: int) -> tuple[range | None, np.ndarray]:
    keys = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    with mem.writer():
        span = mem.put_document(doc, keys, np.arange(n) % 7, np.arange(1, n + 1), DAY)
    return span, keys


def _docs_found(mem: MemoryBackend, keys: np.ndarray) -> set[int]:
    _, ids, _ = mem.search(keys, 1)
    return set(mem.provenance(ids[:, 0]).documents.tolist())


def test_what_the_database_did_not_commit_is_rolled_back(memory: MemoryBackend) -> None:
    db = Recorded()
    span, k1 = _put(memory, 1, 40, seed=1)
    db.done[1] = span
    assert span is None or len(span) == 40  # the range to record, where ids are one
    _, k2 = _put(memory, 2, 30, seed=2)  # a try whose commit failed
    assert memory.count() == 70
    with memory.writer():
        assert memory.rollback(db, 2) == 30
    assert memory.count() == 40 and _docs_found(memory, k2) == {1}
    # a try of document 2 that commits, then a worker killed before its commit (3)
    span, k2 = _put(memory, 2, 30, seed=2)
    db.done[2] = span
    _, k3 = _put(memory, 3, 20, seed=3)
    # the next start takes out what no committed document owns
    assert memory.recover(db) == (90, 70)
    assert memory.count() == 70
    assert 3 not in _docs_found(memory, k3) and _docs_found(memory, k2) == {2}
    assert memory.recover(db) == (70, 70)  # nothing left to take out


def test_builds_are_recorded_reconciled_and_pruned_after_a_forget(
    memory: MemoryBackend,
) -> None:
    _put(memory, 1, 40, seed=1)
    _, k2 = _put(memory, 2, 40, seed=2)
    assert memory.served_version is None and memory.deleted_documents == 0
    first = memory.build()
    assert (first.version, first.entries, first.deleted_documents) == (1, 80, 0)
    assert memory.served_version is None  # served after reload
    assert memory.reload() is True and memory.served_version == 1
    assert memory.reload() is False
    assert memory.delete_document(1) == 40
    assert memory.count() == 40 and memory.deleted_documents == 1
    assert [memory.build().version for _ in range(2)] == [2, 3]
    assert memory.reload() is True and memory.served_version == 3
    # the database recorded only 1 and 2: 3 is an orphan (a build killed before its record)
    assert memory.reconcile({1, 2}) == [3] and memory.served_version == 2
    assert memory.reconcile({1, 2}, delete=True) == [3]
    assert list_versions(memory.root) == [1, 2]
    # version 1 was built before the forget: pruned whatever its age
    assert memory.build().version == 3 and memory.reload()
    assert memory.prune(keep=3) == [memory.root / "v000001"]
    assert list_versions(memory.root) == [2, 3]
    stats = memory.stats()
    assert (stats["backend"], stats["entries"]) == (memory.name, 40)
    assert _docs_found(memory, k2) == {2}
    assert memory.delete_document(1) == 0  # forgetting again: nothing left to delete


def test_faiss_search_depth_reaches_the_index(tmp_path: Path) -> None:
    """``search(..., depth=)`` re-ranks that many candidates of the built IVF-PQ version:
    every entry re-ranked is the exact answer, and the default (64 candidates) is not."""
    from memlm.index import IndexParams

    mem = open_memory(None, tmp_path / "data", 32)
    rng = np.random.default_rng(4)
    centres = rng.standard_normal((40, 32)) * 3
    keys = (centres[rng.integers(0, 40, 4000)] + rng.standard_normal((4000, 32))).astype(np.float32)
    with mem.writer():
        for doc in range(8):
            part = keys[doc * 500 : (doc + 1) * 500]
            mem.put_document(doc, part, np.arange(500) % 7, np.arange(1, 501), DAY)
    mem.build(IndexParams(kind="ivfpq", nlist=32, m=4, nprobe=4, train_size=4000, rerank_min=64))
    assert mem.reload()
    q = (keys[rng.integers(0, 4000, 40)] + rng.standard_normal((40, 32)) * 0.5).astype(np.float32)
    exact = ((q[:, None, :] - keys.astype(np.float16).astype(np.float64)[None]) ** 2).sum(-1)
    truth = np.argsort(exact, axis=1, kind="stable")[:, :10]
    _, ids_all, _ = mem.search(q, 10, depth=4000)
    _, ids_default, _ = mem.search(q, 10)
    np.testing.assert_array_equal(ids_all, truth)
    assert not np.array_equal(ids_default, truth)
    mem.close()


def test_faiss_searches_use_the_memorys_threads_on_every_calling_thread(tmp_path: Path) -> None:
    """faiss's thread count is the calling thread's own (OpenMP): a count set once at
    start-up does not reach the API's request threads nor the ingest worker's. Each search
    and successor lookup of a memory opened with ``threads`` sets it on its caller."""
    import threading

    import faiss

    def fresh_count() -> int:  # what a new thread starts with (this thread's own count
        # may have been set by an earlier test on it)
        got: list[int] = []
        th = threading.Thread(target=lambda: got.append(faiss.omp_get_max_threads()))
        th.start()
        th.join()
        return got[0]

    default, mine = fresh_count(), faiss.omp_get_max_threads()
    want = default + 1  # surely not what a new thread starts with
    mem = open_memory(None, tmp_path / "data", 8, threads=want)
    plain = open_memory(None, tmp_path / "plain", 8)
    rng = np.random.default_rng(2)
    keys = rng.standard_normal((50, 8)).astype(np.float32)
    for m in (mem, plain):
        with m.writer():
            m.put_document(1, keys, np.arange(50) % 5, np.arange(1, 51), DAY)
    seen: dict[str, tuple[int, int]] = {}

    def call(name: str, fn: object) -> None:
        before = faiss.omp_get_max_threads()
        fn()  # type: ignore[operator]
        seen[name] = (before, faiss.omp_get_max_threads())

    calls = {
        "search": lambda: mem.search(keys[:3], 4),
        "successors": lambda: mem.successors(keys[:3], np.zeros((3, 1), np.int64)),
        "default": lambda: plain.search(keys[:3], 4),
    }
    for name, fn in calls.items():
        th = threading.Thread(target=call, args=(name, fn))
        th.start()
        th.join()
    assert seen["search"] == (default, want)
    assert seen["successors"] == (default, want)
    assert seen["default"] == (default, default)  # None: faiss's own default, untouched
    assert faiss.omp_get_max_threads() == mine  # this thread's count never changed
    assert fresh_count() == default  # nor the one new threads start with
    with pytest.raises(ValueError, match="threads"):
        open_memory(None, tmp_path / "bad", 8, threads=0)
    mem.close()
    plain.close()


def test_successors_are_the_next_position_of_the_same_document(memory: MemoryBackend) -> None:
    _, k1 = _put(memory, 1, 30, seed=1)  # positions 1..30
    _, k2 = _put(memory, 2, 30, seed=2)
    _, ids, _ = memory.search(k1[[4, 29]], 1)  # positions 5 and 30 (document 1's last)
    _, own, _ = memory.search(k1[[5]], 1)  # position 6
    d, nxt, vals = memory.successors(k1[[5, 5]], np.array([[ids[0, 0], -1], [ids[1, 0], -1]]))
    assert nxt[0, 0] == own[0, 0] and (nxt[0, 1], nxt[1, 0], nxt[1, 1]) == (-1, -1, -1)
    assert vals[0, 0] == 5 % 7  # _put's values: position - 1, mod 7
    assert d[0, 0] == pytest.approx(0.0, abs=1e-3) and np.isinf(d[1]).all()
    prov = memory.provenance(nxt[:1, 0])
    assert (prov.documents[0], prov.positions[0]) == (1, 6)
    memory.delete_document(1)  # forgotten: never followed again
    _, nxt, _ = memory.successors(k1[[5]], ids[:1])
    assert (nxt == -1).all()
