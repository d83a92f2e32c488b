"""The dashboard's held-out curves under concurrent polls, against an oracle.

``HeldOutCurves`` caches each record file's per-day sums across polls, one instance per
app; its cache is valid for one served interpolation only. Several browsers poll it at
once while the worker writes new records and the builder swaps the served interpolation:
every answer must be exactly what a fresh computation gives for the interpolation it
names and the records that were on disk, never sums cached under another interpolation.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from memlm.calibrator.heldout import HeldOutConfig, HeldOutRecorder, stack
from memlm.calibrator.heldout_curves import HeldOutCurves
from memlm.knnlm import KnnParams
from tests.test_dashboard import _expected_days

K = 10  # neighbours per recorded token, as the engine records them (max(k, 10))


def _record(rec: HeldOutRecorder, doc: int, day: int, n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 30, (n, K))
    values[rng.random((n, K)) < 0.15] = -1  # missing neighbours
    distances = np.sort(rng.gamma(2.0, 4.0, (n, K)), axis=1).astype(np.float32)
    distances[values < 0] = np.inf
    arrays = {
        "target_lm_logprob": -rng.gamma(2.0, 1.5, n).astype(np.float32),
        "distances": distances,
        "values": values,
        "gold": rng.integers(0, 30, n),
        "top_logprob": -rng.gamma(1.0, 0.5, n).astype(np.float32),
        "entropy": rng.gamma(2.0, 1.0, n).astype(np.float32),
        "lexical": rng.normal(size=(n, 2)).astype(np.float32),
        "day": np.full(n, day),
        "doc": np.full(n, doc),
    }
    rec.record(doc, day, arrays)
    return arrays


def _served(params: KnnParams, version: int) -> Any:
    return SimpleNamespace(
        params=params,
        lambda_source="constant",
        calibrator=None,
        gate=None,
        theta=0.0,
        version=version,
    )


def test_concurrent_polls_match_a_fresh_computation_while_records_and_interpolation_change(
    tmp_path: Path,
) -> None:
    rec = HeldOutRecorder(tmp_path / "calibrator-pending", HeldOutConfig(enabled=True))
    served = [
        _served(KnnParams(k=8, temperature=1.0, lmbda=0.3), 1),
        _served(KnnParams(k=4, temperature=3.0, lmbda=0.6), 2),
    ]
    train = tmp_path / "calibrator-train.npz"  # never written: all records stay pending
    engine = SimpleNamespace(
        calibration=SimpleNamespace(train_path=train, training_rows=lambda: {}),
        heldout=rec,
        served=served[0],
    )
    # file names sort in the order they are written, so what a poll saw is a prefix
    sizes = [37, 41, 53, 59, 61, 67, 71, 79]  # every prefix has its own token count
    written = [_record(rec, doc=10, day=17_200, n=sizes[0], seed=0)]

    curves = HeldOutCurves()
    answers: list[Any] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def poll() -> None:
        try:
            while not done.is_set():
                answers.append(curves.compute(engine, recording=True))
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    readers = [threading.Thread(target=poll) for _ in range(6)]

    def polls_go_on(more: int = 6) -> None:  # let the readers answer a few times
        until = len(answers) + more
        deadline = time.monotonic() + 30
        while len(answers) < until and time.monotonic() < deadline and not errors:
            time.sleep(0.002)

    for t in readers:
        t.start()
    try:
        polls_go_on()
        for i, n in enumerate(sizes[1:], start=1):
            engine.served = served[i % 2]  # a build swaps the served interpolation
            polls_go_on(2)
            written.append(_record(rec, doc=10 + i, day=17_200 + i // 3, n=n, seed=i))
            polls_go_on(2)
        polls_go_on()
    finally:
        done.set()
        for t in readers:
            t.join(30)
    assert not errors, errors

    prefix_of = {sum(sizes[: j + 1]): j + 1 for j in range(len(sizes))}
    oracle: dict[tuple[int, int], dict[str, tuple[float, ...]]] = {}
    seen_versions: set[int] = set()
    for got in answers:
        version = got.interpolation["index_version"]
        seen_versions.add(version)
        params = served[version - 1].params
        assert got.interpolation["k"] == params.k and got.interpolation["lambda"] == params.lmbda
        files = prefix_of[got.tokens]  # a prefix of the records written so far
        if (version, files) not in oracle:
            oracle[version, files] = _expected_days(stack(written[:files]), params)
        want = oracle[version, files]
        days = {d.day.isoformat(): (d.tokens, d.lm_ppl, d.augmented_ppl) for d in got.days}
        assert days.keys() == want.keys()
        for day, (n, lm, aug) in want.items():
            assert days[day][0] == n
            assert days[day][1] == pytest.approx(lm, rel=1e-9)
            assert days[day][2] == pytest.approx(aug, rel=1e-9)
    assert seen_versions == {1, 2} and len(answers) > 20
    assert {files for _, files in oracle} >= {1, len(sizes)}  # from the first record to all
    # the two interpolations give different figures for the same records: a sum cached
    # under one and served under the other would not pass the checks above
    everything = stack(written)
    a, b = (_expected_days(everything, s.params) for s in served)
    assert all(a[d][2] != pytest.approx(b[d][2], rel=1e-6) for d in a)
