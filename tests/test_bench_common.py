"""benchmarks/_common.py: the helpers every benchmark script shares (no timing asserted)."""

from __future__ import annotations

import importlib.util
import socket
import statistics
import sys
from pathlib import Path
from types import ModuleType

import pytest


def _load() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "_common.py"
    spec = importlib.util.spec_from_file_location("bench_common", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_common"] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


common = _load()


def test_markdown_table_pads_and_aligns() -> None:
    out = common.markdown_table(["path", "p50 ms"], [("bare", 3.04), ("engine.predict", 38.25)])
    assert out.splitlines() == [
        "| path           | p50 ms |",
        "|----------------|-------:|",
        "| bare           |    3.0 |",
        "| engine.predict |   38.2 |",
    ]


def test_markdown_table_alignment_digits_and_errors() -> None:
    out = common.markdown_table(["a", "b"], [(1, 2.5)], align="rl", digits=2)
    assert out.splitlines()[1:] == ["|----:|------|", "|   1 | 2.50 |"]
    with pytest.raises(ValueError, match="every row needs 2 cells"):
        common.markdown_table(["a", "b"], [(1,)])
    with pytest.raises(ValueError, match="align"):
        common.markdown_table(["a", "b"], [(1, 2)], align="lx")


def test_interleaved_calls_every_path_once_per_round_in_order() -> None:
    calls: list[str] = []
    rounds: list[int] = []
    times = common.interleaved(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
        rounds=3,
        warmup=2,
        before_round=lambda: rounds.append(len(calls)),
    )
    assert calls == ["a", "b"] * 5
    assert rounds == [0, 2, 4, 6, 8]  # before every round, warm-up included
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
    assert all(t >= 0 for v in times.values() for t in v)
    assert common.best_of({"a": [0.3, 0.1, 0.2]}) == {"a": 0.1}


def test_alternating_runs_configurations_in_turn() -> None:
    seen: list[tuple[int, str]] = []
    out = common.alternating(
        ["x", "y"], 2, run=lambda c: c * 2, report=lambda rep, c, r: seen.append((rep, r))
    )
    assert out == {"x": ["xx", "xx"], "y": ["yy", "yy"]}
    assert seen == [(0, "xx"), (0, "yy"), (1, "xx"), (1, "yy")]


def test_percentiles_and_summaries() -> None:
    values = [float(i) for i in range(1, 101)]
    assert (
        common.percentile(values, 50) == statistics.quantiles(values, n=100, method="inclusive")[49]
    )
    assert common.percentile([], 50) != common.percentile([], 50)  # NaN
    assert common.percentile([7.0], 99) == 7.0
    st = common.stats_ms([0.001, 0.003])
    assert st["mean"] == pytest.approx(2.0) and st["max"] == pytest.approx(3.0)
    assert common.mean_sd([1.0, 3.0]) == (2.0, statistics.stdev([1.0, 3.0]))
    assert common.mean_sd([5.0]) == (5.0, 0.0)


def test_stopwatch_free_port_and_load_average() -> None:
    with common.stopwatch() as t:
        sum(range(1000))
    assert t.seconds > 0 and t.ms == t.seconds * 1000
    port = common.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free: binding it works
    assert len(common.load_average().split()) == 3


def test_recall_counts_true_neighbours_found_and_ignores_padding() -> None:
    import numpy as np

    found = np.array([[1, 2, -1], [6, 5, 4]])  # -1: fewer neighbours than asked
    truth = np.array([[1, 2, 3], [4, 9, 6]])
    assert common.recall(found, truth) == pytest.approx(4 / 6)
    assert common.recall(truth, truth) == 1.0
    assert common.recall(np.full((2, 3), -1), truth) == 0.0
