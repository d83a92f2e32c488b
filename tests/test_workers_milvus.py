"""Real `memlm worker` processes on the Milvus memory: each with a data directory of its
own, sharing only PostgreSQL and the Milvus server. Every document memorised once, Milvus
holding exactly the committed documents' entries, also when one worker is SIGKILLed
between its Milvus insert and its database commit."""

from __future__ import annotations

import datetime as dt
import signal
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from memlm.db.models import DayStat, Document
from memlm.db.repositories import DocumentRepository, NewDocument
from memlm.memory import open_milvus
from tests.processes import start_worker, stop, wait_all_done
from tests.service_helpers import make_settings
from workers.liveness import pg_worker_alive

pytestmark = [pytest.mark.postgres, pytest.mark.milvus]

TEXTS = [
    f"Report {i}: the harbour authority in Port {i} announced {i + 3} new ferry routes "
    f"for the summer, and the council said the {i}th pier would reopen in May."
    for i in range(10)
]


def _name(proc: subprocess.Popen[str]) -> str:
    import socket

    return f"{socket.gethostname()}:{proc.pid}"


def _wait_live(db_url: str, procs: list[subprocess.Popen[str]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(pg_worker_alive(db_url, _name(p)) for p in procs):
            return
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.3)
    outs = [p.communicate(timeout=5)[0][-2000:] if p.poll() is not None else "" for p in procs]
    raise AssertionError(f"workers did not start in {timeout} s: {outs}")


def _entries_by_document(url: str) -> dict[int, list[int]]:
    mem = open_milvus(url, None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            rows = mem.collection.query(
                "id >= 0", output_fields=["doc_id", "position"], consistency_level="Strong"
            )
        out: dict[int, list[int]] = {}
        for r in rows:
            out.setdefault(int(r["doc_id"]), []).append(int(r["position"]))
        assert mem.count() == len(rows)
        return {d: sorted(p) for d, p in out.items()}
    finally:
        mem.close()


@pytest.mark.parametrize("crash", [False, True], ids=["two-workers", "one-killed-mid-commit"])
def test_workers_on_separate_machines_share_postgres_and_milvus(
    tmp_path: Path, pg_url: str, milvus_url: str, make_sessions: Any, crash: bool
) -> None:
    a = make_settings(tmp_path / "a", pg_url, model="tiny-llama")
    b = make_settings(tmp_path / "b", pg_url, model="tiny-llama")
    sessions = make_sessions(pg_url)
    # the killed worker dies (SIGKILL) right after its first document's Milvus insert,
    # before its commit, holding a claim that the other worker must take over
    crash_at = ["--crash-at", "after_append"] if crash else []
    first = start_worker(a, *crash_at, MEMLM_MEMORY_URL=milvus_url)
    second = start_worker(b, MEMLM_MEMORY_URL=milvus_url)
    procs = [first, second]
    try:
        _wait_live(pg_url, procs, timeout=180)  # both poll before any work arrives
        with sessions.begin() as s:
            ids = [
                d.id
                for d in DocumentRepository(s).add_many(
                    NewDocument(text=t, published_at=dt.date(2017, 2, 7), source="s") for t in TEXTS
                )
            ]
        wait_all_done(sessions, ids, procs, timeout=300)
    finally:
        outs = [stop(p) for p in procs]
    if crash:
        assert first.returncode == -signal.SIGKILL, outs[0][-2000:]
    else:
        assert first.returncode == 0, outs[0][-2000:]
        assert "done:" in outs[0] and "done:" in outs[1], outs  # both really worked
    assert second.returncode == 0, outs[1][-2000:]
    assert not (a.data_dir / "memory" / "datastore").exists()  # nothing local holds entries

    with sessions() as s:
        docs = [s.get(Document, i) for i in ids]
        [day] = s.scalars(select(DayStat)).all()
    held = _entries_by_document(milvus_url)
    # exactly the committed documents' entries: no orphans, no duplicates, none lost
    assert sorted(held) == sorted(ids)
    for d in docs:
        assert held[d.id] == list(range(1, d.tokens_seen + 1))  # FullMem: every token once
        assert d.tokens_stored == d.tokens_seen
        assert d.entry_start is None and d.entry_end is None
    assert (day.documents, day.tokens_stored) == (len(ids), sum(map(len, held.values())))

    # a worker (re)started on a third machine finds nothing to clean, and the engine's
    # stats (what /admin/stats shows) equal what Milvus holds
    from workers.engine import open_engine

    c = make_settings(tmp_path / "c", pg_url, model="tiny-llama", memory_url=milvus_url)
    eng = open_engine(c, writer=False)
    st = eng.stats()
    assert st["backend"] == "milvus"
    assert st["entries"] == st["datastore_entries"] == day.tokens_stored


def test_restart_deletes_entries_of_uncommitted_documents(
    tmp_path: Path, pg_url: str, milvus_url: str, make_sessions: Any
) -> None:
    """A worker killed after its insert leaves entries whose document is pending again;
    the next worker's start-up deletes them before anything serves them for long."""
    import numpy as np

    settings = make_settings(tmp_path, pg_url, model="tiny-llama")
    sessions = make_sessions(pg_url)
    with sessions.begin() as s:
        [pending, done] = [
            d.id
            for d in DocumentRepository(s).add_many(
                NewDocument(text=t, published_at=dt.date(2017, 2, 7), source="s") for t in TEXTS[:2]
            )
        ]
        DocumentRepository(s).get(done).status = "done"
    mem = open_milvus(milvus_url, 32)  # tiny-llama's key width
    try:
        rng = np.random.default_rng(0)
        for doc in (pending, done):
            mem.append(
                rng.standard_normal((5, 32)),
                np.arange(5),
                np.full(5, doc),
                np.arange(5),
                np.zeros(5),
            )
    finally:
        mem.close()
    proc = start_worker(settings, MEMLM_MEMORY_URL=milvus_url)
    try:
        _wait_live(pg_url, [proc], timeout=180)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with sessions() as s:
                if s.get(Document, pending).status == "done":
                    break
            time.sleep(0.3)
    finally:
        out = stop(proc)
    assert "deleted 5 Milvus entries of uncommitted documents" in out, out[-3000:]
    held = _entries_by_document(milvus_url)
    with sessions() as s:
        d = s.get(Document, pending)
        assert d.status == "done", out[-3000:]
    assert held[done] == [0, 1, 2, 3, 4]  # committed: kept as it was
    assert held[pending] == list(range(1, d.tokens_seen + 1))  # re-memorised, not doubled


def test_one_builder_at_a_time_per_milvus_memory_across_data_directories(
    tmp_path: Path, pg_url: str, milvus_url: str, make_sessions: Any
) -> None:
    """Processes on separate data directories that share PostgreSQL and one Milvus memory
    share its build lock (a PostgreSQL advisory lock named by the memory URL): while one
    builds, another's build lock is busy, and a worker starting meanwhile does not drop
    the generation the build is filling as if a killed build had left it."""
    from memlm.encoder import Encoder
    from memlm.engine.opening import reconcile_index
    from memlm.index import IndexParams
    from memlm.locks import LockBusy
    from memlm.memory.milvus_generations import generation_name, generations
    from workers.engine import open_engine

    enc = Encoder.load("tiny-llama", threads=1)
    a, b = (
        make_settings(tmp_path / d, pg_url, model="tiny-llama", memory_url=milvus_url)
        for d in ("a", "b")
    )
    assert (a.liveness, b.liveness) == ("database", "database")
    ea: Any = open_engine(a, encoder=enc)
    eb: Any = open_engine(b, encoder=enc)
    mem = ea.memory
    try:
        with ea.building():
            with pytest.raises(LockBusy), eb.building(timeout=0):
                pass
            # the next generation, as a blue-green build creates it before its copy
            filling = mem._create(generation_name(mem.base, 2), IndexParams.exact())
            reconcile_index(eb, make_sessions(pg_url), delete=True)  # B's worker starts
            assert filling in generations(mem.base, mem.alias, mem.timeout)
        with eb.building(timeout=0):  # free again once A's build ended
            pass
    finally:
        ea.close()
        eb.close()
