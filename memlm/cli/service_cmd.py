"""`memlm up | serve | worker | scheduler | rebuild | db ...`: run and operate the service."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import typer

db_app = typer.Typer(help="Database migrations (Alembic).", no_args_is_help=True)

# The `memlm` CLI of this interpreter, for child processes (no console script needed).
_SELF = [sys.executable, "-m", "memlm.cli"]


def _logging() -> None:
    logging.basicConfig(
        level=os.environ.get("MEMLM_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("alembic").setLevel(logging.WARNING)


def _settings() -> Any:
    from pydantic import ValidationError

    from memlm.settings import Settings

    try:
        settings = Settings()
    except ValidationError as e:
        typer.echo(f"invalid settings:\n{e}", err=True)
        raise typer.Exit(2) from None
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    return settings


def _shown(url: str) -> str:
    """The database URL for messages and logs: the password masked."""
    from sqlalchemy import make_url

    return make_url(url).render_as_string(hide_password=True)


@contextlib.contextmanager
def _migrated_sessions(settings: Any) -> Iterator[Any]:
    """Sessions for the settings' database, its engine disposed on the way out (a
    command run in-process must not leave pooled connections to the garbage collector);
    exits with the fix when the database is not migrated."""
    from sqlalchemy.exc import OperationalError

    from memlm.db.errors import DatabaseNotMigrated
    from memlm.db.migrate import check_migrated
    from memlm.db.session import make_engine, make_sessionmaker

    engine = make_engine(settings.db_url)
    try:
        check_migrated(engine)
    except (DatabaseNotMigrated, OperationalError) as e:
        engine.dispose()
        if isinstance(e, OperationalError):
            typer.echo(
                f"error: cannot open the database {_shown(settings.db_url)}: {e.orig}", err=True
            )
        else:
            typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    try:
        yield make_sessionmaker(engine)
    finally:
        engine.dispose()


def _serve(settings: Any, host: str, port: int) -> None:
    import uvicorn

    from memlm.cli.compose import build_app

    uvicorn.run(build_app(settings), host=host, port=port, log_config=None)


def _queue_demo(settings: Any, days: int) -> int:
    """Put the first ``days`` days of the bundled news in the queue (idempotent)."""
    from memlm.corpus import by_day, load_news
    from memlm.db.repositories import DocumentRepository, NewDocument

    with _migrated_sessions(settings) as sessions:
        docs = []
        for _, batch in list(by_day(load_news()))[:days]:
            docs.extend(batch)
        with sessions.begin() as s:
            accepted = DocumentRepository(s).add_many(
                NewDocument(
                    text=d.text,
                    published_at=d.published_at,
                    source=d.source,
                    external_id=d.id,
                    title=d.title,
                    metadata=dict(d.metadata),
                )
                for d in docs
            )
        new = sum(not a.duplicate for a in accepted)
        tokens = sum(len(d.text) for d in docs) // 4
        typer.echo(
            f"demo: {len(docs)} news articles of {days} days queued ({new} new, about {tokens} "
            "tokens); the worker logs each one as it is memorised"
        )
        return len(docs)


def _die_with_parent() -> None:
    """In the child before exec (Linux): get SIGTERM when the parent dies, even killed."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def up(
    host: str = typer.Option("127.0.0.1", help="interface to listen on"),
    port: int = typer.Option(8000, help="port to listen on"),
    demo: bool = typer.Option(False, "--demo", help="also ingest the first days of the news"),
    demo_days: int = typer.Option(4, help="days of the bundled news that --demo ingests"),
    workers: int = typer.Option(
        1,
        min=1,
        help="ingest workers: the API's own worker thread plus N-1 `memlm worker` processes "
        "(each loads the model; they encode in parallel and take turns to append)",
    ),
) -> None:
    """Run the API with its ingest worker(s), and the scheduler, on the embedded defaults."""
    _logging()
    from memlm.db.migrate import upgrade

    settings = _settings()
    upgrade(settings.db_url)
    typer.echo(
        f"data in {settings.data_dir.resolve()}, database {_shown(settings.db_url)} (migrated)"
    )
    if settings.uses_default_secret():
        typer.echo(
            "development tokens: Authorization: Bearer change-me "
            "(set MEMLM_INGEST_TOKEN / MEMLM_ADMIN_TOKEN for anything else)"
        )
    if demo:
        _queue_demo(settings, demo_days)
    children = [subprocess.Popen([*_SELF, "scheduler"], preexec_fn=_die_with_parent)]
    children += [
        subprocess.Popen([*_SELF, "worker"], preexec_fn=_die_with_parent)
        for _ in range(workers - 1)
    ]
    scheduler = children[0]
    typer.echo(f"scheduler pid {scheduler.pid}; API on http://{host}:{port} (docs at /docs)")
    if workers > 1:
        pids = ", ".join(str(c.pid) for c in children[1:])
        typer.echo(f"{workers - 1} more ingest worker processes: pid {pids}")
    # uvicorn shuts down gracefully on SIGTERM, then restores this handler and raises the
    # signal again: leaving through SystemExit runs the `finally` that stops the scheduler
    # (the default handler would end the process there and orphan it).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        _serve(settings.model_copy(update={"embedded_worker": True}), host, port)
    finally:
        for child in children:
            child.terminate()
        for child in children:
            try:
                child.wait(30)  # a worker finishes its current document first
            except subprocess.TimeoutExpired:
                child.kill()


