"""``memlm eval`` with consolidating policies (+cons, +budget) beside the others."""

from __future__ import annotations

from pathlib import Path

import pytest

from memlm.encoder import Encoder
from memlm.evaluate import evaluate
from memlm.evaluate.config import policy_parts
from memlm.knnlm import KnnParams
from tests.test_evaluate_stream import _cfg, _stream


@pytest.fixture(scope="module")
def enc() -> Encoder:
    return Encoder.load("tiny-llama", threads=1)


def test_policy_names_take_modifiers() -> None:
    assert policy_parts("monim") == ("monim", False, False)
    assert policy_parts("monim+cons+budget") == ("monim", True, True)
    with pytest.raises(ValueError, match="unknown modifiers"):
        policy_parts("monim+merge")


def test_consolidating_policies_run_like_any_other(
    tmp_path: Path, enc: Encoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MEMLM_CACHE_DIR", str(tmp_path / "cache"))
    cfg = _cfg(
        policies=("fullmem", "monim", "monim+cons", "fullmem+budget"),
        consolidate_sample=64,
        # a weight on the memory that lets an entry fail: the served default's lambda
        # (0.005) keeps log p below log 0.005 + ..., under any delta near MoNIM's
        ingest=KnnParams(k=16, temperature=10.0, lmbda=0.5),
        delta=-3.0,
        budget=150,
        forgetting_policies=(),
    )
    report = evaluate(cfg, _stream(), tmp_path / "out", encoder=enc, echo=str)
    days = {name: rows for name, rows in report["per_day"].items()}
    res = report["results"]
    # the first day both store against an empty memory; then consolidation retires some
    # (and the memory MoNIM decides against differs)
    assert days["monim+cons"][0]["stored"] == days["monim"][0]["stored"]
    nights = [r["consolidation"] for r in days["monim+cons"]]
    assert all(n is not None and n["examined"] <= 64 for n in nights)
    retired = sum(n["retired"]["test"] for n in nights)
    assert retired > 0
    stored = sum(r["stored"] for r in days["monim+cons"])
    assert res["monim+cons"]["entries"] == stored - retired
    # the budget holds after every build
    assert all(r["entries"] <= 150 for r in days["fullmem+budget"])
    assert res["fullmem+budget"]["entries"] == 150
    assert days["fullmem"][-1]["entries"] > 150
