"""Exclusive ``flock`` file locks between processes: no stale locks, the kernel drops them
when their holder dies, so holding one also says "I am alive" (see ``held_elsewhere``)."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from types import TracebackType


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
