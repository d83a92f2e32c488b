"""The calibrator's features (by hand on a fake LM and a tiny store) and what it learns."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from memlm.calibrator import (
    DEFAULT_FEATURES,
    GATE_FEATURES,
    Calibrator,
    CalibratorConfig,
    calibrate_stream,
    density_features,
    epochs_for,
    features_of_groups,
    gate_config,
    mixture_nll,
    token_features,
    validation_mask,
    with_prior,
)
from memlm.calibrator.lexical import LexicalStats
from memlm.datastore import Datastore
from memlm.index import IndexParams, MemoryIndex, build_index
from memlm.knnlm import KnnParams


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Small MLPs: one thread (multi-thread OpenMP collapses on a shared machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- features by hand -------------------------------------------------------------------


def fake_lm_logprobs() -> np.ndarray:
    """A fake LM over 4 tokens: two contexts with exactly known distributions."""
    return np.log(np.array([[0.5, 0.25, 0.25, 0.0 + 1e-300], [0.25, 0.25, 0.25, 0.25]]))


def test_features_by_hand_on_fake_lm_and_tiny_store(tmp_path: Path) -> None:
    # tiny store: 2-d keys; values 7, 7, 9, 3 at squared distances 1, 4, 9, 16 from q
    ds = Datastore.open(tmp_path / "ds", dim=2)
    keys = np.array([[1, 0], [2, 0], [3, 0], [4, 0]], np.float16)
    ds.append(keys, [7, 7, 9, 3], [1, 1, 2, 2], [1, 2, 1, 2], [0, 0, 0, 0])
    build_index(ds, tmp_path / "ix", IndexParams.exact(), progress=False)
    mem = MemoryIndex(ds, tmp_path / "ix")
    q = np.zeros((2, 2), np.float32)
    dist, ids = mem.search(q, 4)
    values = np.where(ids >= 0, ds.values(np.maximum(ids, 0).ravel()).reshape(ids.shape), -1)
    np.testing.assert_array_equal(values, [[7, 7, 9, 3]] * 2)
    # fake LM: token 0 of context 0 is the arg max (p = 0.5); context 1 is uniform
    lp = fake_lm_logprobs()
    top = lp.max(axis=1)
    ent = -(np.exp(lp) * lp).sum(axis=1)
    # lexical statistics of the stream "5 6 5 6 5 8": token 5 occurs 3 times as a
    # context token, followed by 6 and 8; token 6 occurs twice, followed by 5
    lex = LexicalStats(10)
    lex.update(np.array([5, 6, 5, 6, 5, 8]))
    feats = token_features(top, ent, lex.features(np.array([5, 6])), dist, values)

    assert tuple(feats) == ("conf", "entropy", "log_freq", "log_succ", "knn_dist", "knn_distinct")
    np.testing.assert_allclose(feats["conf"][:, 0], [0.5, 0.25], rtol=1e-6)
    np.testing.assert_allclose(feats["entropy"][:, 0], [1.5 * math.log(2), math.log(4)], rtol=1e-6)
    np.testing.assert_allclose(feats["log_freq"][:, 0], [math.log(4), math.log(3)], rtol=1e-6)
    np.testing.assert_allclose(feats["log_succ"][:, 0], [math.log(3), math.log(2)], rtol=1e-6)
    # L2 distances 1, 2, 3, 4, then the last one repeated for the 6 missing neighbours
    np.testing.assert_allclose(feats["knn_dist"][0], [1, 2, 3, 4] + [4] * 6, rtol=1e-6)
    # distinct values among the top-i: 7 | 7 7 | 7 7 9 | 7 7 9 3 | (no more)
    want = np.log([1, 1, 2, 3] + [3] * 6)
    np.testing.assert_allclose(feats["knn_distinct"][1], want, rtol=1e-6)


def test_density_features_padding_and_empty_rows() -> None:
    dist = np.array([[0.0, 9.0, np.inf], [np.inf, np.inf, np.inf]], np.float32)
    vals = np.array([[4, 5, -1], [-1, -1, -1]])
    f = density_features(dist, vals, n=4)
    np.testing.assert_allclose(
        f[0], [0, 3, 3, 3, 0, math.log(2), math.log(2), math.log(2)], rtol=1e-6
    )
    np.testing.assert_array_equal(f[1], np.zeros(8, np.float32))


def test_feature_groups() -> None:
    assert features_of_groups(["distribution"]) == ("conf", "entropy")
    assert features_of_groups(["distribution"], query=True) == ("conf", "entropy", "query")
    all_groups = features_of_groups(["distribution", "lexical", "density"])
    assert all_groups == DEFAULT_FEATURES
    assert features_of_groups(["distribution", "lexical"]) == GATE_FEATURES
    with pytest.raises(ValueError):
        CalibratorConfig(features=("nope",))


def test_mixture_nll_equals_the_formula() -> None:
    logit = torch.tensor([0.0, math.log(3.0)])  # lambda 0.5 and 0.75
    lm = torch.log(torch.tensor([0.2, 0.1]))
    knn = torch.log(torch.tensor([0.6, 0.0]))
    want = -(math.log(0.5 * 0.2 + 0.5 * 0.6) + math.log(0.25 * 0.1)) / 2
    assert float(mixture_nll(logit, lm, knn)) == pytest.approx(want, rel=1e-6)


def test_untrained_model_answers_init_lambda() -> None:
    cfg = CalibratorConfig(init_lambda=0.3)
    cal = Calibrator(cfg, {n: (10 if n.startswith("knn") else 1) for n in cfg.features})
    feats = {
        n: np.random.default_rng(0).standard_normal((5, w)).astype(np.float32)
        for n, w in cal.widths.items()
    }
    np.testing.assert_allclose(cal.predict(feats), 0.3, rtol=1e-6)
    assert with_prior(cfg, KnnParams(lmbda=0.05)).init_lambda == 0.05
    assert with_prior(cfg, KnnParams(lmbda=0.0)).init_lambda == 0.01
    assert (
        with_prior(CalibratorConfig(init_from_constant=False), KnnParams(lmbda=0.05)).init_lambda
        == 0.25
    )


def test_epochs_shrink_as_the_set_grows() -> None:
    cfg = CalibratorConfig()
    assert [epochs_for(cfg, 100, 100 * d) for d in (1, 2, 3, 4, 5, 10)] == [5, 2, 2, 1, 1, 1]


def test_validation_mask_is_seeded_blocks() -> None:
    cfg = CalibratorConfig(val_block=4, val_share=0.3)
    m = validation_mask(40, cfg, salt=3)
    assert m.shape == (40,) and (m == validation_mask(40, cfg, salt=3)).all()
    assert 0 < m.sum() < 40 and m.sum() % 4 == 0
    assert all(len(set(m[i : i + 4].tolist())) == 1 for i in range(0, 40, 4))


# --- what the calibrator learns (synthetic, seconds) --------------------------------------


def synthetic_split(
    n: int, seed: int, memory: str, day: int = 0, vocab: int = 50
) -> dict[str, np.ndarray]:
    """Held-out tokens as EvalTokens.arrays() gives them, with a chosen kind of memory.

    ``copy``: the memory is an exact copy of the text (nearest key at distance 0, value =
    the gold token); ``random``: values unrelated to the gold, at larger distances.
    ``mixed``: the first half copy, the second half random.
    """
    rng = np.random.default_rng(seed)
    k = 16
    gold = rng.integers(0, vocab, n)
    p_gold = rng.uniform(0.05, 0.3, n)  # the LM gives the gold 5-30%
    dist = np.sort(rng.uniform(20, 60, (n, k)), axis=1).astype(np.float32)
    vals = rng.integers(0, vocab, (n, k)).astype(np.int32)
    copy = np.zeros(n, bool)
    if memory == "copy":
        copy[:] = True
    elif memory == "mixed":
        copy[: n // 2] = True
    vals[copy] = np.where(vals[copy] == gold[copy, None], (vals[copy] + 1) % vocab, vals[copy])
    vals[copy, 0] = gold[copy]
    dist[copy, 0] = 0.0
    vals[~copy] = np.where(vals[~copy] == gold[~copy, None], (vals[~copy] + 1) % vocab, vals[~copy])
    return {
        "target_lm_logprob": np.log(p_gold),
        "distances": dist,
        "values": vals,
        "day": np.full(n, day, np.int32),
        "doc": np.zeros(n, np.int32),
        "gold": gold.astype(np.int64),
        "top_logprob": np.log(rng.uniform(0.3, 0.6, n)).astype(np.float32),
        "entropy": rng.uniform(1, 4, n).astype(np.float32),
        "lexical": rng.uniform(0, 5, (n, 2)).astype(np.float32),
    }


FAST = CalibratorConfig(max_epochs=8, batch_size=32)
PARAMS = KnnParams(k=16, temperature=1.0, lmbda=0.25)


@pytest.mark.parametrize(("memory", "low", "high"), [("random", 0.0, 0.1), ("copy", 0.9, 1.0)])
def test_learns_lambda_from_the_memory(memory: str, low: float, high: float) -> None:
    dev = synthetic_split(2000, 0, memory)
    test = synthetic_split(500, 1, memory)
    res = calibrate_stream(dev, test, PARAMS, FAST)
    assert low <= res.lambdas.min() and res.lambdas.max() <= high


def test_learns_per_token_lambda_from_density() -> None:
    dev = synthetic_split(3000, 0, "mixed")
    dev["trime"] = np.zeros((0, 3))  # an unused per-token array of the harness is ignored
    test = synthetic_split(1000, 1, "mixed")
    res = calibrate_stream(dev, test, PARAMS, FAST)
    assert res.lambdas[:500].min() > 0.9 and res.lambdas[500:].max() < 0.1
    # the gate sees no density feature: it cannot tell the halves apart
    gated = calibrate_stream(dev, test, PARAMS, FAST, gate=gate_config(max_epochs=8), theta=0.99)
    assert gated.skipped_share == 1.0
    np.testing.assert_array_equal(gated.logprobs, test["target_lm_logprob"])


def test_stream_training_days_and_save_load(tmp_path: Path) -> None:
    dev = {
        k: np.concatenate([synthetic_split(600, d, "copy", day=d)[k] for d in (10, 11, 12)])
        for k in synthetic_split(1, 0, "copy")
    }
    test = synthetic_split(200, 5, "copy", day=12)
    res = calibrate_stream(dev, test, PARAMS, FAST, gate=gate_config(), save_dir=tmp_path)
    assert [r["day"] for r in res.reports] == [10, 11, 12]
    assert [r["epochs"] for r in res.reports] == [8, 4, 3]
    assert [r["train_tokens"] + r["val_tokens"] for r in res.reports] == [600, 1200, 1800]
    assert len(res.gate_reports) == 3
    cal = Calibrator.load(tmp_path / "day-12" / "calibrator")
    assert cal.meta["version"] == 3
    feats = _train_parts(test)[0]
    # the saved day-12 model predicts exactly what the stream used on day 12's tests
    np.testing.assert_allclose(cal.predict(feats), res.lambdas, rtol=1e-6)
    assert Calibrator.load(tmp_path / "day-12" / "gate").cfg.features == GATE_FEATURES


def _train_parts(
    split: dict[str, np.ndarray],
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    from memlm.calibrator import gold_knn_logprob, split_features

    feats = split_features(split)
    return (
        {n: feats[n] for n in DEFAULT_FEATURES},
        split["target_lm_logprob"],
        gold_knn_logprob(split, PARAMS),
    )


# --- the engine serves the calibrator of its index version --------------------------------

NEWS = "The harbour authority in Port Elsinore announced a new ferry timetable on Monday. " * 4


def test_engine_trains_saves_and_serves_the_calibrator(tmp_path: Path) -> None:
    from memlm.encoder import Encoder
    from memlm.engine import Engine

    enc = Encoder.load("tiny-llama", threads=1)
    knn = KnnParams(k=8, temperature=1.0, lmbda=0.5)
    # the calibrator against the constant (the evidence has its own tests)
    eng = Engine.open(tmp_path / "data", encoder=enc, knn=knn, gate_theta=0.0, evidence=False)
    eng.process_document(1, NEWS, 19000, policy="fullmem")
    assert (tmp_path / "data" / "lexical.npz").exists()
    info = eng.rebuild()
    vdir = tmp_path / "data" / "index" / f"v{info.version:06d}"
    assert (vdir / "lexical.npz").exists()
    assert eng.predict("The harbour authority in Port").lam == 0.5  # no calibrator yet
    # three 64-token validation blocks' worth: the calibrator must beat the constant on them
    report = eng.train_calibrator([NEWS * 3], day=19000)
    n = len(enc.tokenize(NEWS * 3)) - 1
    choice = report["interpolation"]
    assert choice["calibrator"]["val_tokens"] > 0
    assert choice["calibrator"]["val_nll"] < choice["calibrator"]["constant_val_nll"]
    assert choice["lambda_source"] == "calibrator"
    assert report["trained"] is True and report["training_tokens"] == report["new_tokens"] == n
    assert report["calibrator"]["epochs"] == 5 and report["calibrator"]["warm_start"] is False
    assert report["calibrator"]["train_tokens"] + report["calibrator"]["val_tokens"] == n
    assert report["gate"]["epochs"] == 5
    assert (vdir / "calibrator" / "calibrator.json").exists() and (vdir / "gate").exists()
    cal_meta = Calibrator.load(vdir / "calibrator").meta
    assert eng.stats()["calibrator"] == {
        "active": True,
        "index_version": info.version,
        "trained_for": info.version,
        "train_tokens": cal_meta["train_tokens"],
        "val_tokens": n - cal_meta["train_tokens"],
        "gate": True,
        "gate_theta": 0.0,
        "training": False,
        "pending_tokens": 0,
    }
    pred = eng.predict("The harbour authority in Port")
    ids = enc.tokenize("The harbour authority in Port")
    out = enc.encode_ids(ids + [ids[0]])  # the last row predicts after "Port"
    dist, _, vals = eng.memory.index.search_values(out.keys[-1:], knn.k)
    cal = Calibrator.load(vdir / "calibrator")
    want = eng.calibration.served.calibrated(
        out.top_logprob[-1:], out.entropy[-1:], out.prev_tokens[-1:], dist, vals
    )
    assert want is not None and pred.lam == pytest.approx(float(want[0]), rel=1e-4)
    assert cal.meta["index_version"] == info.version
    # a second process serving the same version loads the same calibrator
    other = Engine.open(tmp_path / "data2", encoder=enc, knn=knn)
    assert other.calibration.calibrator is None
    assert eng.calibration.load_for(tmp_path / "data" / "index", info.version)
    # the gate at theta 1 skips every search: the LM answer stands
    eng.calibration.theta = 1.0
    gated = eng.predict("The harbour authority in Port")
    assert gated.lam == 0.0
    assert all(s.knn_prob == 0.0 for s in gated.suggestions)
    sc = eng.score(NEWS)
    np.testing.assert_allclose(sc.logprobs, sc.lm_logprobs, rtol=1e-6)


# --- the served interpolation: the calibrator only where it beats the constant ------------


def test_the_calibrator_is_served_only_when_it_beats_the_constant(tmp_path: Path) -> None:
    from memlm.calibrator import ServedCalibration, training_set, validation_rows
    from memlm.calibrator.constant import SERVED_GRID
    from memlm.calibrator.stream import token_rows
    from memlm.knnlm import interpolate

    days = (10, 11)
    parts = [synthetic_split(640, d, "mixed", day=d) for d in days]
    for d, p in zip(days, parts, strict=True):
        p["doc"] = np.full(len(p["day"]), d, np.int64)
    split = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    served = ServedCalibration(tmp_path, 50, default=KnnParams(k=16, temperature=1.0, lmbda=0.02))
    assert served.add_heldout(split, 1) == 1280
    root = tmp_path / "index"
    grid = SERVED_GRID.fixed(k=16)  # the synthetic records hold 16 neighbours
    choice = served.choose_constant(grid, min_tokens=1)
    assert choice.source == "tuned"
    report = served.retrain(choice.params, root, 1, cfg=FAST)
    record = served.choose(choice, grid, root, 1)

    # the comparison, by hand: the calibrator's own validation tokens, both mixtures on them
    cal = Calibrator.load(root / "v000001" / "calibrator")
    rows = served.training_rows()
    val_mask = validation_rows(rows, cal.cfg)
    assert int(val_mask.sum()) == report["calibrator"]["val_tokens"]  # the split retrain made
    val = training_set(token_rows(rows, val_mask), choice.params, cal.cfg.features)
    const_nll = -interpolate(
        val.lm_lp.astype(np.float64),
        val.knn_lp.astype(np.float64),
        choice.params.lmbda,
        np.ones(len(val), bool),
    ).mean()
    got = record["calibrator"]
    assert got["calibrator_version"] == 1 and got["val_tokens"] == len(val) > 0
    assert got["val_nll"] == pytest.approx(cal.nll(val), rel=1e-6)
    assert got["constant_val_nll"] == pytest.approx(const_nll, rel=1e-12)
    # half the memory copies the text, half is noise: lambda per token beats any constant
    assert got["beats_constant"] is True and record["lambda_source"] == "calibrator"
    assert (record["k"], record["temperature"], record["lambda"]) == (
        choice.params.k,
        choice.params.temperature,
        choice.params.lmbda,
    )
    assert served.load_for(root, 1) is True
    first = served.served
    assert first.lambda_source == "calibrator" and first.params == choice.params
    assert (
        first.calibrated(
            split["top_logprob"][:3],
            split["entropy"][:3],
            np.zeros(3, np.int64),
            split["distances"][:3],
            split["values"][:3],
        )
        is not None
    )

    # version 2 holds a calibrator that says lambda = 0.95 everywhere: the constant wins
    widths = {n: v.shape[1] for n, v in val.feats.items()}
    Calibrator(CalibratorConfig(init_lambda=0.95), widths).save(root / "v000002" / "calibrator")
    record2 = served.choose(choice, grid, root, 2)
    assert record2["calibrator"]["calibrator_version"] == 2
    assert record2["calibrator"]["beats_constant"] is False
    assert record2["lambda_source"] == "constant"
    assert served.load_for(root, 2) is False
    second = served.served
    assert second is not first and second.lambda_source == "constant"
    assert served.calibrator is None and second.calibrator is not None  # loaded, not used
    lam = second.lambdas(
        split["top_logprob"][:4],
        split["entropy"][:4],
        np.zeros(4, np.int64),
        split["distances"][:4],
        split["values"][:4],
        np.ones(4),
    )
    np.testing.assert_array_equal(lam, np.full(4, choice.params.lmbda))
    # the snapshot a call read before the swap is unchanged: one version's parameters
    assert first.lambda_source == "calibrator" and first.version == 1
    assert second.to_json()["lambda_source"] == "constant"
    assert second.to_json()["chosen_for"] == 2
