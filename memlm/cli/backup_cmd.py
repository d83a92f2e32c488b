"""`memlm backup DEST` and `memlm restore SRC`: a consistent snapshot of a running service,
and an empty data directory and database filled from one (docs/service.md)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import typer


def _settings() -> Any:
    from pydantic import ValidationError

    from memlm.settings import Settings

    try:
        return Settings()
    except ValidationError as e:
        typer.echo(f"invalid settings:\n{e}", err=True)
        raise typer.Exit(2) from None


@contextlib.contextmanager
def _bar(label: str, total: int) -> Iterator[Callable[[int], None]]:
    from tqdm import tqdm

    # disable=None: a bar on a terminal, nothing in a log file
    with tqdm(total=total, unit="B", unit_scale=True, desc=label, disable=None) as bar:
        yield bar.update


def backup(
    dest: Path = typer.Argument(..., help="a new or empty directory to write the backup into"),
    wait: float = typer.Option(
        600.0, help="seconds to wait for a running index build or compaction to finish"
    ),
) -> None:
    """Snapshot the data directory and the database of MEMLM_DATA_DIR / MEMLM_DATABASE_URL
    (and the collection's entries on Milvus, MEMLM_MEMORY_URL) while the service runs
    (ingest pauses for milliseconds)."""
    from memlm.backup import BackupError
    from memlm.backup import backup as take

    settings = _settings()
    try:
        m = take(settings, dest, wait=wait, progress=_bar)
    except BackupError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    size = sum(f.size for f in m.files.values())
    typer.echo(
        f"backup of {m.tables['documents']} documents and {m.memory['entries']} datastore "
        f"entries ({m.memory['live_entries']} live, index version {m.memory['index_version']}) "
        f"written to {dest}: {len(m.files)} files, {size / 1e6:.1f} MB; ingest paused "
        f"{m.paused_ingest_seconds * 1000:.1f} ms"
    )


def restore(
    src: Path = typer.Argument(..., help="a directory written by `memlm backup`"),
) -> None:
    """Fill the empty data directory and database of MEMLM_DATA_DIR / MEMLM_DATABASE_URL
    (and, for a backup of a Milvus memory, the empty collection of MEMLM_MEMORY_URL) from
    a backup (refuses a non-empty one); start the service afterwards."""
    from memlm.backup import BackupError
    from memlm.backup import restore as put_back

    settings = _settings()
    try:
        m = put_back(settings, src, progress=_bar)
    except BackupError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(
        f"restored {m.tables['documents']} documents and {m.memory['entries']} datastore "
        f"entries (backup of {m.created_at}) into {settings.data_dir}"
    )


def register(app: typer.Typer) -> None:
    app.command("backup")(backup)
    app.command("restore")(restore)
