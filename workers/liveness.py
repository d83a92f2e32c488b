"""Which ingest workers are alive: each holds a lock named after it for its whole life.

``MEMLM_WORKER_LIVENESS`` (``Settings.liveness``) chooses the lock. ``file``: workers on
one data directory hold a ``flock`` named after them there (``worker_lock_path``).
``database``: workers on different machines that share only PostgreSQL (and a memory
server) hold a session-level PostgreSQL advisory lock instead, on a connection of their
own: the server drops it when the process dies (its connection closes), so, like
``flock``, there is no stale lock to clean.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import NullPool, create_engine, text

from memlm.locks import FileLock, PgAdvisoryLock, held_elsewhere
from memlm.locks import advisory_key as lock_key
from memlm.settings import Settings


def worker_lock_path(settings: Settings, name: str) -> Path:
    """The file a live worker of this name holds locked (``host:pid`` -> ``host_pid.lock``)."""
    safe = "".join(c if c.isalnum() or c in "-._" else "_" for c in name)
    return settings.workers_dir / f"{safe}.lock"


def worker_lock(settings: Settings, name: str) -> FileLock | PgWorkerLock:
    """The lock that says worker ``name`` lives, as the settings choose."""
    if settings.liveness == "database":
        return PgWorkerLock(settings.db_url, name)
    return FileLock(worker_lock_path(settings, name))


def worker_alive(settings: Settings, name: str) -> bool:
    """Whether another process holds worker ``name``'s lock now."""
    if settings.liveness == "database":
        return pg_worker_alive(settings.db_url, name)
    return held_elsewhere(worker_lock_path(settings, name))


def advisory_key(db_url: str, name: str) -> int:
    """A signed 64-bit advisory-lock key for a worker name (per database URL)."""
    return lock_key("memlm-worker", db_url, name)


class PgWorkerLock(PgAdvisoryLock):
    """The worker's "I am alive" lock in PostgreSQL (``FileLock``'s interface)."""

    def __init__(self, db_url: str, name: str) -> None:
        super().__init__(db_url, advisory_key(db_url, name), f"worker {name}")
        self.name = name


def pg_worker_alive(db_url: str, name: str) -> bool:
    """Whether a live process holds worker ``name``'s advisory lock now."""
    eng = create_engine(db_url, poolclass=NullPool)
    try:
        with eng.connect() as conn:
            key = advisory_key(db_url, name)
            got = conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": key}).scalar()
            if got:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
            conn.commit()
            return not got
    finally:
        eng.dispose()
