"""Pairing evaluation runs over one split: `memlm eval-compare` and its errors."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from memlm.cli import app
from memlm.evaluate.bootstrap import win_share
from memlm.evaluate.paired import PairingError, compare_runs


def _write(path, docs, sums):
    path.mkdir(parents=True, exist_ok=True)
    what = {
        "documents": [{"id": i, "day": "2021-01-01", "tokens": n} for i, n in docs],
        "logprob_sums": sums,
    }
    (path / "test_documents.json").write_text(json.dumps(what))
    return path


def test_runs_are_paired_on_their_shared_documents_as_token_level_scores_are(tmp_path):
    rng = np.random.default_rng(0)
    tokens = [5, 9, 3, 7, 4]
    keys = np.repeat(np.arange(5), tokens)
    a_lp, b_lp = -rng.gamma(2, 1, keys.size), -rng.gamma(2, 1, keys.size)
    a_sums = np.bincount(keys, weights=a_lp).tolist()
    b_sums = np.bincount(keys, weights=b_lp).tolist()
    ids = [f"d{i}" for i in range(5)]
    _write(tmp_path / "A", zip(ids, tokens, strict=True), {"monim": a_sums})
    # run B lists its documents in another order and has one more that A lacks
    order = [3, 1, 4, 0, 2]
    _write(
        tmp_path / "B",
        [(ids[i], tokens[i]) for i in order] + [("extra", 4)],
        {"finetune": [b_sums[i] for i in order] + [-1.0]},
    )
    out = compare_runs({"A": tmp_path / "A", "B": tmp_path / "B"}, resamples=300)
    assert (out["documents"], out["tokens"], out["only_in_some_runs"]) == (5, sum(tokens), 1)
    assert out["systems"]["A/monim"]["ppl"] == pytest.approx(np.exp(-a_lp.mean()))
    assert out["systems"]["B/finetune"]["ppl"] == pytest.approx(np.exp(-b_lp.mean()))
    lo, hi = out["systems"]["A/monim"]["ci"]
    assert lo <= out["systems"]["A/monim"]["ppl"] <= hi
    # documents sorted by id are 0..4 in this order: the same draws as token-level keys
    assert out["win_share"]["A/monim"]["B/finetune"] == pytest.approx(
        win_share(a_lp, b_lp, keys, resamples=300)
    )
    assert out["win_share"]["B/finetune"]["A/monim"] == pytest.approx(
        win_share(b_lp, a_lp, keys, resamples=300)
    )


def test_runs_that_cannot_be_paired_say_why(tmp_path):
    a = _write(tmp_path / "a", [("x", 3)], {"bare": [-3.0]})
    b = _write(tmp_path / "b", [("y", 3)], {"bare": [-3.0]})
    c = _write(tmp_path / "c", [("x", 4)], {"bare": [-3.0]})
    with pytest.raises(PairingError, match="share no test document"):
        compare_runs({"a": a, "b": b})
    with pytest.raises(PairingError, match="x has 3 scored tokens in one run and 4 in c"):
        compare_runs({"a": a, "c": c})
    with pytest.raises(PairingError, match="no such file"):
        compare_runs({"a": a, "gone": tmp_path / "gone"})
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "test_documents.json").write_text("{}")
    with pytest.raises(PairingError, match="not a test_documents.json"):
        compare_runs({"a": a, "bad": tmp_path / "bad"})


def test_the_command_prints_the_table_and_writes_json(tmp_path):
    _write(tmp_path / "r1", [("x", 2), ("y", 2)], {"bare": [-4.0, -4.0], "monim": [-2.0, -3.0]})
    _write(tmp_path / "r2", [("x", 2), ("y", 2)], {"finetune": [-1.0, -2.0]})
    runner = CliRunner(env={"COLUMNS": "500", "NO_COLOR": "1"})
    args = ["eval-compare", str(tmp_path / "r1"), f"ft={tmp_path / 'r2'}", "--resamples", "50"]
    res = runner.invoke(app, [*args, "--json", str(tmp_path / "c.json")])
    assert res.exit_code == 0, res.output
    assert "2 shared test documents, 4 tokens" in res.output
    assert "| ft/finetune | 2.12 (" in res.output  # exp(3 / 4): 3 nats over 4 tokens
    assert "| r1/bare | 7.39 (7.39-7.39) | - | 0% | 0% |" in res.output
    saved = json.loads((tmp_path / "c.json").read_text())
    assert saved["win_share"]["ft/finetune"]["r1/bare"] == 1.0
    # the same system encoded twice (float rounding apart) ties: neither wins
    _write(tmp_path / "r3", [("x", 2), ("y", 2)], {"bare": [-4.0 + 1e-7, -4.0 - 2e-7]})
    out = compare_runs({"r1": tmp_path / "r1", "r3": tmp_path / "r3"}, resamples=50)
    assert out["win_share"]["r1/bare"]["r3/bare"] == out["win_share"]["r3/bare"]["r1/bare"] == 0
    res = runner.invoke(app, ["eval-compare", str(tmp_path / "r1"), str(tmp_path / "r1")])
    assert res.exit_code == 2 and "two runs are labelled 'r1'" in res.output
    res = runner.invoke(app, ["eval-compare", str(tmp_path / "r1"), str(tmp_path / "nope")])
    assert res.exit_code == 2 and "no such file" in res.output
