"""Does MemRate fall as the memory learns the stream?  Read from `memlm eval` reports.

For each report and policy: the MemRate over the first, middle and last third of the
tokens the policy saw (thirds by tokens, not days: the bundled days differ in size by
100x), and the slope of a token-weighted least-squares line of each day's MemRate against
the tokens seen before that day (percentage points per 100k tokens).  A memory that learns
the stream stores a smaller share of each new day: the later thirds fall, the slope is
negative.  Reports that have it also give the same for "LM alone": what the policy would
have stored deciding on the LM without its memory, which separates the memory's part from
the text getting easier or harder over the stream.

    python scripts/memrate_trend.py docs/results/stream57-6/report.json runs/dense20/report.json

``--plot PATH`` also draws each day's MemRate of every report and policy on one figure
(x: tokens seen before the day), e.g. MoNIM and MoNIM+AMT from two runs over one stream.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def days(rows: list[dict], field: str = "stored") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Of the days that read tokens: the tokens read before each, its tokens seen, and its
    ``field`` (tokens stored)."""
    seen = np.array([r["tokens_seen"] for r in rows], np.float64)
    stored = np.array([r[field] for r in rows], np.float64)
    keep = seen > 0
    seen, stored = seen[keep], stored[keep]
    return np.concatenate([[0.0], np.cumsum(seen)[:-1]]), seen, stored


def trend(rows: list[dict], field: str = "stored") -> dict[str, float]:
    before, seen, stored = days(rows, field)
    total = seen.sum()
    thirds = []
    for lo, hi in ((0, 1 / 3), (1 / 3, 2 / 3), (2 / 3, 1.0)):
        # a day belongs to the third that holds its middle token
        mid = (before + seen / 2) / total
        sel = (mid >= lo) & (mid < hi) if hi < 1 else mid >= lo
        thirds.append(stored[sel].sum() / seen[sel].sum() if sel.any() else float("nan"))
    rate = stored / seen
    x = before / 1e5
    w = seen / total
    xm, ym = (w * x).sum(), (w * rate).sum()
    slope = (w * (x - xm) * (rate - ym)).sum() / (w * (x - xm) ** 2).sum()
    return {
        "days": float(len(seen)),
        "tokens": total,
        "overall": stored.sum() / total,
        "first": thirds[0],
        "middle": thirds[1],
        "last": thirds[2],
        "slope_points_per_100k": 100 * slope,
    }


def plot(series: list[tuple[str, list[dict]]], path: Path) -> None:
    """Each day's MemRate (solid) and the LM-alone decision (dashed, where reported) against
    the tokens seen before that day, one line per (report, policy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for label, rows in series:
        before, seen, stored = days(rows)
        line = ax.plot(before / 1e6, 100 * stored / seen, marker="o", ms=3, label=label)[0]
        if all("stored_lm_alone" in r for r in rows):
            _, _, alone = days(rows, "stored_lm_alone")
            style = {"color": line.get_color(), "label": f"{label}, LM alone"}
            ax.plot(before / 1e6, 100 * alone / seen, "--", **style)
    ax.set_xlabel("tokens of the stream read before the day (millions)")
    ax.set_ylabel("MemRate of the day (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", type=Path, help="report.json files of memlm eval")
    ap.add_argument("--policies", default="monim,monim-amt", help="comma-separated")
    ap.add_argument("--plot", type=Path, help="also draw each day's MemRate here (.png)")
    args = ap.parse_args()
    series: list[tuple[str, list[dict]]] = []
    print(
        "| report | policy | days | tokens seen | MemRate | first third | middle third "
        "| last third | slope (points per 100k tokens) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for path in args.reports:
        per_day = json.loads(path.read_text())["per_day"]
        for policy in args.policies.split(","):
            if policy not in per_day:
                continue
            rows = per_day[policy]
            series.append((f"{path.parent.name}: {policy}", rows))
            variants = [("stored", policy)]
            if all("stored_lm_alone" in r for r in rows):  # reports from 2026-11-25 on
                variants.append(("stored_lm_alone", f"{policy}, LM alone"))
            for field, label in variants:
                t = trend(rows, field)
                print(
                    f"| {path.parent.name} | {label} | {t['days']:.0f} | {t['tokens']:,.0f} | "
                    f"{t['overall']:.1%} | {t['first']:.1%} | {t['middle']:.1%} "
                    f"| {t['last']:.1%} | {t['slope_points_per_100k']:+.2f} |"
                )
    if args.plot is not None:
        if not series:
            raise SystemExit(f"--plot: none of the policies {args.policies} is in these reports")
        plot(series, args.plot)
        print(f"\nwrote {args.plot}")


if __name__ == "__main__":
    main()
