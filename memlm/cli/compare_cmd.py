"""`memlm eval-compare`: pair the systems of several evaluation runs on their shared tests."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def eval_compare(
    runs: list[str] = typer.Argument(
        ..., help="run directories (or their test_documents.json), each as PATH or LABEL=PATH"
    ),
    resamples: int = typer.Option(1000, min=10, help="bootstrap resamples of the documents"),
    seed: int = typer.Option(0),
    json_out: Path | None = typer.Option(None, "--json", help="also write the result here"),
) -> None:
    """Compare every system of every run (made over one split.json, e.g. with --split) on
    the test documents they share: perplexity with a 95% bootstrap interval, and the paired
    share of resamples in which the row's system has the lower perplexity (closer than a
    relative 1e-6 is a tie, not a win)."""
    from memlm.evaluate.paired import PairingError, compare_runs

    labelled: dict[str, Path] = {}
    for arg in runs:
        label, _, path = arg.rpartition("=")
        p = Path(path)
        label = label or (p.parent.name if p.suffix == ".json" else p.name)
        if label in labelled:
            raise typer.BadParameter(f"two runs are labelled {label!r}: use LABEL=PATH")
        labelled[label] = p
    try:
        out = compare_runs(labelled, resamples=resamples, seed=seed)
    except PairingError as exc:
        raise typer.BadParameter(str(exc), param_hint="RUNS") from exc
    systems = list(out["systems"])
    typer.echo(
        f"{out['documents']} shared test documents, {out['tokens']} tokens "
        f"({out['only_in_some_runs']} documents in some runs only, left out); {out['bootstrap']}"
    )
    typer.echo("")
    typer.echo(
        "| system | test ppl (95% CI) | " + " | ".join(f"wins vs {s}" for s in systems) + " |"
    )
    typer.echo("|---|---:|" + "---:|" * len(systems))
    for s in systems:
        r = out["systems"][s]
        shares = ["-" if o == s else f"{out['win_share'][s][o]:.0%}" for o in systems]
        typer.echo(
            f"| {s} | {r['ppl']:.2f} ({r['ci'][0]:.2f}-{r['ci'][1]:.2f}) | "
            + " | ".join(shares)
            + " |"
        )
    if json_out is not None:
        json_out.write_text(json.dumps(out, indent=1))


def register(app: typer.Typer) -> None:
    app.command("eval-compare")(eval_compare)
