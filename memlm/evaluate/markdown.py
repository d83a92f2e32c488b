"""Markdown and plots of the report's sections beyond the main table."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def sections(report: dict[str, Any]) -> list[str]:
    """Leakage, learning and forgetting, name tokens, wall time per phase."""
    lines: list[str] = []
    leak = report.get("leakage")
    if leak:
        lines += [
            "",
            f"Leakage: {leak['documents_in']} documents in the stream; dropped "
            f"{leak['dropped_exact']} exact duplicates (normalised text hash) and "
            f"{leak['dropped_near']} near duplicates (>= {leak['near_dup_threshold']:.0%} of "
            f"their word 13-grams in one earlier document). {leak['held_out_excluded']} of "
            f"{leak['held_out_documents']} held-out documents shared > "
            f"{leak['eval_overlap_threshold']:.0%} of their 13-grams with the ingested documents "
            f"and were excluded from dev and test; the largest overlap kept is "
            f"{leak['held_out_max_overlap_kept']:.1%}.",
        ]
    forg = report.get("forgetting")
    if forg:
        lines += ["", "Learning and forgetting: test ppl of each month (columns) with the memory "]
        lines[-1] += "as it stood at the end of each month (rows), constant lambda:"
        for name, table in forg.items():
            months = sorted({m for row in table.values() for m in row})
            lines += ["", f"{name}:", "", "| memory at end of | " + " | ".join(months) + " |"]
            lines.append("|---|" + "---:|" * len(months))
            for end, row in table.items():
                lines.append(f"| {end} | " + " | ".join(_fmt(row.get(m)) for m in months) + " |")
    ood = report.get("ood")
    if ood:
        # the column of the run's own lambda mode (constant: that column stays empty)
        # (the fine-tuning section's report has no settings: calibrated, as before)
        lambda_mode = (report.get("settings") or {}).get("lambda_mode")
        mode = lambda_mode if lambda_mode in ("evidence", "served") else "calibrated"
        lines += [
            "",
            "Out of domain after the whole stream (memory of the last evening):",
            "",
            f"| policy | corpus | bare ppl | constant lambda | {mode} |",
            "|---|---|---:|---:|---:|",
        ]
        for name, row in ood.items():
            if name == "bare":
                continue
            for corpus, r in row.items():
                cal = r.get(f"ppl_{mode}")
                cal_s = "-" if cal is None else f"{cal:.2f} ({r[f'{mode}_vs_bare']:+.2%})"
                if f"mean_{mode}_lambda" in r:
                    cal_s += f", mean lambda {r[f'mean_{mode}_lambda']:.3g}"
                lines.append(
                    f"| {name} | {corpus} | {r['bare']:.2f} "
                    f"| {r['ppl_constant']:.2f} ({r['constant_vs_bare']:+.2%}) | {cal_s} |"
                )
    names = report.get("names")
    if names:
        subsets = names["subsets"]
        systems = list(next(iter(subsets.values())))
        lines += [
            "",
            f"Name tokens ({names['definition']}; {names['lambda']}): top-1 accuracy / ppl",
            "",
            "| subset | tokens | " + " | ".join(systems) + " |",
            "|---|---:|" + "---:|" * len(systems),
        ]
        for subset, row in subsets.items():
            n = next(iter(row.values()))["tokens"]
            cells = [f"{_fmt(row[s]['top1'], '.1%')} / {_fmt(row[s]['ppl'])}" for s in systems]
            lines.append(f"| {subset} | {n} | " + " | ".join(cells) + " |")
    ft = report.get("finetune")
    if ft:
        st = ft["settings"]
        ci_ = ft["test_ppl_ci95"]
        lines += [
            "",
            f"Continual fine-tuning baseline ({st['weights']} weights, {st['optimizer']} lr "
            f"{st['lr']:g}, {st['epochs']} epoch a day over the ingested documents): test ppl "
            f"{ft['test_ppl']:.2f}" + (f" ({ci_[0]:.2f}-{ci_[1]:.2f})" if ci_ else "") + ", "
            f"{ft['cpu_seconds_per_day']} CPU-seconds of training a day.",
        ]
        if ft.get("win_share"):
            shares = ", ".join(f"{o} {w:.0%}" for o, w in ft["win_share"].items())
            lines += [
                "",
                "Paired bootstrap on the same test documents (share of resamples in which the "
                f"fine-tuned model has the lower test ppl): {shares}.",
            ]
        if ft["forgetting"]:
            months = sorted({m for row in ft["forgetting"].values() for m in row})
            lines += ["", "| model at end of | " + " | ".join(months) + " |"]
            lines.append("|---|" + "---:|" * len(months))
            for end, row in ft["forgetting"].items():
                lines.append(f"| {end} | " + " | ".join(_fmt(row.get(m)) for m in months) + " |")
        if ft.get("ood"):
            bare_ood = (report.get("ood") or {}).get("bare", {})
            cells = []
            for corpus, p in ft["ood"].items():
                b = bare_ood.get(corpus, {}).get("ppl")
                cells.append(
                    f"{corpus} {p:.2f}" + (f" (bare {b:.2f}, {p / b - 1:+.2%})" if b else "")
                )
            lines += [
                "",
                "Fine-tuned model out of domain after the stream: " + "; ".join(cells) + ".",
            ]
    t = report.get("timing")
    if t:
        e = t["encode"]
        lines += [
            "",
            f"Wall time: encoding {e['seconds']} s for {e['tokens']} new tokens "
            f"({_fmt(e['tokens_per_s'], '.0f')} tokens/s; the rest came from the cache); "
            f"report (tuning, calibrator, bootstrap, names) {t['report_seconds']} s."
            + (
                f" Waited {e['wait_seconds']} s for --encode-shard processes (not in the "
                "phases below)."
                if e.get("wait_seconds")
                else ""
            ),
            "",
            "| policy | total s | ingest s | ingest tokens/s | builds s | held-out search s |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, r in t.items():
            if name in ("encode", "report_seconds"):
                continue
            lines.append(
                f"| {name} | {r['seconds']} | {r['ingest_seconds']} "
                f"| {_fmt(r['ingest_tokens_per_s'], '.0f')} | {r['build_seconds']} "
                f"| {r['held_out_search_seconds']} |"
            )
    return lines


def extra_plots(report: dict[str, Any], out: Path) -> None:
    """forgetting.png: each month's test ppl against the month-end of the memory (and of
    the fine-tuned model, when the report has the baseline)."""
    forg = dict(report.get("forgetting") or {})
    if (report.get("finetune") or {}).get("forgetting"):
        forg["finetune"] = report["finetune"]["forgetting"]
    if not forg or not any(row for table in forg.values() for row in table.values()):
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    # one colour per test month, one line style per policy: more lines than the colour
    # cycle holds would otherwise share colours across policies
    months = sorted({m for table in forg.values() for row in table.values() for m in row})
    colours = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(months)}
    styles = ("-", "--", ":", "-.")
    for j, (name, table) in enumerate(forg.items()):
        ends = list(table)
        for m in sorted({m for row in table.values() for m in row}):
            ys = [table[e].get(m) for e in ends]
            ax.plot(
                ends,
                ys,
                styles[j % len(styles)],
                color=colours[m],
                marker="o",
                ms=3,
                label=f"{name}, test {m}",
            )
    ax.set_xlabel("memory (or fine-tuned model) at the end of month")
    ax.set_ylabel("test perplexity")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "forgetting.png", dpi=110)
    plt.close(fig)
