"""`memlm ingest FILE.jsonl|DIR --url ... --token ...`: send documents to a running
service with :mod:`memlm.client` (batched, retried on 429, deduplicated by the server)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer


class InputError(ValueError):
    """A line of the input is not a document."""


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.jsonl") if p.is_file())
        if not files:
            raise InputError(f"{path}: no *.jsonl file in this folder")
        return files
    if not path.is_file():
        raise InputError(f"{path}: no such file or folder")
    return [path]


def read_documents(path: Path) -> Iterator[dict[str, Any]]:
    """The documents of a JSONL file or of every *.jsonl under a folder, validated with
    the API's own model. A line holds the fields of ``POST /ingest``'s documents; the
    ``id`` of ``memlm corpus export`` files is taken as ``external_id``."""
    from pydantic import ValidationError

    from memlm.api import DocumentIn

    for file in _files(path):
        with open(file, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    if not isinstance(obj, dict):
                        raise InputError("a line must hold one JSON object")
                    if "id" in obj:
                        obj.setdefault("external_id", str(obj.pop("id")))
                    doc = DocumentIn.model_validate(obj)
                except (json.JSONDecodeError, InputError) as e:
                    raise InputError(f"{file}:{lineno}: {e}") from None
                except ValidationError as e:
                    problems = "; ".join(
                        f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}"
                        for err in e.errors()
                    )
                    raise InputError(f"{file}:{lineno}: {problems}") from None
                yield doc.model_dump(mode="json", exclude_none=True)


def ingest(
    path: Path = typer.Argument(..., help="a JSONL file, or a folder of *.jsonl files"),
    url: str = typer.Option(
        "http://127.0.0.1:8000", envvar="MEMLM_URL", help="the service's base URL"
    ),
    token: str | None = typer.Option(
        None, envvar="MEMLM_TOKEN", help="an ingest (or admin) bearer token"
    ),
    batch_size: int = typer.Option(64, min=1, help="documents per request"),
    wait: bool = typer.Option(False, "--wait", help="wait until the worker processed them"),
    timeout: float = typer.Option(60.0, help="seconds per request (and the wait per document)"),
) -> None:
    """Send documents to a running service (batched; retried on 429 and broken connections)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from memlm.client import Client, MemlmError

    try:
        docs = list(read_documents(path))  # all validated before anything is sent
    except InputError as e:
        raise typer.BadParameter(str(e), param_hint="PATH") from None
    if not docs:
        raise typer.BadParameter(f"{path}: no documents", param_hint="PATH")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    try:
        with Client(url, token=token, timeout=timeout) as client, Progress(*columns) as bar:
            task = bar.add_task("ingest", total=len(docs))
            accepted = client.ingest(
                docs, batch_size=batch_size, progress=lambda n: bar.advance(task, n)
            )
            duplicates = sum(a.duplicate for a in accepted)
            if wait:
                done = bar.add_task("processed", total=len(accepted))
                ids = [a.id for a in accepted]
                final = []
                for i in range(0, len(ids), batch_size):
                    chunk = ids[i : i + batch_size]
                    final += client.wait(chunk, timeout=timeout * len(chunk))
                    bar.advance(done, len(chunk))
    except MemlmError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(
        f"{len(accepted)} documents sent to {url}: {len(accepted) - duplicates} new, "
        f"{duplicates} already there"
    )
    if wait:
        statuses: dict[str, int] = {}
        for d in final:
            statuses[d.status] = statuses.get(d.status, 0) + 1
        typer.echo("processed: " + ", ".join(f"{n} {s}" for s, n in sorted(statuses.items())))


def register(app: typer.Typer) -> None:
    app.command("ingest")(ingest)
