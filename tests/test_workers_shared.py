"""Several real `memlm worker` processes on one data directory and one PostgreSQL database:
every document memorised once, the datastore exactly the committed documents' entries,
also when one worker is killed between its append and its commit."""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import select

from memlm.datastore import Datastore
from memlm.db.models import DayStat, Document
from memlm.db.repositories import DocumentRepository, NewDocument
from memlm.locks import held_elsewhere
from tests.service_helpers import make_settings

pytestmark = pytest.mark.postgres

ROOT = Path(__file__).parents[1]
TEXTS = [
    f"Report {i}: the harbour authority in Port {i} announced {i + 3} new ferry routes "
    f"for the summer, and the council said the {i}th pier would reopen in May."
    for i in range(10)
]


def _worker(settings: Any, *extra: str) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "MEMLM_ENV": "test",
        "MEMLM_MODEL": "tiny-llama",
        "MEMLM_DATA_DIR": str(settings.data_dir),
        "MEMLM_DATABASE_URL": settings.db_url,
        "MEMLM_INGEST_TOKEN": "ingest-secret-for-tests",
        "MEMLM_ADMIN_TOKEN": "admin-secret-for-tests",
        "MEMLM_THREADS": "1",
        "MEMLM_WORKER_POLL_SECONDS": "0.2",
        "MEMLM_POLICY": "fullmem",
    }
    return subprocess.Popen(
        [sys.executable, "-m", "memlm.cli", "worker", *extra],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_live_workers(settings: Any, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = list(settings.workers_dir.glob("*.lock"))
        if sum(held_elsewhere(f) for f in files) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"{n} workers did not start in {timeout} s")


def _wait_all_done(sessions: Any, ids: list[int], procs: list[Any], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with sessions() as s:
            statuses = {s.get(Document, i).status for i in ids}
        if statuses == {"done"}:
            return
        time.sleep(0.3)
    outs = [p.communicate(timeout=5)[0][-2000:] if p.poll() is not None else "" for p in procs]
    raise AssertionError(f"documents not done in {timeout} s: {statuses}; {outs}")


def _stop(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    return out


@pytest.mark.parametrize("crash", [False, True], ids=["two-workers", "one-killed-mid-commit"])
def test_worker_processes_share_the_queue_and_the_datastore(
    tmp_path: Path, pg_url: str, make_sessions: Any, crash: bool
) -> None:
    settings = make_settings(tmp_path, pg_url, model="tiny-llama")
    sessions = make_sessions(pg_url)
    # the killed worker dies (SIGKILL) right after appending its first document's entries,
    # holding the datastore's write lock and a claim the other worker must take over
    first = _worker(settings, *(["--crash-at", "after_append"] if crash else []))
    second = _worker(settings)
    procs = [first, second]
    try:
        _wait_live_workers(settings, 2, timeout=120)  # both poll before any work arrives
        with sessions.begin() as s:
            ids = [
                a.id
                for a in DocumentRepository(s).add_many(
                    NewDocument(text=t, published_at=dt.date(2017, 2, 7), source="s") for t in TEXTS
                )
            ]
        _wait_all_done(sessions, ids, procs, timeout=240)
    finally:
        outs = [_stop(p) for p in procs]
    if crash:
        assert first.returncode == -signal.SIGKILL, outs[0][-2000:]
    else:
        assert first.returncode == 0, outs[0][-2000:]
    assert second.returncode == 0, outs[1][-2000:]

    with sessions() as s:
        docs = sorted((s.get(Document, i) for i in ids), key=lambda d: d.entry_start)
        [day] = s.scalars(select(DayStat)).all()
    ds = Datastore.open(settings.datastore_dir / "datastore", readonly=True)
    assert len(ds) == ds.num_live == docs[-1].entry_end
    assert docs[0].entry_start == 0
    for a, b in zip(docs, docs[1:], strict=False):
        assert a.entry_end == b.entry_start  # the committed ranges tile the datastore
    for d in docs:
        owners, positions, _ = ds.provenance(np.arange(d.entry_start, d.entry_end))
        assert set(owners.tolist()) == {d.id}
        assert positions.tolist() == list(range(1, d.tokens_seen + 1))  # FullMem: every token
        assert d.tokens_stored == d.entry_end - d.entry_start == d.tokens_seen
    assert (day.documents, day.tokens_stored) == (len(ids), len(ds))
    if not crash:  # both really worked
        assert "done:" in outs[0] and "done:" in outs[1], outs
