"""Helpers shared by the API and worker tests (not fixtures: plain functions)."""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from memlm.settings import Settings

INGEST = {"Authorization": "Bearer ingest-secret-for-tests"}
ADMIN = {"Authorization": "Bearer admin-secret-for-tests"}
READ = {"Authorization": "Bearer read-secret-for-tests"}


def make_settings(tmp_path: Path, db_url: str, **over: Any) -> Settings:
    base: dict[str, Any] = {
        "env": "test",
        "data_dir": tmp_path / "data",
        "database_url": db_url,
        "ingest_token": "ingest-secret-for-tests",
        "admin_token": "admin-secret-for-tests",
        "read_token": "read-secret-for-tests",
        # Reads open, as most tests are about something else: outside development, open
        # reads answer snippets only to a token (READ); tests of protection set None/True.
        "protect_read": False,
        "worker_poll_seconds": 0.05,
        "index_poll_seconds": 3600,
        # Exact expectations need the same numbers on every processor: no probe (auto
        # could choose bfloat16 on one machine and float32 on another), no GPU.
        "precision": "float32",
        "device": "cpu",
    }
    base.update(over)
    return Settings(_env_file=None, **base)  # type: ignore[call-arg]


def doc(text: str, day: str = "2017-02-07", source: str = "test", **kw: Any) -> dict[str, Any]:
    return {"text": text, "published_at": day, "source": source, **kw}


@contextlib.contextmanager
def predicting(
    bases: Sequence[str], contexts: Sequence[str], clients: int = 4
) -> Iterator[list[int]]:
    """``clients`` threads POST /predict (a seeded random context each time; client i on
    ``bases[i % len(bases)]``) until the block ends: yields the list their status codes
    are appended to, complete once the block has left."""
    import httpx

    statuses: list[int] = []
    lock = threading.Lock()
    done = threading.Event()

    def client(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=bases[seed % len(bases)], timeout=60) as c:
            while not done.is_set():
                r = c.post("/predict", json={"context": rng.choice(contexts), "top_n": 5})
                with lock:
                    statuses.append(r.status_code)

    threads = [threading.Thread(target=client, args=(s,)) for s in range(clients)]
    for t in threads:
        t.start()
    try:
        yield statuses
    finally:
        done.set()
        for t in threads:
            t.join(timeout=60)


@contextlib.contextmanager
def serve(app: Any, *, start_timeout: float = 60, **config: Any) -> Iterator[str]:
    """``app`` served by a real uvicorn on 127.0.0.1 from a thread: yields its base URL.

    ``config``: more ``uvicorn.Config`` options (``timeout_keep_alive``, ``log_level``...).
    """
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = {"log_level": "warning", **config}
    srv = uvicorn.Server(uvicorn.Config(app, lifespan="on", **config))
    t = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + start_timeout
    while not srv.started:
        assert time.monotonic() < deadline and t.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        t.join(timeout=start_timeout)
        sock.close()
