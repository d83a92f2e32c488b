"""`memlm up --demo` end to end in a subprocess (tiny random Llama): the one command."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.processes import ROOT, free_port, memlm_env

ADMIN = {"Authorization": "Bearer change-me"}


def test_up_demo_serves_neighbours_from_a_real_article(tmp_path: Path) -> None:
    port = free_port()
    env = memlm_env(
        MEMLM_DATA_DIR=str(tmp_path / "data"),
        MEMLM_INDEX_POLL_SECONDS="0.5",
        MEMLM_WORKER_POLL_SECONDS="0.2",
        MEMLM_DATABASE_URL=None,  # the embedded SQLite of the data directory
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "memlm.cli",
            "up",
            "--demo",
            "--demo-days",
            "1",
            "--workers",
            "2",
            "--port",
            str(port),
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []  # read as it comes, so the test can wait for a line
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=30) as c:
            deadline = time.monotonic() + 240
            stats: dict = {}
            while time.monotonic() < deadline:
                try:
                    if c.get("/readyz").status_code == 200:
                        stats = c.get("/admin/stats", headers=ADMIN).json()
                        if stats["documents"] == {"done": 1}:
                            break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            assert stats.get("documents") == {"done": 1}, stats
            assert stats["entries"] == stats["tokens_stored"] > 0
            pred = c.post("/predict", json={"context": "The", "neighbours": 3}).json()
            first = pred["neighbours"][0]
            assert first["document_id"] == 1 and first["published_at"] == "2016-04-19"
            assert first["snippet"]
            # both ingest workers (embedded and extra process) must have started before the
            # SIGTERM: a loaded machine may still be loading the extra one's model
            while time.monotonic() < deadline + 120:
                if sum(" started: " in line and "worker " in line for line in list(lines)) >= 2:
                    break
                time.sleep(0.2)
    finally:
        # SIGTERM, as a service manager stops it: the scheduler child must stop with it
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        reader.join(timeout=30)
        proc.stdout.close()
    out = "".join(lines)
    assert proc.returncode == 0, out[-3000:]
    assert "demo: 1 news articles of 1 days queued (1 new" in out
    assert "scheduler started" in out
    scheduler = int(re.search(r"scheduler pid (\d+)", out).group(1))  # type: ignore[union-attr]
    worker = int(re.search(r"1 more ingest worker processes: pid (\d+)", out).group(1))  # type: ignore[union-attr]
    deadline = time.monotonic() + 15
    while (_alive(scheduler) or _alive(worker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(scheduler), "memlm up left its scheduler running"
    assert not _alive(worker), "memlm up left its worker process running"
    assert f"worker {socket.gethostname()}:{worker} started" in out


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting for its (gone) parent."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
