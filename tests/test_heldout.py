"""Held-out records for the served calibrator: sampling, the day cap, idempotent files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from memlm.calibrator import ServedCalibration
from memlm.calibrator.heldout import (
    FIELDS,
    OPTIONAL_FIELDS,
    HeldOutConfig,
    HeldOutRecorder,
    sampled,
    stack,
)

ON = HeldOutConfig(enabled=True, share=0.5, day_tokens=100)


def arrays(doc: int, day: int, n: int, width: int = 10) -> dict[str, np.ndarray]:
    """A record of n tokens whose values are all ``doc`` (so rows can be traced)."""
    return {
        "target_lm_logprob": np.full(n, -2.0, np.float32),
        "distances": np.tile(np.arange(width, dtype=np.float32), (n, 1)),
        "values": np.full((n, width), doc, np.int32),
        "gold": np.arange(n, dtype=np.int64),
        "top_logprob": np.full(n, -1.0, np.float32),
        "entropy": np.full(n, 3.0, np.float32),
        "lexical": np.zeros((n, 2), np.float32),
        "day": np.full(n, day, np.int32),
        "doc": np.full(n, doc, np.int64),
    }


def test_seeded_draws() -> None:
    # crc32("0:<id>") / 2**32 for ids 1..4: 0.685, 0.212, 0.255, 0.872
    assert [sampled(ON, i) for i in (1, 2, 3, 4)] == [False, True, True, False]
    assert not any(sampled(HeldOutConfig(share=0.0), i) for i in range(100))
    assert all(sampled(HeldOutConfig(share=1.0), i) for i in range(100))
    with pytest.raises(ValueError, match="share"):
        HeldOutConfig(share=1.5)
    with pytest.raises(ValueError, match="day_tokens"):
        HeldOutConfig(day_tokens=0)


def test_budget_first_of_day_cap_and_first_record_wins(tmp_path: Path) -> None:
    rec = HeldOutRecorder(tmp_path / "p", ON)
    assert HeldOutRecorder(tmp_path / "off", HeldOutConfig()).budget(1, 7, set(), {}) == 0
    assert rec.budget(1, 7, set(), {}) == 100  # not sampled, but the day's first document
    rec.record(1, 7, arrays(1, 7, 60))
    assert rec.budget(1, 7, set(), {}) == 0  # recorded already: a re-run records nothing
    assert rec.budget(4, 7, set(), {}) == 0  # not sampled and the day has a record
    assert rec.budget(2, 7, set(), {}) == 40  # sampled: what is left of the day's 100
    assert rec.budget(2, 7, set(), {7: 40}) == 0  # the training set holds 40 of day 7
    assert rec.budget(3, 7, {3}, {}) == 0  # merged into the training set already
    assert rec.budget(4, 8, set(), {}) == 100  # another day
    p = rec.pending()
    assert (p.docs, p.day_tokens, p.tokens) == (frozenset({1}), {7: 60}, 60)


def test_rows_are_a_seeded_spread_when_over_budget(tmp_path: Path) -> None:
    rec = HeldOutRecorder(tmp_path, ON)
    assert rec.rows(5, 30, 40).tolist() == list(range(30))
    rows = rec.rows(5, 300, 40)
    assert len(rows) == len(set(rows.tolist())) == 40 and (np.diff(rows) > 0).all()
    assert rows.tolist() == rec.rows(5, 300, 40).tolist()
    assert rows.tolist() != rec.rows(6, 300, 40).tolist()


def test_records_round_trip_pad_and_drop(tmp_path: Path) -> None:
    rec = HeldOutRecorder(tmp_path, ON)
    rec.record(1, 7, arrays(1, 7, 3, width=10))
    rec.record(2, 8, arrays(2, 8, 2, width=12))
    (tmp_path / ".tmp-d9-doc9-n1.npz").write_bytes(b"half")  # a crash mid-write
    got = rec.load(rec.pending().paths)
    assert set(got) == set(FIELDS + OPTIONAL_FIELDS)  # old records read as "not recorded"
    assert got["doc"].tolist() == [1, 1, 1, 2, 2] and got["values"].shape == (5, 12)
    assert got["values"][0].tolist() == [1] * 10 + [-1, -1]  # padded: no neighbour
    assert np.isinf(got["distances"][:3, 10:]).all() and got["distances"][3, 11] == 11.0
    assert rec.drop_document(2) == 2 and rec.pending().docs == frozenset({1})
    rec.remove(rec.pending().paths)
    assert sorted(tmp_path.iterdir()) == []
    assert stack([]) == {}


def test_training_set_merges_each_document_once(tmp_path: Path) -> None:
    served = ServedCalibration(tmp_path, vocab_size=16)
    both = stack([arrays(1, 7, 3), arrays(2, 7, 2)])
    assert served.add_heldout(both, version=1) == 5
    # the same records again (a crash before their files were deleted) add nothing
    assert served.add_heldout(both, version=2) == 0
    assert served.add_heldout(stack([arrays(2, 7, 2), arrays(3, 8, 4)]), version=2) == 4
    rows = served.training_rows()
    assert rows["doc"].tolist() == [1, 1, 1, 2, 2, 3, 3, 3, 3]
    assert rows["merged_for"].tolist() == [1] * 5 + [2] * 4
    assert served.training_index() == ({1, 2, 3}, {7: 5, 8: 4})
    # texts given to Engine.train_calibrator have negative ids and are never deduplicated
    assert served.add_heldout(arrays(-1, 8, 2), version=2) == 2
    assert served.add_heldout(arrays(-1, 8, 2), version=3) == 2
    assert served.drop_document(2) == 2 and served.drop_document(2) == 0
    assert served.training_index() == ({1, 3}, {7: 3, 8: 8})


def test_training_set_keeps_the_newest_tokens(tmp_path: Path) -> None:
    served = ServedCalibration(tmp_path, vocab_size=16)
    # a late document of an older day (5) arrives after day 8's: it is among the oldest
    assert served.add_heldout(stack([arrays(1, 7, 3), arrays(2, 8, 4)]), 1, max_tokens=8) == 7
    assert served.add_heldout(stack([arrays(3, 5, 2), arrays(4, 9, 3)]), 2, max_tokens=8) == 5
    rows = served.training_rows()
    # 12 rows, 8 kept: day 5 (2 rows) and two of day 7's 3 leave; merge order is kept
    assert rows["doc"].tolist() == [1, 2, 2, 2, 2, 4, 4, 4]
    assert rows["day"].tolist() == [7, 8, 8, 8, 8, 9, 9, 9]
    assert served.training_index() == ({1, 2, 4}, {7: 1, 8: 4, 9: 3})
    with pytest.raises(ValueError, match="max_tokens"):
        HeldOutConfig(min_tokens=100, max_tokens=50)


def test_retrain_with_a_day_whose_tokens_have_no_neighbour(tmp_path: Path) -> None:
    from memlm.knnlm import KnnParams

    served = ServedCalibration(tmp_path, vocab_size=16)
    empty = arrays(1, 7, 40)  # the stream's first document: the memory was empty
    empty["values"][:] = -1
    empty["distances"][:] = np.inf
    served.add_heldout(stack([empty, arrays(2, 8, 100)]), version=1)
    report = served.retrain(KnnParams(k=10, temperature=1.0, lmbda=0.25), tmp_path / "idx", 1)
    assert report["trained"] is True and report["training_tokens"] == 140
    assert report["calibrator"]["train_tokens"] + report["calibrator"]["val_tokens"] == 100
    assert (tmp_path / "idx" / "v000001" / "calibrator" / "calibrator.json").exists()
