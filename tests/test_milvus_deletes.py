"""The Milvus memory's delete journal (memlm.memory.milvus_deletes): what a build takes
and removes, what is written meanwhile stays, damaged lines, writers racing a settle."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np
import pytest

from memlm.memory.base import Neighbours
from memlm.memory.milvus_client import entry_ids
from memlm.memory.milvus_deletes import DeleteJournal, LostDeleteLog


@pytest.fixture(params=["file", "memory"])
def journal(request: pytest.FixtureRequest, tmp_path: Path) -> DeleteJournal:
    return DeleteJournal(tmp_path / "d" / "j.jsonl" if request.param == "file" else None)


def test_a_settle_removes_what_was_read_and_keeps_what_came_after(journal: DeleteJournal) -> None:
    assert journal.pending() == ({"doc_id": [], "id": []}, 0)
    journal.record("doc_id", [5])
    journal.record("id", [7, 3, 7])
    journal.record("doc_id", [])  # nothing to write
    named, end = journal.pending()
    assert named == {"doc_id": [5], "id": [3, 7]}
    journal.record("doc_id", [9])  # after the read: the next build's
    journal.settle(end)
    assert journal.pending()[0] == {"doc_id": [9], "id": []}
    with pytest.raises(ValueError, match="field"):
        journal.record("day", [1])


def test_a_line_a_crash_cut_short_is_skipped_and_the_next_stays_whole(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    journal = DeleteJournal(path)
    journal.record("doc_id", [1])
    with path.open("a") as f:  # a writer killed mid-line: its delete was never sent
        f.write('{"field": "doc_id", "val')
    assert journal.pending()[0]["doc_id"] == [1]  # the cut line is not read yet
    journal.record("id", [4])  # starts a line of its own
    named, end = journal.pending()
    assert named == {"doc_id": [1], "id": [4]}
    journal.settle(end)
    assert path.read_text() == ""


def test_writers_racing_settles_lose_nothing_and_settle_nothing_twice(tmp_path: Path) -> None:
    """Four writers (each its own handle: as processes on one data directory) append
    while a builder takes and settles, again and again: every value is taken exactly
    once, by a settle or by the last read."""
    path = tmp_path / "j.jsonl"
    taken: list[int] = []
    done = threading.Event()

    def write(w: int) -> None:
        j = DeleteJournal(path)
        for i in range(150):
            j.record("id", [w * 1000 + i])

    def build() -> None:
        j = DeleteJournal(path)
        while not done.is_set():
            named, end = j.pending()
            j.settle(end)
            taken.extend(named["id"])

    builder = threading.Thread(target=build)
    builder.start()
    writers = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    done.set()
    builder.join()
    taken.extend(DeleteJournal(path).pending()[0]["id"])
    assert sorted(taken) == sorted(w * 1000 + i for w in range(4) for i in range(150))


def test_what_searches_hide_follows_the_journal(journal: DeleteJournal) -> None:
    docs, ids = journal.named()
    assert docs.size == ids.size == 0
    journal.record("doc_id", [4])
    journal.record("id", [9, 2])
    docs, ids = journal.named()
    assert docs.tolist() == [4] and ids.tolist() == [2, 9]
    assert journal.named()[0] is docs  # unchanged: not read again
    _, end = journal.pending()
    journal.record("doc_id", [6])
    journal.settle(end)
    docs, ids = journal.named()
    assert docs.tolist() == [6] and ids.size == 0


def test_searches_and_pages_lose_exactly_the_entries_it_names(journal: DeleteJournal) -> None:
    """``hide``: the named entries leave each row, the others keep their order and move
    up, the row ends padded; ``without``: a page's rows less the named ones."""
    ids = entry_ids(np.array([[1, 2, 3, 2], [3, 3, 1, 5]]), np.array([[4, 1, 2, 6], [9, 2, 3, 1]]))
    ids[1, 3] = -1  # a row padded already
    found = Neighbours(
        np.array([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, np.inf]], np.float32),
        ids,
        np.array([[10, 20, 30, 40], [50, 60, 70, -1]], np.int32),
    )
    assert journal.hide(found) == (found, 0)  # nothing named: the same object
    journal.record("doc_id", [2])
    journal.record("id", [int(ids[1, 0])])  # document 3, position 9
    kept, hidden = journal.hide(found)
    assert hidden == 3
    assert kept.ids.tolist() == [[ids[0, 0], ids[0, 2], -1, -1], [ids[1, 1], ids[1, 2], -1, -1]]
    assert kept.values.tolist() == [[10, 30, -1, -1], [60, 70, -1, -1]]
    np.testing.assert_allclose(kept.distances[:, :2], [[0.1, 0.3], [0.6, 0.7]])
    assert np.isinf(kept.distances[:, 2:]).all()
    page = (
        np.arange(8, dtype=np.float32).reshape(4, 2),
        np.array([1, 2, 3, 4], np.int32),
        np.array([1, 2, 3, 3]),
        np.array([4, 1, 9, 2], np.int32),
        np.array([7, 7, 8, 8], np.int32),
    )
    rest = journal.without(page)
    assert rest is not None
    assert rest[1].tolist() == [1, 4] and rest[0].tolist() == [[0, 1], [6, 7]]
    assert journal.without(tuple(a[1:3] for a in page)) is None  # type: ignore[arg-type]


def test_lost_delete_warnings_come_once_a_minute_with_the_count(caplog) -> None:
    """A lost delete is served to every search until the next build: the log says so
    once per interval, counting every row hidden since its last line."""
    now = [0.0]
    lost = LostDeleteLog(every=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="memlm.memory.milvus_deletes"):
        lost.note("c", 0)  # nothing hidden: no line
        for _ in range(100):
            lost.note("c", 3)
        now[0] = 59.0
        lost.note("c", 1)
        now[0] = 61.0
        lost.note("c", 2)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "served 3 deleted entries" in lines[0]
    assert "served 300 deleted entries" in lines[1]  # 99 x 3 + 1 + 2 since the first
    assert lost.total == 303
