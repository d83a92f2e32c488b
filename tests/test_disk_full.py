"""The promise "Disk full" (issue 31), tried for real: the data directory on a small tmpfs
that fills during ingest, the API with its embedded worker on PostgreSQL, the real engine
with a tiny random model."""

from __future__ import annotations

import errno
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from memlm.db.models import Document
from memlm.unavailable import DISK_FULL
from tests.service_helpers import ADMIN, INGEST, READ, doc, make_settings
from tests.small_fs import resize, small_filesystem

pytestmark = pytest.mark.postgres

WORDS = [
    "the",
    "harbour",
    "port",
    "ferry",
    "routes",
    "summer",
    "council",
    "pier",
    "reopen",
    "river",
    "city",
    "budget",
]


@pytest.fixture(scope="module")
def tiny() -> Any:
    from memlm.encoder import Encoder

    return Encoder.load("tiny-llama", threads=1)


def _texts(n: int, seed: int) -> list[str]:
    rnd = random.Random(seed)
    return [
        " ".join(f"{rnd.choice(WORDS)}{rnd.randint(0, 999)}" for _ in range(40)) for _ in range(n)
    ]


def _fill(path: Path) -> None:
    """Write ``path`` until the filesystem is full."""
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def _wait(what: Callable[[], bool], timeout: float, why: str) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, f"not within {timeout} s: {why}"
        time.sleep(0.1)


def test_a_full_disk_makes_documents_wait_and_loses_nothing(
    tmp_path: Path, pg_url: str, tiny: Any
) -> None:
    from memlm.cli.compose import build_app
    from memlm.engine import open_engine, policy_factory

    with small_filesystem(tmp_path / "fs", "2m") as fs:
        settings = make_settings(
            fs,
            pg_url,
            model="tiny-llama",
            policy="fullmem",
            ingest_retry_backoff_seconds=0.5,
            ingest_retry_backoff_max_seconds=2.0,
            ingest_max_attempts=1000,  # the documents wait for space; none fails for good
            index_poll_seconds=0.2,  # the API's poll reloads the manifest beside the worker
        )
        engine: Any = open_engine(settings, encoder=tiny)
        app = build_app(
            settings, engine=engine, policy_factory=policy_factory, embedded_worker=True
        )
        with TestClient(app) as c:
            sessions = app.state.memlm.sessions

            def ingest(texts: list[str]) -> list[int]:
                r = c.post("/ingest", headers=INGEST, json={"documents": [doc(t) for t in texts]})
                assert r.status_code == 202, r.text
                return [d["id"] for d in r.json()["documents"]]

            def rows(ids: list[int]) -> list[Document]:
                with sessions() as s:
                    return list(s.scalars(select(Document).where(Document.id.in_(ids))))

            first = ingest(_texts(6, 0))
            _wait(lambda: {d.status for d in rows(first)} == {"done"}, 60, "first documents")
            _fill(fs / "filler")
            late = ingest(_texts(6, 1))
            _wait(lambda: any(d.error == DISK_FULL for d in rows(late)), 60, "a disk-full reason")

            # Full: the worker backs off (0.5, 1, 2, 2 s...) instead of looping through the
            # queue; every late document waits with the reason, none is done or failed.
            tries = sum(d.attempts or 0 for d in rows(late))
            time.sleep(4.0)
            tried = sum(d.attempts or 0 for d in rows(late)) - tries
            assert 1 <= tried <= 4
            assert {d.status for d in rows(late)} <= {"pending", "processing"}
            assert {d.error for d in rows(late) if d.attempts} == {DISK_FULL}
            assert c.get("/healthz").json() == {"status": "ok"}
            # served: the committed documents' entries only, nothing of a failed try
            p = c.post(
                "/predict",
                headers=READ,
                json={"context": _texts(1, 0)[0][:60], "neighbours": 20},
            )
            assert p.status_code == 200
            assert {n["document_id"] for n in p.json()["neighbours"]} <= set(first)
            # no temporary file of a failed write holds space
            left = sorted(str(f.relative_to(fs)) for f in fs.rglob("*") if "tmp" in f.name)
            assert left == []

            resize(fs, "64m")
            _wait(lambda: {d.status for d in rows(late)} == {"done"}, 60, "space came back")

            with sessions() as s:
                done = list(
                    s.execute(
                        select(Document.id, Document.entry_start, Document.entry_end)
                        .where(Document.status == "done")
                        .order_by(Document.entry_start)
                    )
                )
                stored = s.scalar(select(func.sum(Document.tokens_stored)))
            ds = engine.memory.datastore
            assert sorted(d.id for d in done) == sorted(first + late)
            ends = [0] + [d.entry_end for d in done]
            assert [d.entry_start for d in done] == ends[:-1]  # contiguous, in commit order
            for d in done:
                owners = ds.provenance(np.arange(d.entry_start, d.entry_end))[0]
                assert set(owners.tolist()) == {d.id}
            stats = c.get("/admin/stats", headers=ADMIN).json()
            assert len(ds) == ds.num_live == ends[-1] == stored
            assert stats["entries"] == stats["tokens_stored"] == stored


