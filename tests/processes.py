"""Real memlm processes for the tests: their environment, a free port, start, wait, stop.

One home for what the process tests share (issue 33): the environment a `memlm` child
process gets (this one's, the tiny model, one thread, the tests' tokens), ``memlm worker``
started on a service's settings, waiting until documents are done, and a stop that
returns what the process printed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from memlm.db.models import Document

ROOT = Path(__file__).resolve().parents[1]

# the tokens of service_helpers.make_settings: a worker child process and the test's
# in-process app agree on them
TEST_TOKENS = {
    "MEMLM_INGEST_TOKEN": "ingest-secret-for-tests",
    "MEMLM_ADMIN_TOKEN": "admin-secret-for-tests",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def memlm_env(**settings: str | None) -> dict[str, str]:
    """This process's environment for a `memlm` child: the tiny random Llama on one
    thread, plus ``settings`` (``MEMLM_X="value"``; None removes the variable)."""
    env = {**os.environ, "MEMLM_MODEL": "tiny-llama", "MEMLM_THREADS": "1"}
    for name, value in settings.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def start_memlm(
    args: list[str], env: dict[str, str], log: Any = subprocess.PIPE
) -> subprocess.Popen[str]:
    """``python -m memlm.cli ARGS`` from the repository root; output to ``log`` (a file, or
    a pipe read as text)."""
    return subprocess.Popen(
        [sys.executable, "-m", "memlm.cli", *args],
        env=env,
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )


def worker_env(settings: Any, **extra: str | None) -> dict[str, str]:
    """The environment of ``memlm worker`` on the data directory and database of
    ``settings`` (service_helpers.make_settings): FullMem, polling every 0.2 s."""
    base: dict[str, str | None] = {
        "MEMLM_ENV": "test",
        "MEMLM_DATA_DIR": str(settings.data_dir),
        "MEMLM_DATABASE_URL": settings.db_url,
        "MEMLM_WORKER_POLL_SECONDS": "0.2",
        "MEMLM_POLICY": "fullmem",
        **TEST_TOKENS,
    }
    return memlm_env(**{**base, **extra})


def start_worker(settings: Any, *args: str, **extra: str | None) -> subprocess.Popen[str]:
    """A ``memlm worker`` process (output piped) on ``settings``' data directory and
    database; ``extra`` settings on top (e.g. ``MEMLM_MEMORY_URL``)."""
    return start_memlm(["worker", *args], worker_env(settings, **extra))


def wait_all_done(sessions: Any, ids: list[int], procs: list[Any], timeout: float) -> None:
    """Until every document of ``ids`` is done; else fail with their statuses and what
    the processes that exited printed."""
    deadline = time.monotonic() + timeout
    statuses: set[str] = set()
    while time.monotonic() < deadline:
        with sessions() as s:
            statuses = {s.get(Document, i).status for i in ids}
        if statuses == {"done"}:
            return
        time.sleep(0.3)
    outs = [p.communicate(timeout=5)[0][-2000:] if p.poll() is not None else "" for p in procs]
    raise AssertionError(f"documents not done in {timeout} s: {statuses}; {outs}")


def stop(proc: subprocess.Popen[str], timeout: float = 60) -> str:
    """SIGTERM (a graceful stop) unless it already exited; what it printed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=timeout)
    return out or ""
