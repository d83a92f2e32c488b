"""`memlm corpus ...`: inspect and export document streams."""

from __future__ import annotations

from pathlib import Path

import typer

corpus_app = typer.Typer(help="Inspect and export document streams.", no_args_is_help=True)


@corpus_app.command("export")
def export(
    name: str = typer.Argument(..., help="'news' for the bundled stream, or a JSONL path"),
    out: Path = typer.Option(..., "--out", help="JSONL file to write"),
) -> None:
    """Write a stream as JSONL: {"id", "text", "published_at", "source", "title", "metadata"}."""
    from memlm.corpus import load_corpus, write_jsonl

    n = write_jsonl(load_corpus(name), out)
    typer.echo(f"wrote {n} documents to {out}")


@corpus_app.command("stats")
def stats(name: str = typer.Argument("news")) -> None:
    """Documents per day and characters of a stream."""
    from memlm.corpus import by_day, load_corpus

    docs = load_corpus(name)
    for day, batch in by_day(docs):
        typer.echo(f"{day}  {len(batch):4d} docs  {sum(len(d.text) for d in batch):8d} chars")
    typer.echo(f"total {len(docs)} documents")


def register(app: typer.Typer) -> None:
    app.add_typer(corpus_app, name="corpus")
