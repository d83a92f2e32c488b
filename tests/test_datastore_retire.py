"""Retiring single entries (consolidation): the retired log, its crash points, compaction,
truncation, and the interplay with deleting a document."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from memlm.datastore import RETIRE_CRASH_POINTS, Datastore, SimulatedCrash
from tests.test_datastore import batch


def _store(path: Path) -> Datastore:
    ds = Datastore.open(path, dim=8, max_segment_entries=16)
    ds.append(*batch(10, 0, doc=1))
    ds.append(*batch(10, 1, doc=2))  # ids 10..19: two segments
    return ds


def test_retire_hides_entries_and_survives_reopen(tmp_path: Path) -> None:
    ds = _store(tmp_path)
    assert ds.retire_entries([3, 12, 12, 40, -1]) == 2  # duplicates and bad ids count 0
    assert ds.num_live == 18 and ds.num_retired == 2
    mask = ds.live_mask(np.arange(20))
    assert np.flatnonzero(~mask).tolist() == [3, 12]
    assert ds.retire_entries([3]) == 0  # again: nothing counted twice
    ds.close()
    again = Datastore.open(tmp_path)
    assert again.num_live == 18 and again.num_retired == 2
    assert np.flatnonzero(~again.live_mask(np.arange(20))).tolist() == [3, 12]
    reader = Datastore.open(tmp_path, readonly=True)
    assert np.flatnonzero(~reader.live_mask(np.arange(20))).tolist() == [3, 12]


def test_delete_and_retire_count_each_entry_once(tmp_path: Path) -> None:
    ds = _store(tmp_path)
    assert ds.retire_entries([0, 1]) == 2
    assert ds.delete_document(1) == 8  # its 10 entries less the 2 retired
    assert ds.num_live == 10
    assert ds.retire_entries([5, 15]) == 1  # 5 belongs to the forgotten document
    assert ds.num_live == 9
    assert ds.delete_document(2, entries=range(10, 20)) == 9
    assert ds.num_live == 0


def test_compact_removes_retired_rows_keeping_ids(tmp_path: Path) -> None:
    ds = _store(tmp_path)
    keys = ds.keys(np.arange(20))
    ds.retire_entries([2, 17])
    done = ds.compact()
    assert done.rows_removed == 2 and done.segments == 2
    assert ds.stats()["rows"] == 18
    live = np.flatnonzero(ds.live_mask(np.arange(20)))
    assert live.tolist() == [i for i in range(20) if i not in (2, 17)]
    np.testing.assert_array_equal(ds.keys(live), keys[live])
    assert ds.compact().rows_removed == 0


def test_truncate_drops_retired_ids_it_cut(tmp_path: Path) -> None:
    """A retired id that a truncate cut names a new entry once appended again: live."""
    ds = _store(tmp_path)
    ds.retire_entries([4, 18])
    ds.truncate(15)
    assert ds.num_retired == 1 and ds.num_live == 14
    ds.append(*batch(5, 3, doc=3))  # ids 15..19 again
    assert ds.live_mask(np.arange(20)).sum() == 19 and ds.num_live == 19
    ds.close()
    again = Datastore.open(tmp_path)
    assert np.flatnonzero(~again.live_mask(np.arange(20))).tolist() == [4]
    assert again.num_live == 19


@pytest.mark.parametrize("point", RETIRE_CRASH_POINTS)
def test_retire_crash_at_each_point(tmp_path: Path, point: str) -> None:
    ds = _store(tmp_path)
    with pytest.raises(SimulatedCrash):
        ds.retire_entries([1, 2], crash_at=point)
    again = Datastore.open(tmp_path)
    committed = point == "after_manifest"
    assert again.num_retired == (2 if committed else 0)
    assert again.num_live == (18 if committed else 20)
    # a retry counts only what was not committed
    assert again.retire_entries([1, 2]) == (0 if committed else 2)
    assert again.num_live == 18


def test_a_copy_of_the_committed_files_keeps_the_retired_entries(tmp_path: Path) -> None:
    """What a backup copies (``committed_files``, memlm.backup) includes the retired log."""
    ds = _store(tmp_path / "a")
    ds.retire_entries([1, 11])
    files = dict(ds.committed_files())
    assert files[tmp_path / "a" / "retired"] == 2 * 16
    copy = tmp_path / "b"
    copy.mkdir()
    for f, length in files.items():
        (copy / f.name).write_bytes(f.read_bytes()[:length])
    (copy / "manifest.json").write_bytes((tmp_path / "a" / "manifest.json").read_bytes())
    again = Datastore.open(copy)
    assert np.flatnonzero(~again.live_mask(np.arange(20))).tolist() == [1, 11]
    assert again.num_live == 18
