"""The evidence interpolation: lambda per token from the nearest neighbour's relative
distance and the neighbours' agreement (memlm.calibrator.evidence)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from memlm.calibrator import evidence
from memlm.calibrator.evidence import PRIOR, EvidenceModel, features
from memlm.engine.ingest import seen_view
from memlm.knnlm import interpolate, knn_logprob

Q = 100.0  # squared norm of every query below


def test_features_are_relative_distance_and_agreement() -> None:
    d = np.array([[4.0, 4.0, 9.0], [0.0, 1.0, np.inf], [np.inf, np.inf, np.inf]], np.float32)
    v = np.array([[7, 8, 7], [5, 5, -1], [-1, -1, -1]], np.int32)
    s, agree = features(d, v, np.full(3, Q), temperature=1.0)
    np.testing.assert_allclose(s, [0.2, 0.0, evidence.S_MAX])
    w = np.exp(-np.array([4.0, 4.0, 9.0]))
    assert agree[0] == pytest.approx((w[0] + w[2]) / w.sum())  # the nearest's value: 7
    assert agree[1] == pytest.approx(1.0) and agree[2] == 0.0


def test_the_prior_trusts_exact_agreeing_matches_and_nothing_far() -> None:
    exact = PRIOR.from_features(np.array([0.0]), np.array([1.0]))[0]
    para = PRIOR.from_features(np.array([0.3]), np.array([0.8]))[0]
    far = PRIOR.from_features(np.array([0.55]), np.array([1.0]))[0]
    # "The" starts ten documents that go on differently: a one-token context, disagreeing
    split = PRIOR.from_features(np.array([0.0]), np.array([0.1]), np.array([1.0]))[0]
    assert exact > 0.98 and exact < evidence.LAMBDA_MAX
    assert 0.05 < para < 0.9
    assert far < 0.005  # unrelated text: p >= 0.995 p_LM, never 0.5% worse
    assert split < 0.02  # an exact context that went on in many ways is not trusted
    # lambda falls with distance and rises with agreement, everywhere
    s = np.linspace(0, 1, 21)
    assert (np.diff(PRIOR.from_features(s, np.full(21, 0.7))) < 0).all()
    a = np.linspace(0.01, 1, 21)
    assert (np.diff(PRIOR.from_features(np.full(21, 0.3), a)) > 0).all()


def test_rows_without_neighbours_keep_the_lm() -> None:
    d = np.full((2, 4), np.inf, np.float32)
    v = np.full((2, 4), -1, np.int32)
    assert (PRIOR.lambdas(d, v, np.full(2, Q), 2.0) == 0).all()


def _synthetic(n: int, seed: int, *, near_helps: bool) -> dict[str, np.ndarray]:
    """Held-out rows: near neighbours (s ~ 0.25) carry the gold token when ``near_helps``;
    far ones (s ~ 0.6) never do; the LM gives the gold 1/20."""
    rng = np.random.default_rng(seed)
    near = rng.random(n) < 0.5
    s = np.where(near, 0.25, 0.6) + rng.normal(0, 0.02, n)
    d1 = (s**2) * Q
    dist = np.stack([d1, d1 + 3, d1 + 6, d1 + 9], axis=1).astype(np.float32)
    gold = np.full(n, 3, np.int64)
    right = near & near_helps & (rng.random(n) < 0.9)
    vals = np.where(right[:, None], 3, 7 + np.arange(4)[None, :]).astype(np.int32)
    return {
        "target_lm_logprob": np.full(n, math.log(1 / 20)),
        "distances": dist,
        "values": vals,
        "gold": gold,
        "qnorm": np.full(n, Q, np.float32),
    }


def test_the_fit_learns_where_the_memory_helps() -> None:
    rows = evidence.views(_synthetic(4000, 0, near_helps=True))
    model, nll = evidence.fit(rows, 4, 2.0)
    assert model.source == "fitted" and model.fitted_tokens == 4000
    assert nll < evidence.nll(rows, PRIOR, 4, 2.0)
    test = evidence.views(_synthetic(2000, 1, near_helps=True))
    assert evidence.nll(test, model, 4, 2.0) < evidence.nll(test, PRIOR, 4, 2.0)
    lam = model.from_features(np.array([0.25, 0.6]), np.array([1.0, 1.0]))
    assert lam[0] > 0.5 and lam[1] < 0.01
    # where near neighbours never carry the gold, it learns to distrust them
    bad, _ = evidence.fit(evidence.views(_synthetic(4000, 2, near_helps=False)), 4, 2.0)
    assert bad.from_features(np.array([0.25]), np.array([1.0]))[0] < lam[0] / 4


def test_views_weigh_held_out_and_seen_half_and_half() -> None:
    rows = _synthetic(300, 3, near_helps=True)
    seen_d = np.zeros_like(rows["distances"])
    seen_v = np.full_like(rows["values"], 3)
    seen_v[200:] = -1  # a third recorded without a seen view
    out = evidence.views({**rows, "seen_distances": seen_d, "seen_values": seen_v})
    assert len(out["gold"]) == 500 and out["seen"].sum() == 200
    assert out["weight"][~out["seen"]].sum() == pytest.approx(250)
    assert out["weight"][out["seen"]].sum() == pytest.approx(250)
    # rows recorded before the query norm was kept are left out
    old = evidence.views({**rows, "qnorm": np.full(300, np.nan, np.float32)})
    assert len(old["gold"]) == 0


def test_seen_view_is_the_search_after_the_append() -> None:
    rng = np.random.default_rng(4)
    mem = rng.normal(size=(50, 8)).astype(np.float32)
    mem_v = rng.integers(0, 9, 50).astype(np.int32)
    own = rng.normal(size=(6, 8)).astype(np.float16)
    own_v = np.arange(100, 106, dtype=np.int32)
    q = np.concatenate([own[:3].astype(np.float32), rng.normal(size=(2, 8))]).astype(np.float32)

    def brute(keys: np.ndarray, vals: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        d = ((q[:, None, :] - keys[None].astype(np.float32)) ** 2).sum(-1)
        o = np.argsort(d, axis=1, kind="stable")[:, :k]
        return np.take_along_axis(d, o, 1), vals[o]

    before_d, before_v = brute(mem, mem_v, 5)
    got_d, got_v = seen_view(q, before_d, before_v, own, own_v)
    want_d, want_v = brute(np.concatenate([mem, own.astype(np.float32)]), np.r_[mem_v, own_v], 5)
    np.testing.assert_array_equal(got_v, want_v)
    np.testing.assert_allclose(got_d, want_d, atol=1e-4)
    assert (got_v[:3, 0] == own_v[:3]).all() and (got_d[:3, 0] < 1e-4).all()


def test_choose_fits_on_training_rows_and_validates_on_the_rest(tmp_path: Path) -> None:
    rows = _synthetic(3000, 5, near_helps=True)
    rows["day"] = np.repeat([1, 2, 3], 1000).astype(np.int32)
    val = np.zeros(3000, bool)
    val[::5] = True
    model, rec = evidence.choose(rows, 4, (1.0, 2.0), val, default_temperature=2.0)
    assert rec["train_tokens"] == 2400 and rec["val_tokens"] == 600
    assert rec["val_nll"] == min(rec["prior_val_nll"], *(t["val_nll"] for t in rec["tried"]))
    assert rec["val_nll"] < rec["bare_val_nll"]
    assert rec["temperature"] in (1.0, 2.0) and model.source == "fitted"
    evidence.save(tmp_path, 3, model, rec)
    v, loaded, got = evidence.load(tmp_path, 7)
    assert v == 3 and loaded == model and got["temperature"] == rec["temperature"]
    assert evidence.load(tmp_path, 2) is None
    # no query norms (records from before they were kept): the prior, and why
    no_q = {k: a for k, a in rows.items() if k != "qnorm"}
    assert evidence.choose(no_q, 4, (2.0,), val, default_temperature=2.0)[0] == PRIOR


def test_stream_fits_day_by_day_on_dev() -> None:
    dev = _synthetic(2000, 6, near_helps=True)
    dev["day"] = np.repeat([10, 11], 1000).astype(np.int32)
    test = _synthetic(400, 7, near_helps=True)
    test["day"] = np.repeat([10, 11], 200).astype(np.int32)
    lp, lam, days = evidence.stream(dev, test, 4, (1.0, 2.0))
    assert [d["day"] for d in days] == [10, 11] and all(d["source"] == "fitted" for d in days)
    # day 11's model was fitted on both days' dev tokens
    model = EvidenceModel.from_json({k: v for k, v in days[1].items() if k != "day"})
    t = days[1]["temperature"]
    rows = test["day"] == 11
    d, v = test["distances"][rows], test["values"][rows]
    want = model.lambdas(d, v, test["qnorm"][rows], t)
    np.testing.assert_allclose(lam[rows], want)
    knn = knn_logprob(d, np.where(v >= 0, 0, -1), v, test["gold"][rows, None], t)[:, 0]
    np.testing.assert_allclose(
        lp[rows], interpolate(test["target_lm_logprob"][rows], knn, want, v[:, 0] >= 0)
    )
    assert lp.mean() > test["target_lm_logprob"].mean()  # the memory helps here


TEXT = (
    "Dock workers in the northern port of Varnholt ended a 19-day strike on Tuesday after "
    "the Kessler Maritime Group agreed to raise wages by 7.4 percent over three years."
)


def _recall(eng) -> tuple[int, list[float]]:  # noqa: ANN001 - either backend's engine
    """Top-1 hits of /predict along TEXT at its word positions, and the lambdas."""
    spans = eng.encoder.char_offsets(TEXT)
    ids = eng.encoder.tokenize(TEXT)
    contexts = [TEXT[: spans[i][0]] for i in range(4, len(ids))]
    preds = eng.predict_batch(contexts, top_n=1)
    hits = sum(
        p.suggestions[0].token_id == ids[i] for p, i in zip(preds, range(4, len(ids)), strict=True)
    )
    return hits, [p.lam for p in preds]


@pytest.mark.milvus
def test_the_memory_recalls_what_it_holds_on_faiss_and_on_milvus(
    tmp_path: Path, milvus_url: str
) -> None:
    """From the first document, before any build, on both backends: the prior trusts the
    exact matches of an ingested text (every next token ranked first), with the same
    lambdas on both (the real model's recall against the constant: benchmarks/fresh_recall.py
    and tests/test_api_engine.py)."""
    from memlm.encoder import Encoder
    from memlm.engine import Engine
    from memlm.knnlm import KnnParams

    enc = Encoder.load("tiny-llama", threads=1)
    knn = KnnParams(k=8, temperature=2.0, lmbda=0.005)
    got = {}
    for name, url in (("faiss", None), ("milvus", milvus_url)):
        (tmp_path / name).mkdir()  # the service's data directory (lexical statistics)
        eng = Engine.open(
            tmp_path / name, encoder=enc, knn=knn, policy="fullmem", memory_url=url, evidence=True
        )
        eng.process_document(1, TEXT, 19000)
        assert eng.served.lambda_source == "evidence"
        got[name] = _recall(eng)
        n = len(got[name][1])
        assert got[name][0] == n, got[name]  # every stored next token ranked first
        # exact and agreeing: trusted, a little less while the context is a few tokens
        assert min(got[name][1]) > 0.5 and np.median(got[name][1]) > 0.9
    # the same lambdas (faiss keeps float16 keys, Milvus float32: distances differ a little)
    np.testing.assert_allclose(got["faiss"][1], got["milvus"][1], rtol=1e-2)
