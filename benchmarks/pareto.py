"""Test perplexity against entries held: the Pareto table and plot of `memlm eval` runs.

    python benchmarks/pareto.py full=runs/a b25=runs/b ... --out docs/results/x/pareto

Reads each run's ``report.json`` (``LABEL=PATH`` or ``PATH``: a run directory or the file)
and writes ``pareto.md``, ``pareto.json`` and ``pareto.png``: every system as
``label/system`` with its entries at the end of the stream, their share of FullMem's, its
test perplexity with the report's 95% interval and its change from FullMem; the points
no other point beats on both axes (fewer or as many entries and a perplexity as low or
lower, one of them strictly) are the frontier. A system that two runs score identically
(bare and FullMem in every run of one split) appears once.

Also the stored share per third of the stream (``thirds``): a day belongs to the third
that holds its middle token (scripts/memrate_trend.py's rule, whose MemRate per third this
repeats); per third, the MemRate (entries stored that third / tokens
seen that third) and the share held at the third's end (entries after that evening /
tokens seen so far), which falls under a budget even where the MemRate does not.

Research code beside the product (STYLE.md 16): nothing in ``memlm`` imports it.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Point:
    """One system of one run: entries held at the end against test perplexity."""

    name: str  # label/system
    system: str
    entries: int
    ppl: float
    ci: tuple[float, float]
    frontier: bool = False


def read_runs(specs: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``LABEL=PATH`` or ``PATH`` (label: the directory's name) -> its report.json."""
    out: dict[str, dict[str, Any]] = {}
    for spec in specs:
        label, _, path = spec.rpartition("=")
        p = Path(path)
        file = p / "report.json" if p.is_dir() else p
        label = label or (p.name if p.is_dir() else p.parent.name)
        if label in out:
            raise ValueError(f"two runs labelled {label!r}")
        out[label] = json.loads(file.read_text())
    return out


def points(reports: dict[str, dict[str, Any]]) -> list[Point]:
    """Every system of every report, a system scored identically by two runs once."""
    seen: set[tuple[str, int, float]] = set()
    out: list[Point] = []
    for label, rep in reports.items():
        for system, r in rep["results"].items():
            key = (system, int(r["entries"]), round(float(r["test_ppl"]), 6))
            if key in seen:
                continue
            seen.add(key)
            lo, hi = r.get("test_ppl_ci95") or (math.nan, math.nan)
            out.append(
                Point(
                    f"{label}/{system}",
                    system,
                    int(r["entries"]),
                    float(r["test_ppl"]),
                    (float(lo), float(hi)),
                )
            )
    return mark_frontier(out)


def mark_frontier(pts: Sequence[Point]) -> list[Point]:
    """``pts`` sorted by entries, then perplexity, each marked on the frontier when no
    other point has at most its entries and at most its perplexity, one strictly less."""

    def beaten(p: Point) -> bool:
        return any(
            q.entries <= p.entries and q.ppl <= p.ppl and (q.entries < p.entries or q.ppl < p.ppl)
            for q in pts
        )

    return sorted(
        (Point(**{**asdict(p), "frontier": not beaten(p)}) for p in pts),
        key=lambda p: (p.entries, p.ppl),
    )


def thirds(per_day: Sequence[dict[str, Any]]) -> list[dict[str, float]]:
    """Per third of the stream (days grouped by the middle of their tokens in the
    cumulative count): tokens seen, entries stored, MemRate, share held at its end."""
    total = sum(int(d["tokens_seen"]) for d in per_day)
    groups: list[list[dict[str, Any]]] = [[], [], []]
    before = 0
    for d in per_day:
        n = int(d["tokens_seen"])
        groups[min(int(3 * (before + n / 2) / max(total, 1)), 2)].append(d)
        before += n
    out, seen = [], 0
    for g in groups:
        n = sum(int(d["tokens_seen"]) for d in g)
        stored = sum(int(d["stored"]) for d in g)
        seen += n
        held = int(g[-1]["entries"]) if g else (out[-1]["entries_at_end"] if out else 0)
        out.append(
            {
                "days": len(g),
                "tokens_seen": n,
                "stored": stored,
                "memrate": stored / n if n else math.nan,
                "entries_at_end": held,
                "held_share_at_end": held / seen if seen else math.nan,
            }
        )
    return out


