"""The scheduler process: APScheduler 3 fires the rebuild cron; its job only enqueues."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging

from apscheduler.schedulers.base import BaseScheduler
from apscheduler.schedulers.blocking import BlockingScheduler
from apscheduler.triggers.cron import CronTrigger
from sqlalchemy.orm import Session, sessionmaker

from memlm.settings import Settings
from workers.builder import enqueue_rebuild, nightly_key

log = logging.getLogger(__name__)

JOB_ID = "nightly-rebuild"


def enqueue_nightly(sessions: sessionmaker[Session], now: dt.datetime | None = None) -> bool:
    """The job: request today's build; a second fire the same day changes nothing."""
    day = (now or dt.datetime.now(dt.UTC)).date()
    row, created = enqueue_rebuild(sessions, key=nightly_key(day), requested_by="scheduler")
    log.info(
        "rebuild for %s %s (request %d)", day, "queued" if created else "already queued", row.id
    )
    return created


def configure(
    scheduler: BaseScheduler, settings: Settings, sessions: sessionmaker[Session]
) -> None:
    """Add the one job under an explicit id (replacing it if present)."""
    scheduler.add_job(
        enqueue_nightly,
        CronTrigger.from_crontab(settings.rebuild_cron, timezone=dt.UTC),
        args=[sessions],
        id=JOB_ID,
        replace_existing=True,
        coalesce=True,  # missed fires collapse into one
        max_instances=1,
        misfire_grace_time=3600,
    )


def run_scheduler(settings: Settings, sessions: sessionmaker[Session]) -> None:
    """Block, firing the rebuild cron in UTC, until interrupted."""
    scheduler = BlockingScheduler(timezone=dt.UTC)
    configure(scheduler, settings, sessions)
    log.info("scheduler started: rebuild cron %r (UTC)", settings.rebuild_cron)
    with contextlib.suppress(KeyboardInterrupt, SystemExit):
        scheduler.start()
