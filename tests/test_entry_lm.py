"""The per-entry log p_LM store (memlm.memory.entry_lm): a new value replaces an id's old
one, unknown ids are NaN, pruning, a durable save, and concurrent writers against an
oracle."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from memlm.memory.entry_lm import ENTRY_LM_FILE, EntryLM


def test_values_by_id_the_newest_wins_and_unknown_is_nan() -> None:
    e = EntryLM()
    e.add([5, 1, 9], [-1.0, -2.0, -3.0])
    e.add([9, 2], [-0.5, -4.0])  # 9 used again (a rolled back document's id)
    got = e.of([1, 2, 3, 5, 9])
    np.testing.assert_allclose(got[[0, 1, 3, 4]], [-2.0, -4.0, -1.0, -0.5], rtol=1e-3)
    assert np.isnan(got[2]) and len(e) == 4 and e.nbytes() == 4 * 10
    assert np.isnan(EntryLM().of([1])).all()
    with pytest.raises(ValueError, match="2 ids and 1"):
        e.add([1, 2], [-1.0])


def test_prune_keeps_the_live_and_a_save_survives_a_reload(tmp_path: Path) -> None:
    e = EntryLM()
    e.add(np.arange(10), -np.arange(10) / 4)
    assert e.prune(np.array([2, 3, 7])) == 7 and len(e) == 3
    e.save(tmp_path)
    assert (tmp_path / ENTRY_LM_FILE).exists() and not list(tmp_path.glob("*.tmp"))
    back = EntryLM.load(tmp_path)
    np.testing.assert_array_equal(back.of([2, 3, 7]), e.of([2, 3, 7]))
    assert len(EntryLM.load(tmp_path / "none")) == 0


def test_concurrent_writers_and_readers_match_the_oracle() -> None:
    e = EntryLM()
    rng = np.random.default_rng(0)
    batches = [rng.choice(5000, 200, replace=False) for _ in range(40)]
    errors: list[BaseException] = []

    def write(part: list[np.ndarray], who: int) -> None:
        try:
            for ids in part:
                e.add(ids, np.full(len(ids), -float(who)))
                e.of(ids)  # a reader beside the other writer
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    # each writer owns the ids it writes (no id in both halves): the oracle is exact
    a = [b[b % 2 == 0] for b in batches]
    b = [b[b % 2 == 1] for b in batches]
    threads = [threading.Thread(target=write, args=(p, w)) for w, p in ((1, a), (2, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    oracle = {int(i): -1.0 for p in a for i in p} | {int(i): -2.0 for p in b for i in p}
    ids = np.array(sorted(oracle))
    np.testing.assert_array_equal(e.of(ids), [oracle[int(i)] for i in ids])
    assert len(e) == len(oracle)


def test_documents_appended_in_order_and_an_id_used_again() -> None:
    """Ids after everything known (documents stored one after another) are appended; an
    id used again later still takes its new value."""
    e = EntryLM()
    e.add([0, 1, 2], [-1.0, -2.0, -3.0])
    e.add([3, 4], [-4.0, -5.0])
    np.testing.assert_array_equal(e.of([0, 1, 2, 3, 4]), [-1.0, -2.0, -3.0, -4.0, -5.0])
    e.add([5], [-6.0])
    e.add([1, 6], [-0.5, -7.0])  # 1 used again (a rolled back document's id)
    np.testing.assert_array_equal(e.of([1, 5, 6]), [-0.5, -6.0, -7.0])
    assert len(e) == 7
