"""The served combination: lambda = max(evidence, calibrator) per token, served only where it
beats the evidence alone in each view of the validation tokens (memlm.calibrator.combined)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from memlm.calibrator import Calibrator, CalibratorConfig, ServedCalibration
from memlm.calibrator.combined import combine, decide, view_nlls
from memlm.calibrator.constant import ConstantChoice, TuneGrid
from memlm.calibrator.evidence import PRIOR
from memlm.calibrator.retrain import choose
from memlm.calibrator.served import ServedInterpolation
from memlm.knnlm import KnnParams, interpolate, knn_logprob

Q = 100.0  # squared norm of every query
K = 10  # neighbours per row (the calibrator's density features read 10)
GOLD = 3


def constant_calibrator(lam: float) -> Calibrator:
    """An untrained calibrator: exactly ``lam`` for every token."""
    cfg = CalibratorConfig(init_lambda=lam, init_from_constant=False)
    return Calibrator(cfg, {"conf": 1, "entropy": 1, "log_freq": 1, "log_succ": 1} | _dens())


def _dens() -> dict[str, int]:
    return {"knn_dist": 10, "knn_distinct": 10}


def _rows(n: int, s: float, right: bool, seed: int) -> dict[str, np.ndarray]:
    """n held-out rows whose nearest neighbour is at relative distance ~s; all neighbours
    hold the gold token when ``right``, other tokens otherwise; p_LM(gold) = 1/20."""
    rng = np.random.default_rng(seed)
    d1 = ((s + rng.normal(0, 0.01, n)) ** 2) * Q
    dist = (d1[:, None] + np.arange(K)[None, :] * 0.5).astype(np.float32)
    vals = np.full((n, K), GOLD if right else 7, np.int32)
    return {
        "target_lm_logprob": np.full(n, math.log(1 / 20)),
        "distances": dist,
        "values": vals,
        "gold": np.full(n, GOLD, np.int64),
        "qnorm": np.full(n, Q, np.float32),
        "context": np.full(n, 200.0, np.float32),
        "top_logprob": np.full(n, math.log(0.3), np.float32),
        "entropy": np.full(n, 2.0, np.float32),
        "lexical": np.zeros((n, 2), np.float32),
        "day": np.full(n, 5, np.int32),
        "doc": np.arange(n, dtype=np.int64) // 100,
    }


def _with_seen(held: dict[str, np.ndarray], seen: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {**held, "seen_distances": seen["distances"], "seen_values": seen["values"]}


def test_combine_is_the_larger_lambda_of_each_token() -> None:
    ev = np.array([0.9, 0.01, 0.3])
    cal = np.array([0.2, 0.1, 0.3])
    np.testing.assert_array_equal(combine(ev, cal), [0.9, 0.1, 0.3])


def test_the_served_combination_takes_the_max_per_token() -> None:
    """Near matches keep the evidence's ~0.99, far ones get the calibrator's 0.3: neither
    source alone (nor their mean) gives both."""
    near, far = _rows(4, 0.02, True, 1), _rows(4, 0.7, True, 2)
    rows = {k: np.concatenate([near[k], far[k]]) for k in near}
    params = KnnParams(k=K, temperature=2.0, lmbda=0.05)
    cal = constant_calibrator(0.3)
    served = ServedInterpolation(
        params, calibrator=cal, use_calibrator=True, evidence=PRIOR, calibrator_temperature=5.0
    )
    assert served.lambda_source == "combined" and served.uses_calibrator
    got, temps = served.mix_of(
        rows["top_logprob"],
        rows["entropy"],
        rows["lexical"],
        rows["distances"],
        rows["values"],
        rows["qnorm"],
        rows["context"],
    )
    ev = PRIOR.lambdas(rows["distances"], rows["values"], rows["qnorm"], 2.0, rows["context"])
    assert (ev[:4] > 0.9).all() and (ev[4:] < 0.01).all()
    np.testing.assert_allclose(got, np.maximum(ev, 0.3))
    # each token mixes p_kNN at the T of the source whose lambda it took
    np.testing.assert_array_equal(temps, [2.0] * 4 + [5.0] * 4)
    # without the calibrator's part the evidence alone answers
    alone = ServedInterpolation(params, calibrator=cal, use_calibrator=False, evidence=PRIOR)
    assert alone.lambda_source == "evidence"
    np.testing.assert_allclose(
        alone.lambdas_of(
            rows["top_logprob"],
            rows["entropy"],
            rows["lexical"],
            rows["distances"],
            rows["values"],
            rows["qnorm"],
            rows["context"],
        ),
        ev,
    )


def test_view_nlls_mix_each_source_at_its_own_temperature() -> None:
    """Near tokens keep the evidence's lambda and T 1, far ones take the calibrator's 0.3
    and its T 4: the combination's NLL mixes p_kNN per token at the deciding source's T."""
    near, far = _rows(30, 0.02, True, 3), _rows(30, 0.5, True, 4)
    rows = {k: np.concatenate([near[k], far[k]]) for k in near}
    rows["values"][:, 5:] = 9  # half the neighbours disagree: p_kNN depends on T
    cal = constant_calibrator(0.3)
    got = view_nlls(rows, PRIOR, cal, K, 1.0, 4.0)
    d, v = rows["distances"], rows["values"]
    ids = np.where(v >= 0, 0, -1)
    ev = PRIOR.lambdas(d, v, rows["qnorm"], 1.0, rows["context"])
    assert (ev[:30] > 0.3).all() and (ev[30:] < 0.3).all()
    t = np.where(np.arange(60) < 30, 1.0, 4.0)
    knn_t = knn_logprob(d, ids, v, rows["gold"][:, None], t)[:, 0]
    knn_1 = knn_logprob(d, ids, v, rows["gold"][:, None], 1.0)[:, 0]
    lm, has = rows["target_lm_logprob"], np.ones(60, bool)
    assert got["tokens"] == 60
    assert got["evidence_nll"] == pytest.approx(-interpolate(lm, knn_1, ev, has).mean())
    want = -interpolate(lm, knn_t, np.maximum(ev, 0.3), has).mean()
    assert got["combined_nll"] == pytest.approx(want)
    # one T for both (the evidence's) gives another number: the per-source T is used
    one_t = -interpolate(lm, knn_1, np.maximum(ev, 0.3), has).mean()
    assert abs(one_t - want) > 1e-3


@pytest.mark.parametrize(
    ("held_right", "seen_right", "serve", "lost"),
    [
        (True, True, True, None),  # the calibrator's 0.3 helps in both views
        (True, False, False, "seen"),  # helps held-out text, costs the seen view
        (False, True, False, "held-out"),  # helps the seen view, costs held-out text
    ],
)
def test_the_combination_serves_only_where_it_wins_in_each_view(
    held_right: bool, seen_right: bool, serve: bool, lost: str | None
) -> None:
    """Held-out rows at s 0.4 (the evidence's lambda ~0.002); seen rows at s 0.6 (~0):
    the calibrator's constant 0.3 helps a view whose neighbours hold the gold token and
    hurts one whose neighbours do not.  A rule that read one view only, or the mean of
    the two, would serve in the second or third case (the held-out gain is larger)."""
    held = _rows(400, 0.4, held_right, 4)
    seen = _rows(400, 0.6, seen_right, 5)
    rows = _with_seen(held, seen)
    val = np.zeros(400, bool)
    val[::2] = True
    got = decide(rows, val, PRIOR, constant_calibrator(0.3), K, 2.0, 2.0)
    assert got["serve"] is serve
    assert got["views"]["held-out"]["tokens"] == got["views"]["seen"]["tokens"] == 200
    h, s = got["views"]["held-out"], got["views"]["seen"]
    assert (h["combined_nll"] < h["evidence_nll"]) is held_right
    assert (s["combined_nll"] < s["evidence_nll"]) is seen_right
    if lost is not None:
        assert got["reason"] == f"the evidence alone is better in the {lost} view"
        # the mean of the two views favours the combination: only a per-view rule refuses
        mean_comb = (h["combined_nll"] + s["combined_nll"]) / 2
        mean_ev = (h["evidence_nll"] + s["evidence_nll"]) / 2
        assert mean_comb < mean_ev


def test_no_seen_view_or_no_calibrator_keeps_the_evidence() -> None:
    held = _rows(200, 0.4, True, 6)
    val = np.ones(200, bool)
    got = decide(held, val, PRIOR, constant_calibrator(0.3), K, 2.0, 2.0)
    assert (got["serve"], got["reason"]) == (False, "no validation token has a seen view")
    assert decide(_with_seen(held, held), val, PRIOR, None, K, 2.0, 2.0)["serve"] is False


def test_a_tie_in_one_view_serves_only_with_a_gain_in_the_other() -> None:
    """Exact matches in the seen view: the evidence's 0.99 is the max wherever it serves, so
    that view ties; the held-out gain decides.  A tie in every view keeps the evidence."""
    held, exact = _rows(200, 0.4, True, 7), _rows(200, 0.0, True, 8)
    val = np.ones(200, bool)
    got = decide(_with_seen(held, exact), val, PRIOR, constant_calibrator(0.3), K, 2.0, 2.0)
    s = got["views"]["seen"]
    assert s["combined_nll"] == s["evidence_nll"] and got["serve"] is True
    tie = decide(_with_seen(exact, exact), val, PRIOR, constant_calibrator(0.3), K, 2.0, 2.0)
    assert tie["serve"] is False


@pytest.mark.parametrize(
    ("held_gain", "seen_loss", "serve"),
    [
        (0.006, 0.0005, True),  # the 57-day stream's evenings: a gain pays a tiny seen loss
        (0.006, 0.0, True),
        (0.0004, 0.0005, False),  # the seen loss is larger than the gain that would pay it
        (0.006, 0.0015, False),  # over the tolerance, whatever the gain
        (0.0, 0.0005, False),  # no gain anywhere
        (-0.001, 0.0, False),  # held-out text gets no tolerance
    ],
)
def test_the_seen_view_tolerates_a_loss_the_held_out_gain_pays_for(
    monkeypatch: pytest.MonkeyPatch, held_gain: float, seen_loss: float, serve: bool
) -> None:
    """The rule itself, on given per-view NLLs (the views' NLLs: the tests above)."""
    from memlm.calibrator import combined

    assert math.isclose(combined.SEEN_TOLERANCE, 1e-3)
    nll = {"held-out": (3.2, 3.2 - held_gain), "seen": (0.027, 0.027 + seen_loss)}

    def fake(rows: dict[str, np.ndarray], *_: object) -> dict[str, object]:
        name = "seen" if "seen" in rows else "held-out"
        ev, comb = nll[name]
        return {"tokens": 10, "evidence_nll": ev, "combined_nll": comb}

    monkeypatch.setattr(combined, "view", lambda rows, name: {name: np.zeros(1)})
    monkeypatch.setattr(combined, "view_nlls", fake)
    rows = {"gold": np.zeros(4)}
    got = combined.decide(rows, np.ones(4, bool), PRIOR, constant_calibrator(0.3), K, 2.0, 2.0)
    assert got["serve"] is serve
    assert got["seen_tolerance"] == combined.SEEN_TOLERANCE
    if not serve and held_gain > 0 and seen_loss > 0:
        assert got["reason"] == "the evidence alone is better in the seen view"


def test_a_build_records_the_decision_and_the_loader_serves_the_combination(
    tmp_path: Path,
) -> None:
    """choose() with the evidence on: the calibrator saved beside the version joins the
    evidence when it wins in both views; ServedCalibration then serves the max, at the
    evidence's k and T; a later build where it loses serves the evidence alone.  (The
    evidence is given as fitted, the prior: fitted on these rows it would learn their one
    distance and tie the max; the fit itself: tests/test_evidence.py.)"""
    fitted = (PRIOR, {"k": K, "temperature": 2.0, "source": "prior"})
    root = tmp_path / "index"
    cal = constant_calibrator(0.3)
    cal.meta["index_version"] = 1
    cal.save(root / "v000001" / "calibrator")
    params = KnnParams(k=K, temperature=2.0, lmbda=0.05)
    choice = ConstantChoice(params, "tuned", 800, 800, None, None)
    grid = TuneGrid(ks=(K,), temperatures=(2.0,), lambdas=(0.05,))
    rows = _with_seen(_rows(800, 0.4, True, 9), _rows(800, 0.6, True, 10))
    rec = choose(rows, choice, grid, root, 1, evidence=True, fitted=fitted)
    assert rec["lambda_source"] == "combined"
    assert rec["evidence"]["combined"]["serve"] is True
    served = ServedCalibration(tmp_path / "data", 50, default=params, evidence=True)
    served.load_for(root, 1)
    s = served.served
    assert s.lambda_source == "combined" and served.calibrator is not None
    assert s.calibrator_temperature == rec["evidence"]["combined"]["calibrator_temperature"]
    assert s.calibrator_temperature == params.temperature  # trained at the constant's T
    assert (s.params.k, s.params.temperature) == (K, rec["evidence"]["temperature"])
    r = _rows(6, 0.5, True, 11)
    lam = s.lambdas_of(
        r["top_logprob"], r["entropy"], r["lexical"], r["distances"], r["values"], r["qnorm"]
    )
    ev = s.evidence.lambdas(r["distances"], r["values"], r["qnorm"], s.params.temperature)
    np.testing.assert_allclose(lam, np.maximum(ev, 0.3))
    # version 2: the seen view's neighbours are wrong, the combination loses there
    cal.save(root / "v000002" / "calibrator")
    rows2 = _with_seen(_rows(800, 0.4, True, 9), _rows(800, 0.6, False, 10))
    rec2 = choose(rows2, choice, grid, root, 2, evidence=True, fitted=fitted)
    assert rec2["lambda_source"] == "evidence"
    served.load_for(root, 2)
    assert served.served.lambda_source == "evidence" and served.calibrator is None


NEWS = [
    "The harbour authority in Port Elsinore announced a new ferry timetable on Monday, "
    "adding two crossings every weekday morning and one on Sunday evenings.",
    "Ferry operators said the timetable would cut waiting times at the harbour by half "
    "and that ticket prices would not change before the end of the year.",
    "The central bank left its key interest rate unchanged and warned that rising "
    "energy prices could keep inflation above its target until next spring.",
    "Heavy snow closed schools across the north of Scotland for a second day on Friday, "
    "and several rural roads stayed closed while gritters worked through the night.",
    "Port Elsinore's mayor welcomed the new ferry timetable and promised a bigger car "
    "park beside the harbour before the summer season begins.",
    "Economists expect the central bank to raise interest rates before the summer if "
    "energy prices keep rising at the pace of the last three months.",
]


def test_the_engine_serves_what_its_build_chose_after_a_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The service's engine (evidence on, every document's held-out tokens recorded with
    their seen view): a build records the decision in both views and the engine serves what
    it says.  On this tiny random model the combination loses the held-out view, so the
    evidence serves; with the decision forced (the decision itself: the tests above) the
    next build serves the combination and /predict answers with the max of the two
    lambdas, at the evidence's k and T."""
    from memlm.calibrator import retrain
    from memlm.calibrator.heldout import HeldOutConfig
    from memlm.encoder import Encoder
    from memlm.engine import Engine

    enc = Encoder.load("tiny-llama", threads=1)
    eng = Engine.open(
        tmp_path / "data",
        encoder=enc,
        knn=KnnParams(k=8, temperature=1.0, lmbda=0.5),
        policy="fullmem",
        grid=TuneGrid((8,), (1.0, 4.0), (0.1, 0.5)),
        tune_min_tokens=32,
        heldout=HeldOutConfig(enabled=True, share=1.0, day_tokens=4096, min_tokens=64),
        evidence=True,
    )
    for i, text in enumerate(NEWS * 3):
        eng.process_document(i + 1, text, 19000 + i // 6)
    info = eng.rebuild()
    assert info.calibrator["trained"] is True
    rec = info.interpolation
    dec = rec["evidence"]["combined"]
    assert set(dec["views"]) == {"held-out", "seen"} and dec["views"]["seen"]["tokens"] > 0
    h = dec["views"]["held-out"]
    assert dec["serve"] is False and h["combined_nll"] > h["evidence_nll"]
    assert rec["lambda_source"] == eng.calibration.served.lambda_source == "evidence"
    assert eng.stats()["calibrator"]["active"] is False

    real = retrain.decide
    monkeypatch.setattr(retrain, "decide", lambda *a: {**real(*a), "serve": True})
    for i, text in enumerate(NEWS):
        eng.process_document(100 + i, text.replace("the", "a"), 19003)
    info = eng.rebuild()
    assert info.interpolation["lambda_source"] == "combined"
    served = eng.calibration.served
    assert served.lambda_source == "combined" and eng.stats()["calibrator"]["active"] is True
    ev_rec = info.interpolation["evidence"]
    assert (served.params.k, served.params.temperature) == (8, ev_rec["temperature"])
    context = NEWS[4][: NEWS[4].index(" timetable")]
    pred = eng.predict(context)
    ids = enc.tokenize(context)
    out = enc.encode_ids(ids + [ids[0]])  # the last row predicts after the context
    dist, _, vals = eng.memory.search(out.keys[-1:], 10)
    qnorm = (out.keys[-1:].astype(np.float64) ** 2).sum(axis=1)
    ev = served.evidence.lambdas(
        dist[:, :8], vals[:, :8], qnorm, served.params.temperature, out.positions[-1:]
    )
    cal = served.calibrated(
        out.top_logprob[-1:], out.entropy[-1:], out.prev_tokens[-1:], dist, vals
    )
    assert cal is not None and float(cal[0]) != pytest.approx(float(ev[0]), rel=1e-3)
    assert pred.lam == pytest.approx(max(float(ev[0]), float(cal[0])), rel=1e-4)
    # /score: each token at the lambda and T of the source that decides it
    text = NEWS[1].replace("the", "a")
    sc = eng.score(text)
    _, o = eng._encode(text)
    d, _, v = eng.memory.search(o.keys, 10)
    q = (o.keys.astype(np.float64) ** 2).sum(axis=1)
    lam, temps = served.mix(o.top_logprob, o.entropy, o.prev_tokens, d, v, q, o.positions)
    assert set(np.unique(temps)) == {served.params.temperature, served.calibrator_temperature}
    dk, vk = d[:, :8], v[:, :8]
    knn = knn_logprob(dk, np.where(vk >= 0, 0, -1), vk, o.targets[:, None], temps)[:, 0]
    want = interpolate(o.target_logprob.astype(np.float64), knn, lam, vk[:, 0] >= 0)
    np.testing.assert_allclose(sc.logprobs, want, rtol=1e-6)
