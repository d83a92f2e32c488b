"""Backup and restore (issue 31): a consistent snapshot of a running service, taken while
a worker ingests; restored into an empty data directory and database (SQLite and
PostgreSQL), after which /predict answers exactly as before; non-empty targets and
damaged backups refused."""

from __future__ import annotations

import datetime as dt
import gzip
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from typer.testing import CliRunner

from memlm.backup import BackupCorrupt, BackupError, TargetNotEmpty, backup, restore
from memlm.backup.manifest import BackupManifest
from memlm.datastore import Datastore
from memlm.db.migrate import upgrade
from memlm.db.models import Document
from memlm.db.repositories import DocumentRepository, NewDocument
from memlm.engine import open_engine, policy_factory
from memlm.settings import Settings
from service.app import create_app
from tests.service_helpers import ADMIN, make_settings
from workers.ingest import IngestWorker, SimulatedCrash

TEXTS = [
    f"Report {i}: the harbour authority in Port {i} announced {i + 3} new ferry routes "
    f"for the summer, and the council said pier {i} would reopen in May."
    for i in range(40)
]
CONTEXTS = ["Report 3: the harbour authority in Port", "the council said pier", "The"]


@pytest.fixture(scope="module")
def tiny() -> Any:
    from memlm.encoder import Encoder

    return Encoder.load("tiny-llama", threads=1)


def _settings(tmp_path: Path, name: str, url: str | None) -> Settings:
    """None: the embedded default, a SQLite file in the data directory."""
    return make_settings(tmp_path / name, url, model="tiny-llama", calibrator_sample=1.0)


def _add(sessions: Any, texts: list[str], day: int = 7) -> list[int]:
    with sessions.begin() as s:
        return [
            a.id
            for a in DocumentRepository(s).add_many(
                NewDocument(text=t, published_at=dt.date(2017, 2, day), source="s") for t in texts
            )
        ]


class Service:
    """The API over a writer engine, and a worker stepped by the test."""

    def __init__(self, settings: Settings, encoder: Any) -> None:
        self.settings = settings
        self.engine = open_engine(settings, encoder=encoder)
        self.app = create_app(settings, engine=self.engine, run_worker=False, poll=False)
        self.client = TestClient(self.app)
        self.client.__enter__()
        self.sessions = self.app.state.memlm.sessions
        self.worker = IngestWorker(
            self.engine, self.sessions, settings, policy_factory=policy_factory
        )
        self.worker.start(timeout=5)

    def drain(self) -> int:
        n = 0
        while self.worker.step() is not None:
            n += 1
        return n

    def answers(self) -> list[Any]:
        """/predict of every context, with neighbours and their provenance."""
        return [
            self.client.post("/predict", json={"context": c, "neighbours": 8}).json()
            for c in CONTEXTS
        ]

    def close(self) -> None:
        self.worker.lock.release()
        self.client.__exit__(None, None, None)


@pytest.fixture
def empty_pg_schema() -> Iterator[str]:
    """A second empty PostgreSQL schema (``pg_schema_url`` gives one per test)."""
    import uuid

    from sqlalchemy import create_engine, text

    from tests.conftest import PG_SERVER

    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_SERVER)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield f"{PG_SERVER}?options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def services() -> Iterator[list[Service]]:
    opened: list[Service] = []
    yield opened
    for s in opened:
        s.close()


def _check_consistent(settings: Settings, sessions: Any) -> tuple[int, int]:
    """Database and datastore agree: each committed document owns exactly its entries,
    no entry lacks its committed document, and the live entries are the stored tokens of
    the documents not forgotten. Returns (documents done, live entries)."""
    with sessions() as s:
        docs = s.scalars(select(Document)).all()
    with Datastore.open(settings.datastore_dir / "datastore", readonly=True) as ds:
        owners = np.full(len(ds), -1, np.int64)
        for d in docs:
            if d.status in ("done", "forgetting", "forgotten") and d.entry_end is not None:
                assert d.entry_start is not None
                owners[d.entry_start : d.entry_end] = d.id
        assert (owners >= 0).all(), "entries without their committed document"
        doc_ids, _, _ = ds.provenance(np.arange(len(ds)))
        assert (doc_ids == owners).all()
        done = [d for d in docs if d.status == "done"]
        assert ds.num_live == sum(d.tokens_stored or 0 for d in done)
        return len(done), ds.num_live


def _fill(svc: Service) -> list[int]:
    """Documents done, one index version built, one forgotten, two more after the build
    (the served fresh part)."""
    ids = _add(svc.sessions, TEXTS[:5])
    svc.client.post("/admin/rebuild", headers=ADMIN)
    assert svc.drain() == 6
    ids += _add(svc.sessions, TEXTS[5:7], day=8)
    assert svc.client.delete(f"/admin/documents/{ids[1]}", headers=ADMIN).status_code == 202
    assert svc.drain() == 3
    return ids


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("sqlite", "sqlite"),
        pytest.param("pg", "pg", marks=pytest.mark.postgres),
        pytest.param("sqlite", "pg", marks=pytest.mark.postgres),
    ],
)
def test_a_restored_service_answers_predict_exactly_as_before(
    tmp_path: Path,
    tiny: Any,
    services: list[Service],
    source: str,
    target: str,
    request: pytest.FixtureRequest,
) -> None:
    src_url = request.getfixturevalue("pg_url") if source == "pg" else None
    a = _settings(tmp_path, "a", src_url)
    if src_url is None:
        a.data_dir.mkdir(parents=True)
        upgrade(a.db_url)
    svc = Service(a, tiny)
    services.append(svc)
    ids = _fill(svc)
    before = svc.answers()
    assert before[0]["neighbours"] and before[0]["index_version"] == "1"
    served = {n["document_id"] for b in before for n in b["neighbours"]}
    assert ids[1] not in served  # forgotten

    m = backup(a, tmp_path / "backup")
    assert m.memory["entries"] == len(svc.engine.datastore)
    assert m.memory["index_version"] == 1 and m.tables["documents"] == 7
    assert m.dialect == ("postgresql" if source == "pg" else "sqlite")

    # "another machine": another data directory and another database (SQLite: the
    # embedded default inside the data directory; PostgreSQL: a new, empty schema)
    dst_url = request.getfixturevalue("empty_pg_schema") if target == "pg" else None
    b = _settings(tmp_path, "b", dst_url)
    restore(b, tmp_path / "backup")
    restored = Service(b, tiny)
    services.append(restored)
    assert restored.answers() == before
    assert _check_consistent(b, restored.sessions) == _check_consistent(a, svc.sessions)
    with svc.sessions() as s1, restored.sessions() as s2:
        rows = [
            [(d.id, d.status, d.text, d.entry_start, d.entry_end) for d in s.scalars(q)]
            for s in (s1, s2)
            for q in [select(Document).order_by(Document.id)]
        ]
    assert rows[0] == rows[1]
    # the restored service goes on: new documents get new ids and entries after the old
    new = _add(restored.sessions, [TEXTS[20]], day=9)
    assert new == [ids[-1] + 1]
    assert restored.drain() == 1
    _check_consistent(b, restored.sessions)
