"""Exclusive locks between processes that die with their holder, so holding one also says
"I am alive": ``flock`` file locks (processes on one data directory; ``held_elsewhere``)
and PostgreSQL session advisory locks (processes that share only the database)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol


class LockBusy(RuntimeError):
    """Another process holds the lock."""


class FileLock:
    """``flock`` on a file; released by the kernel if the holder dies, so no stale locks."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd: int | None = None

    def acquire(self, timeout: float | None = None, poll: float = 0.5) -> None:
        """Take the lock, waiting up to ``timeout`` seconds (forever when None)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if deadline is not None and time.monotonic() >= deadline:
                    os.close(fd)
                    raise LockBusy(f"{self.path} is held by another process") from None
                time.sleep(poll)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> FileLock:
        self.acquire()
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def held_elsewhere(path: Path) -> bool:
    """Whether another process holds the lock on ``path`` now (a missing file: no)."""
    if not Path(path).exists():
        return False
    lock = FileLock(path)
    try:
        lock.acquire(timeout=0)
    except LockBusy:
        return True
    lock.release()
    return False


class ProcessLock(Protocol):
    """What ``FileLock`` and ``PgAdvisoryLock`` both offer."""

    def acquire(self, timeout: float | None = None, poll: float = 0.5) -> None: ...

    def release(self) -> None: ...


def advisory_key(namespace: str, db_url: str, name: str) -> int:
    """A signed 64-bit advisory-lock key for ``name`` in ``namespace`` (per database URL)."""
    digest = hashlib.blake2b(f"{namespace}\0{db_url}\0{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


class PgAdvisoryLock:
    """A PostgreSQL session advisory lock on a connection of its own (``FileLock``'s
    interface): the server drops it when the holder's connection dies."""

    def __init__(self, db_url: str, key: int, what: str) -> None:
        from sqlalchemy import NullPool, create_engine

        self.db_url = db_url
        self.key = key
        self.path = f"pg_advisory_lock({key}) for {what}"
        self._engine = create_engine(db_url, poolclass=NullPool)
        self._conn: Any = None

    def acquire(self, timeout: float | None = None, poll: float = 0.5) -> None:
        from sqlalchemy import text

        deadline = None if timeout is None else time.monotonic() + timeout
        conn = self._engine.connect()
        try:
            while True:
                got = conn.execute(
                    text("SELECT pg_try_advisory_lock(:k)"), {"k": self.key}
                ).scalar()
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
        from sqlalchemy import text

        if self._conn is not None:
            try:
                self._conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": self.key})
                self._conn.commit()
            finally:
                self._conn.close()
                self._conn = None

    @property
    def held(self) -> bool:
        return self._conn is not None
