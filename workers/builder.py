"""Index builds: enqueue idempotently, run one queued build, record the result."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import time
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from memlm.db.models import IndexBuild
from memlm.db.repositories import BuildRepository
from memlm.locks import LockBusy
from workers.engine import EngineLike

log = logging.getLogger(__name__)


def nightly_key(day: dt.date) -> str:
    """The request key of the scheduled build of ``day``: one build per day at most."""
    return f"nightly:{day.isoformat()}"


def enqueue_rebuild(
    sessions: sessionmaker[Session], *, key: str | None = None, requested_by: str = "manual"
) -> tuple[IndexBuild, bool]:
    """Request a build. With a key, the same key twice gives the first request; without,
    the request joins a build already queued or running, else a new one is queued."""
    with sessions.begin() as s:
        builds = BuildRepository(s)
        if key is None:
            pending = builds.open_request()
            if pending is not None:
                return pending, False
            key = f"{requested_by}:{dt.datetime.now(dt.UTC).isoformat(timespec='microseconds')}"
        return builds.enqueue(key, requested_by)


def _params(info: Any) -> dict[str, Any]:
    params: Any = getattr(info, "params", None)
    if params is None:
        return {}
    return dict(params.to_json() if hasattr(params, "to_json") else params)


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
            build_id, key = row.id, row.request_key
        return _build(engine, sessions, build_id, key)


def _build(engine: EngineLike, sessions: sessionmaker[Session], build_id: int, key: str) -> str:
    log.info("building index for request %s", key)
    t0 = time.perf_counter()
    try:
        info = engine.rebuild()
    except Exception:
        log.exception("index build %s failed", key)
        with sessions.begin() as s:
            BuildRepository(s).fail(build_id, "the index build failed (details in the worker log)")
        return key
    seconds = time.perf_counter() - t0
    params = _params(info)
    calibrator = getattr(info, "calibrator", None)
    if calibrator is not None:  # what the calibrator training at this build did
        params["calibrator"] = calibrator
    interpolation = getattr(info, "interpolation", None)
    if interpolation is not None:  # the constant chosen and whether the calibrator beat it
        params["interpolation"] = interpolation
    with sessions.begin() as s:
        BuildRepository(s).finish(
            build_id,
            version=str(info.version),
            entries=int(info.entries),
            params=params,
            seconds=seconds,
        )
    log.info("index version %s built: %d entries in %.1f s", info.version, info.entries, seconds)
    return key