def _fmt_int(x: int) -> str:
    return f"{x:,}"


def table(pts: Sequence[Point], fullmem: Point | None) -> list[str]:
    lines = [
        "| system | entries | share of FullMem | test ppl (95% CI) | vs FullMem | frontier |",
        "|---|---:|---:|---:|---:|:---:|",
    ]
    for p in pts:
        share = f"{p.entries / fullmem.entries:.1%}" if fullmem else "-"
        vs = f"{p.ppl / fullmem.ppl - 1:+.2%}" if fullmem else "-"
        lines.append(
            f"| {p.name} | {_fmt_int(p.entries)} | {share} | {p.ppl:.3f} "
            f"({p.ci[0]:.2f}-{p.ci[1]:.2f}) | {vs} | {'*' if p.frontier else ''} |"
        )
    return lines


def thirds_table(reports: dict[str, dict[str, Any]]) -> tuple[list[str], dict[str, Any]]:
    lines = [
        "| system | MemRate 1st / 2nd / 3rd third | held share at each third's end | "
        "held: last - first third (points) |",
        "|---|---|---|---:|",
    ]
    what: dict[str, Any] = {}
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for label, rep in reports.items():
        for system, rows in rep.get("per_day", {}).items():
            key = (system, tuple(int(d["entries"]) for d in rows))
            if system == "bare" or key in seen:  # the same system in another run
                continue
            seen.add(key)
            t = thirds(rows)
            what[f"{label}/{system}"] = t
            mr = " / ".join(f"{x['memrate']:.1%}" for x in t)
            held = " / ".join(f"{x['held_share_at_end']:.1%}" for x in t)
            fall = 100 * (t[2]["held_share_at_end"] - t[0]["held_share_at_end"])
            lines.append(f"| {label}/{system} | {mr} | {held} | {fall:+.1f} |")
    return lines, what


def plot(pts: Sequence[Point], out: Path, fullmem: Point | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    families: dict[str, list[Point]] = {}
    for p in pts:
        base = p.system.split("+")[0]
        fam = "budget" if "+budget" in p.system else base
        families.setdefault(fam, []).append(p)
    for fam, ps in families.items():
        xs = [p.entries for p in ps]
        ys = [p.ppl for p in ps]
        ax.scatter(xs, ys, s=28, label=fam, zorder=3)
        for p in ps:
            ax.annotate(
                p.name, (p.entries, p.ppl), fontsize=6, xytext=(3, 3), textcoords="offset points"
            )
    front = [p for p in pts if p.frontier]
    ax.plot([p.entries for p in front], [p.ppl for p in front], "k--", lw=1, label="frontier")
    if fullmem is not None:
        ax.axhline(fullmem.ppl * 1.005, color="grey", lw=0.8, ls=":", label="FullMem +0.5%")
    ax.set_xlabel("entries held at the end of the stream")
    # no error bars: the test articles' CIs (in the table) span several ppl and overlap
    # everywhere, and would flatten the differences the paired win shares resolve
    ax.set_ylabel("test perplexity")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "pareto.png", dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="LABEL=PATH or PATH of memlm eval outputs")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--fullmem", default="fullmem", help="system the shares are of")
    ap.add_argument("--no-plot", action="store_true")
    a = ap.parse_args(argv)
    reports = read_runs(a.runs)
    pts = points(reports)
    fullmem = next((p for p in pts if p.system == a.fullmem), None)
    a.out.mkdir(parents=True, exist_ok=True)
    lines = ["# Test perplexity against entries held", "", *table(pts, fullmem), ""]
    tl, tw = thirds_table(reports)
    lines += ["## Stored share per third of the stream", "", *tl, ""]
    (a.out / "pareto.md").write_text("\n".join(lines))
    (a.out / "pareto.json").write_text(
        json.dumps({"points": [asdict(p) for p in pts], "thirds": tw}, indent=1)
    )
    if not a.no_plot:
        plot(pts, a.out, fullmem)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
