"""benchmarks/pareto.py: the frontier, the de-duplication of systems and the thirds."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest


def _load() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "pareto.py"
    spec = importlib.util.spec_from_file_location("bench_pareto", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_pareto"] = mod
    spec.loader.exec_module(mod)
    return mod


pareto = _load()


def _day(seen: int, stored: int, entries: int) -> dict[str, int]:
    return {"tokens_seen": seen, "stored": stored, "entries": entries}


def _report(results: dict[str, tuple[int, float]], per_day: dict[str, list]) -> dict:
    return {
        "results": {
            s: {"entries": e, "test_ppl": p, "test_ppl_ci95": [p - 1, p + 1]}
            for s, (e, p) in results.items()
        },
        "per_day": per_day,
    }


def test_frontier_keeps_only_points_nothing_beats_on_both_axes() -> None:
    P = pareto.Point
    pts = pareto.mark_frontier(
        [
            P("a/bare", "bare", 0, 30.0, (29.0, 31.0)),
            P("a/fullmem", "fullmem", 100, 28.0, (27.0, 29.0)),
            P("a/randmem", "randmem", 50, 29.5, (28.5, 30.5)),
            P("a/budget", "fullmem+budget", 50, 28.1, (27.0, 29.0)),
            P("a/tie", "monim", 100, 28.0, (27.0, 29.0)),  # ties fullmem: neither beats
            P("a/worse", "monim-amt", 60, 28.2, (27.0, 29.0)),  # budget: fewer, lower
        ]
    )
    assert [(p.name, p.frontier) for p in pts] == [
        ("a/bare", True),
        ("a/budget", True),
        ("a/randmem", False),
        ("a/worse", False),
        ("a/fullmem", True),
        ("a/tie", True),
    ]


def test_points_read_each_system_once_and_label_runs(tmp_path: Path) -> None:
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    for d, budget in ((run_a, (40, 28.3)), (run_b, (70, 28.1))):
        d.mkdir()
        rep = _report({"bare": (0, 30.0), "fullmem": (100, 28.0), "fullmem+budget": budget}, {})
        (d / "report.json").write_text(json.dumps(rep))
    reports = pareto.read_runs([f"x={run_a}", str(run_b / "report.json")])
    assert list(reports) == ["x", "b"]
    names = [p.name for p in pareto.points(reports)]
    # bare and fullmem score alike in both runs: once; the two budgets differ: both
    assert names == ["x/bare", "x/fullmem+budget", "b/fullmem+budget", "x/fullmem"]
    with pytest.raises(ValueError, match="two runs labelled"):
        pareto.read_runs([f"x={run_a}", f"x={run_b}"])


def test_thirds_cut_by_tokens_seen_and_report_memrate_and_held_share() -> None:
    # 6 days of 10 tokens: two days a third; a budget of 15 entries binds from day 2
    days = [_day(10, 10, min(10 * (i + 1), 15)) for i in range(6)]
    t = pareto.thirds(days)
    assert [x["days"] for x in t] == [2, 2, 2]
    assert [x["memrate"] for x in t] == [1.0, 1.0, 1.0]
    assert [x["entries_at_end"] for x in t] == [15, 15, 15]
    assert [x["held_share_at_end"] for x in t] == [15 / 20, 15 / 40, 15 / 60]
    # an uneven stream: one big day is a third on its own (its middle falls in the 2nd)
    t = pareto.thirds([_day(10, 5, 5), _day(40, 10, 15), _day(10, 0, 15), _day(10, 10, 25)])
    assert [x["days"] for x in t] == [1, 1, 2]
    assert [x["memrate"] for x in t] == [0.5, 0.25, 0.5]


def test_main_writes_table_json_and_thirds(tmp_path: Path) -> None:
    run = tmp_path / "r"
    run.mkdir()
    per_day = {"fullmem": [_day(10, 10, 10), _day(10, 10, 20), _day(10, 10, 30)]}
    rep = _report({"bare": (0, 30.0), "fullmem": (30, 27.0)}, per_day)
    (run / "report.json").write_text(json.dumps(rep))
    pareto.main([str(run), "--out", str(tmp_path / "out"), "--no-plot"])
    md = (tmp_path / "out" / "pareto.md").read_text()
    assert "| r/fullmem | 30 | 100.0% | 27.000 (26.00-28.00) | +0.00% | * |" in md
    assert "| r/bare | 0 | 0.0% | 30.000 (29.00-31.00) | +11.11% | * |" in md
    assert "| r/fullmem | 100.0% / 100.0% / 100.0% | 100.0% / 100.0% / 100.0% | +0.0 |" in md
    what = json.loads((tmp_path / "out" / "pareto.json").read_text())
    assert [p["name"] for p in what["points"]] == ["r/bare", "r/fullmem"]
