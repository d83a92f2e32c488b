"""benchmarks/replay.py: the harness command it compares with and its figures (no server)."""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType


def _load() -> ModuleType:
    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))  # the script imports ``_common`` as a sibling
    try:
        spec = importlib.util.spec_from_file_location("bench_replay", bench / "replay.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bench_replay"] = mod
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(bench))


replay = _load()


def _args(**kw: object) -> argparse.Namespace:
    base = {
        "start": "2017-01-06",
        "days": 3,
        "max_docs_per_day": 8,
        "precision": "float32",
        "threads": None,
        "lam": "served",
    }
    return argparse.Namespace(**{**base, **kw})


def test_eval_command_runs_the_served_policy_and_interpolation() -> None:
    cmd = replay.eval_command(_args(), Path("/tmp/out"))
    assert cmd[1:] == [
        "-m",
        "memlm.cli",
        "eval",
        "--out",
        "/tmp/out",
        "--start",
        "2017-01-06",
        "--days",
        "3",
        "--policies",
        "monim",
        "--lambda",
        "served",
        "--precision",
        "float32",
        "--device",
        "cpu",
        "--forgetting",
        "",
        "--no-names",
        "--max-docs-per-day",
        "8",
    ]


def test_eval_command_compares_with_the_interpolation_asked_for() -> None:
    cmd = replay.eval_command(_args(lam="evidence"), Path("o"))
    assert cmd[cmd.index("--lambda") + 1] == "evidence"


def test_eval_command_whole_days_and_threads() -> None:
    cmd = replay.eval_command(_args(max_docs_per_day=None, threads=2), Path("o"))
    assert "--max-docs-per-day" not in cmd
    assert cmd[-2:] == ["--threads", "2"]


def test_server_settings_match_the_eval() -> None:
    s = replay.server_settings(_args(threads=2), Path("/tmp/replay-data"))
    assert (s.policy, s.precision, s.device, s.threads) == ("monim", "float32", "cpu", 2)
    assert s.knn_lambda is None  # the evidence interpolation, as served by default
    assert s.embedded_worker is True


def test_ppl_and_relative_difference() -> None:
    assert replay.ppl([math.log(0.5), math.log(0.125)]) == 4.0
    assert math.isnan(replay.ppl([]))
    assert replay.rel(25.0, 20.0) == "+25.00%"
    assert replay.rel(19.9, 20.0) == "-0.50%"
    assert replay.rel(1.0, 0.0) == "-"


def test_harness_day_ppl_pools_the_documents_of_each_day(tmp_path: Path) -> None:
    path = tmp_path / "test_documents.json"
    path.write_text(
        '{"documents": [{"id": "a", "day": "2017-01-06", "tokens": 2},'
        ' {"id": "b", "day": "2017-01-06", "tokens": 2}, {"id": "c", "day": "2017-01-13",'
        ' "tokens": 1}], "logprob_sums": {"monim": [-1.0, -3.0, -0.5], "bare": [0, 0, 0]}}'
    )
    assert replay.harness_day_ppl(path) == {
        "2017-01-06": math.exp(1.0),
        "2017-01-13": math.exp(0.5),
    }
