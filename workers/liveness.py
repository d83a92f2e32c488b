"""Which ingest workers are alive: each holds a lock named after it for its whole life.

``MEMLM_WORKER_LIVENESS`` (``Settings.liveness``) chooses the lock. ``file``: workers on
one data directory hold a ``flock`` named after them there (``worker_lock_path``).
``database``: workers on different machines that share only PostgreSQL (and a memory
server) hold a session-level PostgreSQL advisory lock instead, on a connection of their
own: the server drops it when the process dies (its connection closes), so, like
``flock``, there is no stale lock to clean.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from sqlalchemy import Connection, NullPool, create_engine, text

from memlm.locks import FileLock, LockBusy, held_elsewhere
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
    digest = hashlib.blake2b(f"memlm-worker\0{db_url}\0{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


class PgWorkerLock:
    """The worker's "I am alive" lock in PostgreSQL (``FileLock``'s interface)."""

    def __init__(self, db_url: str, name: str) -> None:
        self.db_url = db_url
        self.name = name
        self.path = f"pg_advisory_lock({advisory_key(db_url, name)}) for worker {name}"
        self._engine = create_engine(db_url, poolclass=NullPool)
        self._conn: Connection | None = None

    def acquire(self, timeout: float | None = None, poll: float = 0.5) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        conn = self._engine.connect()
        key = advisory_key(self.db_url, self.name)
        try:
            while True:
                got = conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": key}).scalar()
                conn.commit()
                if got:
                    self._conn = conn
                    return
                if deadline is not None and time.monotonic() >= deadline:
                    raise LockBusy(f"{self.path} is held by another process")
                time.sleep(poll)
        except BaseException:  # busy, the database gone, or interrupted: no connection left open
            conn.close()
            raise

    def release(self) -> None:
        if self._conn is not None:
            key = advisory_key(self.db_url, self.name)
            try:
                self._conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                self._conn.commit()
            finally:
                self._conn.close()
                self._conn = None

    @property
    def held(self) -> bool:
        return self._conn is not None


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
