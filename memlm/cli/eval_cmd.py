"""`memlm eval`: the streaming evaluation of memorisation policies."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

import typer


class LambdaMode(StrEnum):
    """How test tokens mix the LM and the memory (``--lambda``)."""

    constant = "constant"  # one lambda tuned on dev
    calibrated = "calibrated"  # the NN calibrator trained day by day on dev


def eval_command(
    corpus: str = typer.Option("news", help="'news' (bundled) or a JSONL file"),
    out: Path = typer.Option(Path("runs/eval"), help="output directory"),
    model: str = typer.Option("smollm2-135m", help="bundled model, HF id or local path"),
    days: int | None = typer.Option(None, help="only the first N days of the stream"),
    start: str | None = typer.Option(None, help="skip days before this ISO date"),
    max_docs_per_day: int | None = typer.Option(None, help="ingest at most N documents a day"),
    max_eval_docs_per_day: int | None = typer.Option(2, help="dev and test documents a day (each)"),
    policies: str = typer.Option(
        "fullmem,randmem,monim,monim-amt,monim-kl", help="comma-separated; 'bare' always runs"
    ),
    delta: float = typer.Option(-1.5, help="MoNIM threshold on log p(x_t)"),
    kl_delta: float = typer.Option(
        -10.0, help="MoNIM(KL) threshold on the key's log p(x_t) (see memlm/policy.py)"
    ),
    rand_rate: float | None = typer.Option(None, help="RandMem rate (default: MoNIM's MemRate)"),
    context: int = typer.Option(512, help="window length in tokens"),
    stride: int = typer.Option(256, help="window stride in tokens"),
    batch_size: int = typer.Option(4, help="windows per forward pass"),
    ingest_k: int = typer.Option(
        64, help="neighbours used while ingesting (MoNIM's augmented model)"
    ),
    ingest_temperature: float = typer.Option(5.0, help="kNN temperature while ingesting"),
    ingest_lambda: float = typer.Option(0.25, help="interpolation weight while ingesting"),
    k_max: int = typer.Option(1024, help="neighbours fetched for held-out tokens (tuning grid)"),
    index_kind: str = typer.Option("auto", help="auto (flat, then IVF-PQ past 50k) or flat"),
    seed: int = typer.Option(0),
    threads: int | None = typer.Option(None, help="torch threads (default MEMLM_THREADS or cores)"),
    keep_stores: bool = typer.Option(False, help="keep each policy's datastore and index"),
    local_memory: bool = typer.Option(
        False, help="TRIME local memory: earlier tokens of the window join the softmax"
    ),
    long_memory: int = typer.Option(
        0, metavar="SEGMENTS", help="TRIME long-term memory: that many earlier windows too"
    ),
    lambda_mode: LambdaMode = typer.Option(
        LambdaMode.constant,
        "--lambda",
        help="constant (tuned on dev) or calibrated (NN calibrator trained day by day on dev)",
    ),
    gate_theta: float = typer.Option(
        0.0, help="calibrated only: skip the search when the retrieval gate's lambda < theta"
    ),
) -> None:
    """Stream a corpus day by day through each policy; write report.json, report.md, plots."""
    import datetime as dt
    import logging

    from memlm.corpus import load_corpus
    from memlm.encoder import WindowConfig
    from memlm.evaluate import EvalConfig, TrimeSpec, evaluate
    from memlm.knnlm import KnnParams

    logging.basicConfig(level=logging.WARNING)
    if not 0.0 <= gate_theta < 1.0 or (gate_theta > 0 and lambda_mode != LambdaMode.calibrated):
        raise typer.BadParameter(
            "--gate-theta must be in [0, 1) and needs --lambda calibrated",
            param_hint="--gate-theta",
        )
    try:
        window = WindowConfig(context=context, stride=stride, batch_size=batch_size)
    except ValueError as exc:  # e.g. --stride equal to --context: name the largest legal one
        raise typer.BadParameter(str(exc), param_hint="--stride / --context") from None
    cfg = EvalConfig(
        corpus=corpus,
        model=model,
        window=window,
        days=days,
        start=dt.date.fromisoformat(start) if start else None,
        max_docs_per_day=max_docs_per_day,
        max_eval_docs_per_day=max_eval_docs_per_day,
        seed=seed,
        policies=tuple(p.strip() for p in policies.split(",") if p.strip() and p.strip() != "bare"),
        delta=delta,
        kl_delta=kl_delta,
        rand_rate=rand_rate,
        ingest=KnnParams(k=ingest_k, temperature=ingest_temperature, lmbda=ingest_lambda),
        k_max=k_max,
        index_kind=index_kind,
        threads=threads,
        keep_stores=keep_stores,
        trime=TrimeSpec(long_segments=long_memory) if local_memory or long_memory else None,
        lambda_mode=lambda_mode.value,
        gate_theta=gate_theta,
    )
    report = evaluate(cfg, load_corpus(corpus), out, echo=typer.echo)
    from memlm.evaluate import render_markdown

    typer.echo(render_markdown(report))
    typer.echo(f"wrote {out}/report.json, report.md and plots")


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_command)
