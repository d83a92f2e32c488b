"""One engine driven from several threads at once, against single-threaded oracles.

The API executor, the in-process ingest worker and the builder share one model. Every
forward's keys must stay its own: stored keys equal a clean re-encode of their document,
and every predict / score equals what a single thread computes on the same memory.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from memlm.encoder import Encoder, WindowConfig
from memlm.engine import Engine
from memlm.knnlm import KnnParams
from tests.texts import random_text


def _texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [random_text(rng, rng.randint(100, 700)) for _ in range(n)]  # like the report's


def _run_threads(targets: list[Callable[[], None]]) -> list[BaseException]:
    errors: list[BaseException] = []
    start = threading.Barrier(len(targets))

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            start.wait()
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)

        return run

    threads = [threading.Thread(target=wrap(fn)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors


@pytest.fixture(scope="module", params=["tiny-gpt2", "tiny-llama"])
def encoder(request):
    return Encoder.load(request.param, threads=1)


def _engine(path: Path, encoder: Encoder) -> Engine:
    # small windows, so documents span several windows and batches get padded
    return Engine.open(
        path,
        encoder=encoder,
        policy="fullmem",
        knn=KnnParams(k=8, temperature=1.0, lmbda=0.3),
        window=WindowConfig(context=32, stride=16, batch_size=3),
    )


def test_ingest_predict_score_threads_match_single_threaded_oracles(tmp_path, encoder):
    docs = _texts(24, seed=1)
    queries = _texts(12, seed=2)
    eng = _engine(tmp_path / "live", encoder)
    # oracles, one thread, before any concurrency: keys of every document, and the LM part
    # of every query's prediction and score (independent of what the memory holds)
    clean = {
        i: eng.encoder.encode_ids(eng.encoder.tokenize(t), eng.window) for i, t in enumerate(docs)
    }
    lm_pred = {q: eng.predict(q, top_n=5) for q in queries}
    lm_score = {q: eng.score(q, policy="fullmem") for q in queries}

    stored: dict[int, tuple[int, int]] = {}
    lock = threading.Lock()

    def ingest(part: list[int]) -> Callable[[], None]:
        def run() -> None:
            for i in part:
                r = eng.process_document(i, docs[i], 19000 + i, policy="fullmem")
                with lock:
                    stored[i] = (r.first_entry, r.end_entry)

        return run

    mismatches: list[str] = []

    def reads(seed: int) -> Callable[[], None]:
        def run() -> None:
            rng = random.Random(seed)
            for _ in range(15):
                q = rng.choice(queries)
                if rng.random() < 0.5:
                    batch = rng.sample(queries, 3) + [q]
                    for qq, p in zip(batch, eng.predict_batch(batch, top_n=5), strict=True):
                        want = {s.token_id: s.lm_prob for s in lm_pred[qq].suggestions}
                        for s in p.suggestions:
                            # LM probabilities of whatever the memory ranked on top
                            if s.token_id in want and abs(s.lm_prob - want[s.token_id]) > 1e-5:
                                mismatches.append(f"predict {qq[:20]!r}: {s.token_id}")
                        assert p.context_tokens == len(eng.encoder.tokenize(qq))
                else:
                    s = eng.score(q, policy="fullmem")
                    if not np.allclose(s.lm_logprobs, lm_score[q].lm_logprobs, atol=1e-5):
                        mismatches.append(f"score {q[:20]!r}")

        return run

    errors = _run_threads(
        [ingest(list(range(0, 24, 2))), ingest(list(range(1, 24, 2)))]
        + [reads(s) for s in range(4)]
    )
    assert errors == []
    assert mismatches == []
    assert sorted(stored) == list(range(24))
    total = 0
    for i, (a, b) in stored.items():
        want = clean[i]
        assert b - a == len(want)
        keys = eng.memory.datastore.keys(np.arange(a, b)).astype(np.float32)
        np.testing.assert_allclose(keys, want.keys.astype(np.float16), atol=2e-3, rtol=2e-3)
        docs_, pos, _ = eng.memory.datastore.provenance(np.arange(a, b))
        assert set(docs_.tolist()) == {i} and pos.tolist() == want.positions.tolist()
        assert eng.memory.datastore.values(np.arange(a, b)).tolist() == want.targets.tolist()
        total += b - a
    assert len(eng.memory.datastore) == total


def test_reads_on_a_fixed_memory_equal_one_thread_exactly(tmp_path, encoder):
    """With the memory fixed, concurrent predicts and scores return exactly what one
    thread returns: suggestions, lambdas, neighbours and per-token scores."""
    eng = _engine(tmp_path / "fixed", encoder)
    for i, t in enumerate(_texts(10, seed=3)):
        eng.process_document(i, t, 19000, policy="fullmem")
    queries = _texts(8, seed=4)
    want_p = {q: eng.predict(q, top_n=5, neighbours=3) for q in queries}
    want_s = {q: eng.score(q, policy="monim") for q in queries}
    bad: list[str] = []

    def reads(seed: int) -> Callable[[], None]:
        def run() -> None:
            rng = random.Random(seed)
            for _ in range(12):
                q = rng.choice(queries)
                p = eng.predict(q, top_n=5, neighbours=3)
                w = want_p[q]
                if [s.token_id for s in p.suggestions] != [s.token_id for s in w.suggestions]:
                    bad.append(f"predict ranks {q[:20]!r}")
                elif not np.allclose(
                    [s.prob for s in p.suggestions], [s.prob for s in w.suggestions], atol=1e-6
                ):
                    bad.append(f"predict probs {q[:20]!r}")
                if [n.entry_id for n in p.neighbours] != [n.entry_id for n in w.neighbours]:
                    bad.append(f"neighbours {q[:20]!r}")
                s = eng.score(q, policy="monim")
                if not np.allclose(s.logprobs, want_s[q].logprobs, atol=1e-6):
                    bad.append(f"score {q[:20]!r}")
                if s.would_store != want_s[q].would_store:
                    bad.append(f"would_store {q[:20]!r}")

        return run

    assert _run_threads([reads(s) for s in range(4)]) == []
    assert bad == []


def test_answers_while_the_evidence_model_swaps_come_from_one_model(tmp_path, encoder):
    """The served interpolation (the evidence model of a version, or the combination with a
    calibrator) is swapped whole while threads predict and score: every answer equals the
    single-threaded answer under one of the two, never a mix (each call reads ``served``
    once)."""
    from dataclasses import replace

    from memlm.calibrator import Calibrator, CalibratorConfig
    from memlm.calibrator.evidence import PRIOR

    eng = Engine.open(
        tmp_path / "swap",
        encoder=encoder,
        policy="fullmem",
        knn=KnnParams(k=8, temperature=1.0, lmbda=0.3),
        window=WindowConfig(context=32, stride=16, batch_size=3),
        evidence=True,
    )
    texts = _texts(6, seed=5)
    for i, t in enumerate(texts):
        eng.process_document(i, t, 19000)
    first = eng.calibration.served
    assert first.lambda_source == "evidence"
    # the other version serves the combination: max(evidence, a calibrator's lambda)
    cal = Calibrator(
        CalibratorConfig(init_lambda=0.4, init_from_constant=False),
        {"conf": 1, "entropy": 1, "log_freq": 1, "log_succ": 1, "knn_dist": 10, "knn_distinct": 10},
    )
    second = replace(
        first,
        params=replace(first.params, temperature=3.0),
        evidence=replace(PRIOR, bias=1.0, w_dist=-8.0, w_short=0.0),
        calibrator=cal,
        use_calibrator=True,
    )
    assert second.lambda_source == "combined"
    # the memorised texts' own prefixes (near matches) and unseen text (far ones)
    queries = [t[: len(t) // 2] for t in texts[:4]] + _texts(2, seed=6)
    want: dict[int, tuple[dict[str, list[float]], dict[str, list[float]]]] = {}
    for n, served in enumerate((first, second)):
        eng.calibration.served = served
        want[n] = (
            {q: [s.prob for s in eng.predict(q, top_n=5).suggestions] for q in queries},
            {q: eng.score(q).logprobs for q in queries},
        )
    eng.calibration.served = first
    assert want[0][1] != want[1][1]  # the two models answer differently
    bad: list[str] = []
    swaps = 0

    def reads(seed: int) -> Callable[[], None]:
        def run() -> None:
            rng = random.Random(seed)
            for _ in range(8):
                q = rng.choice(queries)
                p = [s.prob for s in eng.predict(q, top_n=5).suggestions]
                if not any(np.allclose(p, want[n][0][q], atol=1e-9) for n in (0, 1)):
                    bad.append(f"predict {q[:20]!r}")
                s = eng.score(q).logprobs
                if not any(np.allclose(s, want[n][1][q], atol=1e-9) for n in (0, 1)):
                    bad.append(f"score {q[:20]!r}")

        return run

    readers = [reads(1), reads(2), reads(3)]
    done = threading.Event()

    def all_reads() -> None:
        try:
            assert _run_threads(readers) == []
        finally:
            done.set()

    def swap_until_done() -> None:
        nonlocal swaps
        while not done.is_set():
            eng.calibration.served = (first, second)[swaps % 2]
            swaps += 1
            time.sleep(0.0005)  # a swap every half millisecond: many inside each call

    assert _run_threads([swap_until_done, all_reads]) == []
    assert swaps > 100 and bad == []
