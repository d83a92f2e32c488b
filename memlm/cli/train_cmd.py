"""`memlm train --arch ...`: train a language model on a document stream.

The architecture picks a runner from ``RUNNERS``; a runner is ``"module:function"``
taking a :class:`memlm.research.TrainRequest` and returning a JSON-able summary.  The
module is imported only when its architecture is chosen.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, Literal

import typer

# The choices of --arch, --objective and --tokenizer: Literal types so that `--help` lists
# them and typer refuses anything else before a model loads (tests/test_cli_choices.py
# checks them against RUNNERS and memlm.research.transformer_train.OBJECTIVES).
Arch = Literal["lstm", "attention", "kv", "kvp", "ngram", "transformer"]
Objective = Literal["vanilla", "trime", "trime-long", "trime-ext"]
Tokenizer = Literal["word", "subword"]

# Architecture name -> "module:function".  Add an architecture here and to ``Arch``.
RUNNERS: dict[Arch, str] = {
    "lstm": "memlm.research.lstm_train:run",
    "attention": "memlm.research.lstm_train:run",
    "kv": "memlm.research.lstm_train:run",
    "kvp": "memlm.research.lstm_train:run",
    "ngram": "memlm.research.lstm_train:run",
    "transformer": "memlm.research.transformer_train:run",  # --objective vanilla|trime|trime-long|trime-ext
}


def _parse_sets(pairs: list[str]) -> dict[str, str]:
    out = {}
    for p in pairs:
        key, sep, value = p.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"--set expects key=value, got {p!r}")
        out[key.strip()] = value.strip()
    return out


def train(
    arch: Arch = typer.Option(..., "--arch", help="the language model to train"),
    out: Path = typer.Option(Path("runs/train"), "--out", help="folder for checkpoint + metrics"),
    objective: Objective = typer.Option(
        "vanilla", help="training objective; the TRIME ones need --arch transformer"
    ),
    corpus: str = typer.Option("news", help="'news' or a JSONL path"),
    tokenizer: Tokenizer | None = typer.Option(
        None, help="word (numbers -> N, UNK) or subword; default word, transformer subword"
    ),
    vocab_size: int = typer.Option(10_000, help="word vocabulary size incl. <eos>, <unk>"),
    seed: int = typer.Option(0),
    hidden: int | None = typer.Option(None, help="hidden size; default from the budget"),
    emb: int = typer.Option(64, help="input embedding size"),
    window: int = typer.Option(5, help="attention window L (attention, kv, kvp)"),
    ngram: int = typer.Option(4, help="N of the N-gram RNN (2..5)"),
    steps: int = typer.Option(1000, help="optimizer steps"),
    max_minutes: float | None = typer.Option(None, help="stop training after this wall time"),
    batch_size: int | None = typer.Option(
        None, help="sequences (segments) per step; default 64, transformer 8"
    ),
    bptt: int | None = typer.Option(
        None, help="truncated BPTT length / segment length; default 20, transformer 128"
    ),
    lr: float | None = typer.Option(
        None, help="learning rate; default 1e-3, transformer 2e-3 (5e-5 with --init-from)"
    ),
    clip: float | None = typer.Option(
        None, help="gradient-norm clipping; default 5, transformer 1"
    ),
    max_train_tokens: int | None = typer.Option(None, help="train on the leading slice"),
    max_eval_tokens: int | None = typer.Option(None, help="evaluate on the leading slice"),
    threads: int | None = typer.Option(None, help="torch threads (default $MEMLM_THREADS)"),
    cache_dir: Path | None = typer.Option(None, help="default $MEMLM_CACHE_DIR"),
    set_: list[str] = typer.Option([], "--set", help="extra key=value options"),  # noqa: B006
    init_from: str | None = typer.Option(None, help="transformer: HF id or folder to continue"),
    data: Path | None = typer.Option(None, help="transformer: FILE.txt|FILE.jsonl (--init-from)"),
) -> None:
    """Train a language model and print its dev/test perplexity as JSON."""
    from memlm.research import TrainRequest, train_defaults

    if objective != "vanilla" and arch != "transformer":
        raise typer.BadParameter(
            f"{objective} trains a transformer; --arch {arch} trains with vanilla only",
            param_hint="--objective",
        )
    given = {"batch_size": batch_size, "bptt": bptt, "lr": lr, "clip": clip}
    chosen: dict[str, Any] = train_defaults(arch, continuing=init_from is not None) | {
        k: v for k, v in (given | {"tokenizer": tokenizer}).items() if v is not None
    }
    req = TrainRequest(
        arch=arch,
        out=out,
        objective=objective,
        corpus=corpus,
        tokenizer=chosen["tokenizer"],
        vocab_size=vocab_size,
        seed=seed,
        hidden=hidden,
        emb=emb,
        window=window,
        ngram=ngram,
        steps=steps,
        max_minutes=max_minutes,
        batch_size=chosen["batch_size"],
        bptt=chosen["bptt"],
        lr=chosen["lr"],
        clip=chosen["clip"],
        max_train_tokens=max_train_tokens,
        max_eval_tokens=max_eval_tokens,
        threads=threads,
        cache_dir=cache_dir,
        extra={
            **_parse_sets(set_),
            **({"init_from": init_from} if init_from else {}),
            **({"data": str(data)} if data else {}),
        },
    )
    module, _, func = RUNNERS[arch].partition(":")
    summary = getattr(importlib.import_module(module), func)(req)
    typer.echo(json.dumps(summary, indent=2, default=str))


def register(app: typer.Typer) -> None:
    app.command("train")(train)
