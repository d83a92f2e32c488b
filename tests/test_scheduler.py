"""The scheduler only enqueues an idempotent rebuild: a double fire builds once."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_EXECUTED, JobExecutionEvent
from apscheduler.schedulers.background import BackgroundScheduler
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from memlm.db.models import IndexBuild
from tests.fakes import FakeEngine
from tests.service_helpers import make_settings
from workers.builder import run_queued_build
from workers.scheduler import JOB_ID, configure, enqueue_nightly

MakeSessions = Callable[[str], sessionmaker[Session]]

NOON = dt.datetime(2017, 2, 7, 12, 0, tzinfo=dt.UTC)


def builds(sessions: sessionmaker[Session]) -> list[tuple[str, str, str]]:
    with sessions() as s:
        rows = s.scalars(select(IndexBuild).order_by(IndexBuild.id)).all()
        return [(r.request_key, r.requested_by, r.status) for r in rows]


def _double_fire_builds_once(sessions: sessionmaker[Session]) -> None:
    assert enqueue_nightly(sessions, NOON) is True
    assert enqueue_nightly(sessions, NOON + dt.timedelta(hours=1)) is False
    engine = FakeEngine()
    assert run_queued_build(engine, sessions) == "nightly:2017-02-07"
    assert run_queued_build(engine, sessions) is None
    assert enqueue_nightly(sessions, NOON) is False  # even after the build finished
    assert run_queued_build(engine, sessions) is None
    assert engine.built_version == 1
    assert builds(sessions) == [("nightly:2017-02-07", "scheduler", "done")]
    assert enqueue_nightly(sessions, NOON + dt.timedelta(days=1)) is True


def test_double_fire_builds_once_sqlite(sqlite_url: str, make_sessions: MakeSessions) -> None:
    _double_fire_builds_once(make_sessions(sqlite_url))


@pytest.mark.postgres
def test_double_fire_builds_once_postgres(pg_url: str, make_sessions: MakeSessions) -> None:
    _double_fire_builds_once(make_sessions(pg_url))


def _concurrent_fires(sessions: sessionmaker[Session]) -> None:
    barrier = threading.Barrier(4)
    created: list[bool] = []

    def fire() -> None:
        barrier.wait()
        created.append(enqueue_nightly(sessions, NOON))

    threads = [threading.Thread(target=fire) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(created) == [False, False, False, True]
    with sessions() as s:
        assert s.scalar(select(func.count()).select_from(IndexBuild)) == 1


def test_concurrent_fires_make_one_request_sqlite(
    sqlite_url: str, make_sessions: MakeSessions
) -> None:
    _concurrent_fires(make_sessions(sqlite_url))


@pytest.mark.postgres
def test_concurrent_fires_make_one_request_postgres(
    pg_url: str, make_sessions: MakeSessions
) -> None:
    _concurrent_fires(make_sessions(pg_url))


def test_job_is_configured_from_the_settings_cron(
    tmp_path: Path, sqlite_url: str, make_sessions: MakeSessions
) -> None:
    settings = make_settings(tmp_path, sqlite_url, rebuild_cron="30 2 * * *")
    scheduler = BackgroundScheduler(timezone=dt.UTC)
    configure(scheduler, settings, make_sessions(sqlite_url))
    [job] = scheduler.get_jobs()
    assert job.id == JOB_ID and job.coalesce is True and job.max_instances == 1
    fire = job.trigger.get_next_fire_time(None, NOON)
    assert fire == dt.datetime(2017, 2, 8, 2, 30, tzinfo=dt.UTC)


def test_scheduler_fires_the_job(
    tmp_path: Path, sqlite_url: str, make_sessions: MakeSessions
) -> None:
    """A real APScheduler run of the job queues today's request."""
    settings = make_settings(tmp_path, sqlite_url)
    sessions = make_sessions(sqlite_url)
    scheduler = BackgroundScheduler(timezone=dt.UTC)
    configure(scheduler, settings, sessions)
    fired = threading.Event()
    errors: list[object] = []

    def listener(event: JobExecutionEvent) -> None:
        errors.append(event.exception)
        fired.set()

    scheduler.add_listener(listener, EVENT_JOB_EXECUTED | EVENT_JOB_ERROR)
    scheduler.start()
    try:
        scheduler.modify_job(JOB_ID, next_run_time=dt.datetime.now(dt.UTC))
        assert fired.wait(10)
    finally:
        scheduler.shutdown(wait=True)
    assert errors == [None]
    today = dt.datetime.now(dt.UTC).date().isoformat()
    assert builds(sessions) == [(f"nightly:{today}", "scheduler", "queued")]
