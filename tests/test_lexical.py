from pathlib import Path

import numpy as np
import pytest

from memlm.calibrator.lexical import LexicalStats


def test_counts_and_distinct_successors(tmp_path):
    s = LexicalStats(10)
    s.update(np.array([1, 2, 1, 2, 1, 3]))  # 1->2, 2->1, 1->2, 2->1, 1->3
    s.update(np.array([1, 2]))
    assert s.count[1] == 4 and s.count[2] == 2 and s.count[3] == 0
    assert s.successors[1] == 2 and s.successors[2] == 1
    f = s.features(np.array([1, 3]))
    np.testing.assert_allclose(f, [[np.log(5), np.log(3)], [0.0, 0.0]], rtol=1e-6)
    s.save(tmp_path / "lex.npz")
    t = LexicalStats.load(tmp_path / "lex.npz", 10)
    assert np.array_equal(t.count, s.count) and np.array_equal(t.successors, s.successors)


def test_a_document_is_counted_once_across_saves(tmp_path):
    s = LexicalStats(10)
    assert s.update(np.array([1, 2, 1]), doc_id=5) is True
    s.save(tmp_path / "lex.npz")
    t = LexicalStats.load(tmp_path / "lex.npz", 10)
    assert t.counted(5) and not t.counted(6)
    # processed again after a crash: the statistics do not move
    assert t.update(np.array([1, 2, 1]), doc_id=5) is False
    assert t.count[1] == 1 and t.count[2] == 1 and t.successors[1] == 1
    assert t.update(np.array([1, 3]), doc_id=6) is True
    assert t.count[1] == 2 and t.successors[1] == 2 and t.docs == {5, 6}


def test_remove_takes_a_document_out_exactly_once(tmp_path):
    s = LexicalStats(10)
    s.update(np.array([1, 2, 1, 2]), doc_id=1)  # 1->2 twice, 2->1
    s.update(np.array([1, 2, 1, 3]), doc_id=2)  # 1->2, 2->1, 1->3
    assert s.successors[1] == 2 and s.count[1] == 4
    assert s.remove(np.array([1, 2, 1, 3]), doc_id=2) is True
    only_1 = LexicalStats(10)
    only_1.update(np.array([1, 2, 1, 2]))
    assert np.array_equal(s.count, only_1.count)
    assert np.array_equal(s.successors, only_1.successors)  # 1->3 gone, 1->2 stays (count 2)
    s.save(tmp_path / "lex.npz")
    t = LexicalStats.load(tmp_path / "lex.npz", 10)
    # a retry after a crash takes nothing out twice; a forgotten id is never counted again
    assert t.remove(np.array([1, 2, 1, 3]), doc_id=2) is False
    assert t.update(np.array([1, 2, 1, 3]), doc_id=2) is False
    assert t.counted(2) and t.docs == {1} and t.forgotten == {2}
    assert np.array_equal(t.count, only_1.count)
    assert t.remove(np.array([1, 2, 1, 2]), doc_id=1) is True
    assert not t.count.any() and not t.successors.any() and not t._pairs


def test_remove_refuses_tokens_that_were_not_counted():
    s = LexicalStats(10)
    s.update(np.array([1, 2]), doc_id=1)
    with pytest.raises(ValueError, match="not counted"):
        s.remove(np.array([4, 5, 4]), doc_id=1)
    assert s.count[1] == 1 and s.docs == {1}


def test_a_save_on_a_full_disk_leaves_the_old_file_and_no_temp_file(tmp_path: Path) -> None:
    """On a real 64 kB filesystem the statistics (400 kB of counts) cannot be written: the
    save raises ENOSPC, the saved file stays as it was and its half-written temp file
    is gone (it held the space a rollback needed: issue 31)."""
    import errno

    from tests.small_fs import small_filesystem

    with small_filesystem(tmp_path / "fs", "64k") as fs:
        small = LexicalStats(100)
        small.update(np.array([1, 2, 3]), doc_id=1)
        small.save(fs / "lexical.npz")
        before = (fs / "lexical.npz").read_bytes()
        big = LexicalStats(50_000)
        with pytest.raises(OSError) as err:
            big.save(fs / "lexical.npz")
        assert err.value.errno == errno.ENOSPC
        assert sorted(p.name for p in fs.iterdir()) == ["lexical.npz"]
        assert (fs / "lexical.npz").read_bytes() == before


def test_a_save_is_on_disk_before_it_replaces_the_old_file(tmp_path: Path, monkeypatch) -> None:
    """The new file's bytes are fsynced before the os.replace, the directory after it."""
    import os

    import memlm.calibrator.lexical as lexical

    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        kind = "dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file"
        events.append(f"fsync {kind}")
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append("replace")
        real_replace(src, dst)

    monkeypatch.setattr(lexical.os, "fsync", fsync)
    monkeypatch.setattr(lexical.os, "replace", replace)
    monkeypatch.setattr("memlm.datastore.durable.os.fsync", fsync)
    stats = LexicalStats(100)
    stats.update(np.array([1, 2, 3]))
    stats.save(tmp_path / "lexical.npz")
    assert events == ["fsync file", "replace", "fsync dir"]
    assert LexicalStats.load(tmp_path / "lexical.npz", 100).count.sum() == stats.count.sum()
