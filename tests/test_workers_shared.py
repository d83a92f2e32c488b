"""Several real `memlm worker` processes on one data directory and one PostgreSQL database:
every document memorised once, the datastore exactly the committed documents' entries,
also when one worker is killed between its append and its commit."""

from __future__ import annotations

import datetime as dt
import signal
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
from tests.processes import start_worker, stop, wait_all_done
from tests.service_helpers import make_settings

pytestmark = pytest.mark.postgres

TEXTS = [
    f"Report {i}: the harbour authority in Port {i} announced {i + 3} new ferry routes "
    f"for the summer, and the council said the {i}th pier would reopen in May."
    for i in range(10)
]


def _wait_live_workers(settings: Any, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = list(settings.workers_dir.glob("*.lock"))
        if sum(held_elsewhere(f) for f in files) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"{n} workers did not start in {timeout} s")


@pytest.mark.parametrize("crash", [False, True], ids=["two-workers", "one-killed-mid-commit"])
def test_worker_processes_share_the_queue_and_the_datastore(
    tmp_path: Path, pg_url: str, make_sessions: Any, crash: bool
) -> None:
    settings = make_settings(tmp_path, pg_url, model="tiny-llama")
    sessions = make_sessions(pg_url)
    # the killed worker dies (SIGKILL) right after appending its first document's entries,
    # holding the datastore's write lock and a claim the other worker must take over
    first = start_worker(settings, *(["--crash-at", "after_append"] if crash else []))
    second = start_worker(settings)
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
        wait_all_done(sessions, ids, procs, timeout=240)
    finally:
        outs = [stop(p) for p in procs]
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
