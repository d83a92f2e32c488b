"""`memlm eval`'s options reach EvalConfig: --lambda constant|calibrated, --ingest-*."""

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import memlm.corpus
import memlm.evaluate
from memlm.cli import app
from memlm.knnlm import KnnParams


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Replace the evaluation by a recorder of the config it would run."""
    seen: list[Any] = []

    def fake_evaluate(cfg: Any, docs: Any, out: Path, **_: Any) -> dict[str, Any]:
        seen.append(cfg)
        raise SystemExit(0)

    monkeypatch.setattr(memlm.evaluate, "evaluate", fake_evaluate)
    monkeypatch.setattr(memlm.corpus, "load_corpus", lambda name: [])
    return seen


def test_lambda_calibrated_and_ingest_options(captured: list[Any], tmp_path: Path) -> None:
    args = ["eval", "--out", str(tmp_path), "--lambda", "calibrated", "--gate-theta", "0.05"]
    args += ["--ingest-k", "32", "--ingest-temperature", "3", "--ingest-lambda", "0.1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (cfg,) = captured
    assert cfg.lambda_mode == "calibrated" and type(cfg.lambda_mode) is str
    assert cfg.gate_theta == 0.05
    assert cfg.ingest == KnnParams(k=32, temperature=3.0, lmbda=0.1)


def test_lambda_defaults_to_constant(captured: list[Any], tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["eval", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    (cfg,) = captured
    assert cfg.lambda_mode == "constant" and cfg.gate_theta == 0.0
    assert cfg.ingest == KnnParams(k=64, temperature=5.0, lmbda=0.25)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lambda", "0.25"], "'0.25' is not one of 'constant', 'calibrated'"),
        (["--gate-theta", "0.1"], "needs --lambda calibrated"),
        (["--lambda", "calibrated", "--gate-theta", "1.5"], "must be in [0, 1)"),
    ],
)
def test_bad_lambda_options_are_refused(
    captured: list[Any], tmp_path: Path, args: list[str], message: str
) -> None:
    result = CliRunner().invoke(
        app, ["eval", "--out", str(tmp_path), *args], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 2
    assert message in result.output
    assert captured == []