def serve(
    host: str = typer.Option("127.0.0.1", help="interface to listen on"),
    port: int = typer.Option(8000, help="port to listen on"),
) -> None:
    """Run the API only (with the ingest worker thread when MEMLM_EMBEDDED_WORKER is true)."""
    _logging()
    settings = _settings()
    with _migrated_sessions(settings):
        pass  # refuses an unmigrated database before the server starts
    _serve(settings, host, port)


def worker(
    crash_at: str = typer.Option(None, hidden=True, help="tests: SIGKILL at this point"),
) -> None:
    """Run the ingest worker (and queued index builds) until interrupted."""
    _logging()
    from memlm.engine import open_engine, policy_factory
    from workers.ingest import IngestWorker

    settings = _settings()
    with _migrated_sessions(settings) as sessions:
        engine = open_engine(settings)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        IngestWorker(engine, sessions, settings, policy_factory=policy_factory).run(
            stop, crash_at=crash_at
        )


def scheduler() -> None:
    """Run the scheduler process: it enqueues the nightly rebuild (MEMLM_REBUILD_CRON)."""
    _logging()
    from workers.scheduler import run_scheduler

    settings = _settings()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with _migrated_sessions(settings) as sessions:
        run_scheduler(settings, sessions)


def rebuild(
    key: str = typer.Option(None, help="idempotency key: the same key builds once"),
    wait: bool = typer.Option(False, "--wait", help="wait until a worker has built it"),
    retrain: bool = typer.Option(
        False,
        "--retrain",
        help="train the index from scratch (otherwise a build adds to the served version "
        "and retrains only when the memory grew 4x since the last training)",
    ),
) -> None:
    """Request an index build; a running worker builds it and the API swaps to it."""
    from memlm.db.repositories import BuildRepository
    from workers.builder import enqueue_rebuild

    with _migrated_sessions(_settings()) as sessions:
        row, created = enqueue_rebuild(sessions, key=key, requested_by="cli", retrain=retrain)
        typer.echo(f"build request {row.id} ({row.request_key}): {row.status}, new={created}")
        while wait and row.status in ("queued", "building"):
            time.sleep(1)
            with sessions() as s:
                row = BuildRepository(s).get(row.id)
        if wait:
            typer.echo(f"build request {row.id}: {row.status}, version {row.version}")
            if row.status != "done":
                raise typer.Exit(1)


def compact(
    build: bool = typer.Option(
        True, "--build/--no-build", help="queue an index build afterwards (see below)"
    ),
) -> None:
    """Remove forgotten documents' rows from the datastore files now.

    Needs no model: takes the data directory's build lock, compacts the datastore as a
    writer taking turns with the ingest workers, and truncates the SQLite WAL. The index
    versions built before the forgets still hold those keys until the next build, which
    deletes them: ``--build`` (the default) queues one. The nightly build compacts too.
    """
    from memlm.datastore import Datastore
    from memlm.engine import BUILD_LOCK
    from memlm.locks import FileLock
    from workers.builder import enqueue_rebuild, purge_database_wal

    settings = _settings()
    with _migrated_sessions(settings) as sessions:
        root = settings.datastore_dir
        store = root / "datastore"
        if not (store / "manifest.json").exists():
            typer.echo(f"no datastore at {store}: nothing to compact")
            return
        with FileLock(root / BUILD_LOCK):
            ds = Datastore.open(store, shared=True)
            try:
                done = ds.compact()
                reclaimed = ds.bytes_reclaimed
            finally:
                ds.close()
        purge_database_wal(sessions)
        typer.echo(
            f"compacted {done.segments} segments: {done.rows_removed} rows of forgotten documents "
            f"removed, {done.bytes_reclaimed} bytes reclaimed ({reclaimed} over the store's life)"
        )
        if build:
            row, created = enqueue_rebuild(sessions, requested_by="cli")
            typer.echo(f"build request {row.id} ({row.request_key}): {row.status}, new={created}")


@db_app.command("upgrade")
def db_upgrade(revision: str = typer.Argument("head")) -> None:
    """Migrate the database (MEMLM_DATABASE_URL) up to a revision."""
    from memlm.db.migrate import upgrade

    settings = _settings()
    upgrade(settings.db_url, revision)
    typer.echo(f"{_shown(settings.db_url)}: at {revision}")


@db_app.command("downgrade")
def db_downgrade(revision: str = typer.Argument(...)) -> None:
    """Migrate the database down to a revision ('base' drops everything)."""
    from memlm.db.migrate import downgrade

    settings = _settings()
    downgrade(settings.db_url, revision)
    typer.echo(f"{_shown(settings.db_url)}: at {revision}")


@db_app.command("current")
def db_current() -> None:
    """Print the database's revision and the code's head revision."""
    from memlm.db.migrate import current_revision, head_revision
    from memlm.db.session import make_engine

    settings = _settings()
    engine = make_engine(settings.db_url)
    current, head = current_revision(engine), head_revision()
    typer.echo(f"current {current or 'none'}; head {head}")
    engine.dispose()
    if current != head:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("up")(up)
    app.command("serve")(serve)
    app.command("worker")(worker)
    app.command("scheduler")(scheduler)
    app.command("rebuild")(rebuild)
    app.command("compact")(compact)
    app.add_typer(db_app, name="db")