def test_a_full_disk_under_the_embedded_sqlite_answers_503_and_loses_nothing(
    tmp_path: Path, tiny: Any
) -> None:
    """The embedded default: the SQLite database lives in the full data directory too.
    Writes to it fail ("database or disk is full"): /ingest answers 503 with the reason
    (not 500), the worker can claim nothing and pauses; once space returns, everything
    ends done with datastore = database = stats."""
    from memlm.cli.compose import build_app
    from memlm.db.migrate import upgrade
    from memlm.engine import open_engine, policy_factory

    with small_filesystem(tmp_path / "fs", "2m") as fs:
        settings = make_settings(
            fs,
            f"sqlite:///{fs / 'data' / 'memlm.sqlite'}",  # the embedded default's place
            model="tiny-llama",
            policy="fullmem",
            ingest_retry_backoff_seconds=0.5,
            ingest_retry_backoff_max_seconds=2.0,
            index_poll_seconds=0.2,
        )
        settings.data_dir.mkdir()
        upgrade(settings.db_url)
        engine: Any = open_engine(settings, encoder=tiny)
        app = build_app(
            settings, engine=engine, policy_factory=policy_factory, embedded_worker=True
        )
        with TestClient(app) as c:
            sessions = app.state.memlm.sessions

            def ingest(texts: list[str]) -> Any:
                return c.post(
                    "/ingest", headers=INGEST, json={"documents": [doc(t) for t in texts]}
                )

            def statuses() -> list[str]:
                with sessions() as s:
                    return list(s.scalars(select(Document.status)))

            assert ingest(_texts(6, 0)).status_code == 202
            _wait(lambda: statuses() == ["done"] * 6, 60, "first documents")
            _fill(fs / "filler")
            refused = ingest(_texts(20, 1))  # ~10 kB of new rows: the WAL must grow
            assert refused.status_code == 503, refused.text
            assert refused.json() == {"error": "unavailable", "detail": DISK_FULL}
            assert refused.headers["Retry-After"] == "1"
            assert c.get("/healthz").json() == {"status": "ok"}
            p = c.post(
                "/predict",
                headers=READ,
                json={"context": _texts(1, 0)[0][:60], "neighbours": 5},
            )
            assert p.status_code == 200  # reads need no space: served as before
            assert {n["document_id"] for n in p.json()["neighbours"]} <= set(range(1, 7))

            resize(fs, "64m")
            assert ingest(_texts(20, 1)).status_code == 202
            _wait(lambda: statuses() == ["done"] * 26, 60, "space came back")
            with sessions() as s:
                stored = s.scalar(select(func.sum(Document.tokens_stored)))
                end = s.scalar(select(func.max(Document.entry_end)))
            ds = engine.memory.datastore
            stats = c.get("/admin/stats", headers=ADMIN).json()
            assert len(ds) == ds.num_live == end == stored
            assert stats["entries"] == stats["tokens_stored"] == stored
