"""Index builds: enqueue idempotently, run one queued build, record the result."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import threading
import time
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from memlm.db.models import IndexBuild
from memlm.db.repositories import BuildRepository
from memlm.db.session import purge_wal
from memlm.engine import BuildInfo, EngineLike
from memlm.locks import LockBusy

log = logging.getLogger(__name__)


def nightly_key(day: dt.date) -> str:
    """The request key of the scheduled build of ``day``: one build per day at most."""
    return f"nightly:{day.isoformat()}"


def enqueue_rebuild(
    sessions: sessionmaker[Session],
    *,
    key: str | None = None,
    requested_by: str = "manual",
    retrain: bool = False,
) -> tuple[IndexBuild, bool]:
    """Request a build in a transaction of its own (``BuildRepository.request``)."""
    with sessions.begin() as s:
        return BuildRepository(s).request(key, requested_by, retrain=retrain)


def _wants_retrain(row: IndexBuild) -> bool:
    return bool((row.params or {}).get("retrain"))


def _params(info: BuildInfo) -> dict[str, Any]:
    return dict(info.params.to_json())


def _sizes(engine: EngineLike) -> dict[str, int]:
    """Entries and bytes (on disk, in RAM) of the memory as the engine reports them now."""
    try:
        stats = engine.stats()
    except Exception:  # a figure for the dashboard must never fail a finished build
        log.exception("reading the memory's size after the build failed")
        return {}
    names = ("bytes_on_disk", "bytes_in_ram")
    return {n: int(stats[n]) for n in names if stats.get(n) is not None}


def run_queued_build(engine: EngineLike, sessions: sessionmaker[Session]) -> str | None:
    """Build the oldest queued request, if any; returns its key. Failures are recorded.

    Builds hold the data directory's build lock from the claim to the record, so a build
    marked running while nobody holds the lock lost its builder: it is queued again here.
    While another worker builds, this returns None at once (that worker has it in hand).
    """
    with sessions() as s:
        if BuildRepository(s).open_request() is None:
            return None
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(engine.building(timeout=0))
        except LockBusy:
            return None
        with sessions.begin() as s:
            builds = BuildRepository(s)
            if builds.release_orphans():
                log.warning("queued again a build whose builder stopped")
            row = builds.claim_queued()
            if row is None:
                return None
            build_id, key, retrain = row.id, row.request_key, _wants_retrain(row)
        return _build(engine, sessions, build_id, key, retrain=retrain)


def _build(
    engine: EngineLike,
    sessions: sessionmaker[Session],
    build_id: int,
    key: str,
    *,
    retrain: bool = False,
) -> str:
    log.info("building index for request %s%s", key, " (retrain)" if retrain else "")
    t0 = time.perf_counter()
    try:
        info = engine.rebuild(retrain=True) if retrain else engine.rebuild()
    except Exception:
        log.exception("index build %s failed", key)
        with sessions.begin() as s:
            BuildRepository(s).fail(build_id, "the index build failed (details in the worker log)")
        return key
    seconds = time.perf_counter() - t0
    params = _params(info)
    if retrain:
        params["retrain"] = True
    # full or incremental, why, what it added and removed
    params["build"] = info.record()
    calibrator = getattr(info, "calibrator", None)
    if calibrator is not None:  # what the calibrator training at this build did
        params["calibrator"] = calibrator
    compaction = getattr(info, "compaction", None)
    if compaction:  # what the compaction before the build removed
        params["compaction"] = compaction
    consolidation = getattr(info, "consolidation", None)
    if consolidation is not None:  # what the consolidation retired (per reason), the budget
        params["consolidation"] = consolidation
    interpolation = getattr(info, "interpolation", None)
    if interpolation is not None:  # the constant chosen and whether the calibrator beat it
        params["interpolation"] = interpolation
    sizes = _sizes(engine)
    if sizes:  # the memory's size after the build: the dashboard's bytes over time
        params["sizes"] = sizes
    with sessions.begin() as s:
        BuildRepository(s).finish(
            build_id,
            version=str(info.version),
            entries=int(info.entries),
            params=params,
            seconds=seconds,
        )
    log.info("index version %s built: %d entries in %.1f s", info.version, info.entries, seconds)
    purge_database_wal(sessions)
    return key


def purge_database_wal(sessions: sessionmaker[Session]) -> None:
    """SQLite: checkpoint and truncate the WAL, whose old pages may still hold the text of
    documents forgotten since (``memlm.db.session.purge_wal``). Part of every build."""
    bind = sessions.kw.get("bind")
    if isinstance(bind, Engine) and bind.dialect.name == "sqlite" and not purge_wal(bind):
        log.warning("a reader kept the SQLite WAL from being truncated; the next build retries")


def run_builder(
    engine: EngineLike, sessions: sessionmaker[Session], stop: threading.Event, poll: float
) -> None:
    """Build queued requests until ``stop`` is set; polls every ``poll`` seconds when idle.

    Runs beside the ingest loop (a thread of ``memlm worker`` and of the API's embedded
    worker), so documents keep flowing during a build: the build works on a snapshot of
    the datastore, and entries appended meanwhile join the fresh exact index that the new
    version is served with.
    """
    while not stop.is_set():
        try:
            built = run_queued_build(engine, sessions)
        except Exception:
            log.exception("builder step failed; retrying after a pause")
            built = None
        if built is None:
            stop.wait(poll)


def start_builder(
    engine: EngineLike, sessions: sessionmaker[Session], poll: float
) -> tuple[threading.Thread, threading.Event]:
    """Start :func:`run_builder` in a daemon thread; set the event to stop it.

    Daemon: a process that exits mid-build leaves the request ``building`` with its lock
    dropped, and the next start queues it again (builds write temp + ``os.replace``).
    """
    stop = threading.Event()
    t = threading.Thread(
        target=run_builder, args=(engine, sessions, stop, poll), name="memlm-builder", daemon=True
    )
    t.start()
    return t, stop
