"""`memlm migrate-memory`: move an embedded faiss memory into Milvus."""

from __future__ import annotations

from pathlib import Path

import typer


def migrate_memory(
    to: str = typer.Option(
        ..., "--to", help="target collection: milvus://host:port/collection (must be empty)"
    ),
    data_dir: Path | None = typer.Option(
        None, "--data-dir", help="memlm data directory (default: MEMLM_DATA_DIR)"
    ),
    build: bool = typer.Option(True, help="flush and index the collection afterwards"),
) -> None:
    """Copy the live entries of the faiss memory into a Milvus collection, then check the
    counts. Stop the workers first; afterwards set MEMLM_MEMORY_URL to the same URL."""
    from memlm.memory import open_milvus, parse_memory_url
    from memlm.memory.migrate import MigrationMismatch, migrate_faiss_to_milvus
    from memlm.settings import Settings

    try:
        url = parse_memory_url(to)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--to") from exc
    if url is None:
        raise typer.BadParameter("the target must be a milvus:// URL", param_hint="--to")
    root = data_dir if data_dir is not None else Settings().data_dir
    src = root / "memory" / "datastore"
    if not (src / "manifest.json").exists():
        raise typer.BadParameter(f"no faiss memory at {src}", param_hint="--data-dir")
    target = open_milvus(url, _dim(src))
    try:
        done = migrate_faiss_to_milvus(
            src, target, build=build, progress=lambda n, t: typer.echo(f"  {n}/{t} entries")
        )
    except MigrationMismatch as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    finally:
        target.close()
    typer.echo(
        f"copied {done.copied} entries into {url} in {done.seconds:.1f} s; "
        f"the collection holds {done.target_entries}"
    )


def _dim(datastore_dir: Path) -> int:
    from memlm.datastore import Datastore

    ds = Datastore.open(datastore_dir, dim=None, readonly=True)
    try:
        return ds.dim
    finally:
        ds.close()


def register(app: typer.Typer) -> None:
    app.command("migrate-memory")(migrate_memory)
