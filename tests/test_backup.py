"""Backup and restore (issue 31): a consistent snapshot of a running service, taken while
a worker ingests; restored into an empty data directory and database (SQLite and
PostgreSQL), after which /predict answers exactly as before; non-empty targets and
damaged backups refused."""

from __future__ import annotations

import datetime as dt
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


def _settings(tmp_path: Path, name: str, url: str | None, memory: str | None = None) -> Settings:
    """None: the embedded default, a SQLite file in the data directory."""
    return make_settings(
        tmp_path / name,
        "",
        database_url=url,
        memory_url=memory,
        model="tiny-llama",
        calibrator_sample=1.0,
        # every token stored: the counts below do not depend on what MoNIM finds already
        # known (the templated texts are near copies of each other)
        policy="fullmem",
    )


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
        self.engine: Any = open_engine(settings, encoder=encoder)
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
            self.client.post("/predict", headers=ADMIN, json={"context": c, "neighbours": 8}).json()
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
    assert m.memory["entries"] == len(svc.engine.memory.datastore)
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


def test_backup_waits_for_an_append_to_commit(
    tmp_path: Path, sqlite_url: str, tiny: Any, services: list[Service]
) -> None:
    """A worker that appends while the backup holds its moment waits for the moment to
    end: the backup has neither its entries nor its commit. Without the lock the commit
    lands between the datastore's manifest and the database snapshot, and the backup holds
    a document marked done whose entries it lacks (refused as not the database's)."""
    a = _settings(tmp_path, "a", sqlite_url)
    svc = Service(a, tiny)
    services.append(svc)
    _add(svc.sessions, TEXTS[:2])
    assert svc.drain() == 2
    [late] = _add(svc.sessions, [TEXTS[2]])
    worker = threading.Thread(target=svc.worker.step)
    blocked: list[bool] = []

    def while_paused() -> None:
        worker.start()
        worker.join(timeout=3.0)  # the document is encoded in ~0.2 s, then it appends
        blocked.append(worker.is_alive())

    m = backup(a, tmp_path / "backup", while_paused=while_paused)
    worker.join(timeout=30)
    assert blocked == [True]
    with svc.sessions() as s:
        assert s.get(Document, late).status == "done"  # after the moment
    assert m.memory["entries"] == 2 * 33 and m.tables["documents"] == 3
    b = _settings(tmp_path, "b", None)
    restore(b, tmp_path / "backup")
    restored = Service(b, tiny)  # its worker's start puts the claim back in the queue
    services.append(restored)
    assert _check_consistent(b, restored.sessions) == (2, 66)
    with restored.sessions() as s:
        assert s.get(Document, late).status == "pending"
    assert restored.drain() == 1
    assert _check_consistent(b, restored.sessions) == (3, 99)


@pytest.mark.parametrize("db", ["sqlite", pytest.param("pg", marks=pytest.mark.postgres)])
def test_backups_taken_while_a_worker_ingests_are_consistent(
    tmp_path: Path,
    tiny: Any,
    services: list[Service],
    db: str,
    request: pytest.FixtureRequest,
    make_sessions: Any,
) -> None:
    """Backups every 0.3 s while the worker loop memorises 40 documents: each restores into
    a data directory and database that agree, and ingest paused milliseconds for each."""
    a = _settings(tmp_path, "a", request.getfixturevalue("pg_url" if db == "pg" else "sqlite_url"))
    svc = Service(a, tiny)
    services.append(svc)
    _add(svc.sessions, TEXTS)
    stop = threading.Event()
    loop = threading.Thread(target=svc.worker.run, args=(stop,))
    loop.start()
    taken: list[BackupManifest] = []
    try:
        while True:
            with svc.sessions() as s:
                left = DocumentRepository(s).pending_count()
            if left == 0 or len(taken) == 12:
                break
            taken.append(backup(a, tmp_path / f"backup-{len(taken)}"))
            time.sleep(0.3)
    finally:
        stop.set()
        loop.join(timeout=60)
    done_counts = []
    for i, m in enumerate(taken):
        b = _settings(tmp_path, f"r{i}", None)
        restore(b, tmp_path / f"backup-{i}")
        sessions = make_sessions(b.db_url)
        done, live = _check_consistent(b, sessions)
        assert live == m.memory["live_entries"] == m.memory["entries"]
        done_counts.append(done)
    mid = [n for n in done_counts if 0 < n < len(TEXTS)]
    assert len(mid) >= 2, done_counts  # taken while the worker was half way
    paused = sorted(m.paused_ingest_seconds for m in taken)
    print(f"\n[backup] ingest paused (s): {[round(p, 4) for p in paused]}")
    assert paused[-1] < 1.0


def test_entries_of_an_uncommitted_append_are_cut_from_the_backup(
    tmp_path: Path, sqlite_url: str, tiny: Any, services: list[Service]
) -> None:
    """A worker killed between its append and its commit leaves entries no committed
    document owns; the backup holds the committed prefix only."""
    a = _settings(tmp_path, "a", sqlite_url)
    svc = Service(a, tiny)
    services.append(svc)
    _add(svc.sessions, TEXTS[:3])
    svc.worker.step()
    with pytest.raises(SimulatedCrash):
        svc.worker.step(crash_at="after_append")
    assert len(svc.engine.memory.datastore) == 66  # the second document's entries, uncommitted
    m = backup(a, tmp_path / "backup")
    assert m.memory["entries"] == m.memory["live_entries"] == 33
    b = _settings(tmp_path, "b", None)
    restore(b, tmp_path / "backup")
    restored = Service(b, tiny)
    services.append(restored)
    assert _check_consistent(b, restored.sessions) == (1, 33)
    assert restored.drain() == 2
    assert _check_consistent(b, restored.sessions) == (3, 99)


def _small_backup(tmp_path: Path, tiny: Any, services: list[Service]) -> Settings:
    a = _settings(tmp_path, "a", None)
    a.data_dir.mkdir(parents=True)
    upgrade(a.db_url)
    svc = Service(a, tiny)
    services.append(svc)
    _add(svc.sessions, TEXTS[:2])
    assert svc.drain() == 2
    backup(a, tmp_path / "backup")
    return a


def test_backup_and_restore_refuse_non_empty_targets(
    tmp_path: Path, tiny: Any, services: list[Service], sqlite_url: str, make_sessions: Any
) -> None:
    a = _small_backup(tmp_path, tiny, services)
    with pytest.raises(TargetNotEmpty, match="backup destination .* is not empty"):
        backup(a, tmp_path / "backup")
    assert (tmp_path / "backup" / "backup.json").is_file()

    # a data directory holding anything (here: another service's) is refused, untouched
    with pytest.raises(TargetNotEmpty, match="data directory .* is not empty"):
        restore(a, tmp_path / "backup")
    # a database holding rows is refused; nothing is written into the data directory
    b = _settings(tmp_path, "b", sqlite_url)
    with make_sessions(sqlite_url).begin() as s:
        DocumentRepository(s).add_many([NewDocument("x y z", dt.date(2017, 1, 1), "s")])
    with pytest.raises(TargetNotEmpty, match="table documents holds rows"):
        restore(b, tmp_path / "backup")
    assert not b.data_dir.exists()


@pytest.mark.postgres
def test_restore_into_postgresql_refuses_rows_and_takes_a_migrated_empty_schema(
    tmp_path: Path,
    tiny: Any,
    services: list[Service],
    pg_url: str,
    empty_pg_schema: str,
    make_sessions: Any,
) -> None:
    _small_backup(tmp_path, tiny, services)
    full = _settings(tmp_path, "full", empty_pg_schema)
    upgrade(empty_pg_schema)
    with make_sessions(empty_pg_schema).begin() as s:
        DocumentRepository(s).add_many([NewDocument("x y z", dt.date(2017, 1, 1), "s")])
    with pytest.raises(TargetNotEmpty, match="table documents holds rows"):
        restore(full, tmp_path / "backup")
    b = _settings(tmp_path, "b", pg_url)  # at the head, no rows: as `memlm db upgrade` leaves it
    restore(b, tmp_path / "backup")
    assert _check_consistent(b, make_sessions(pg_url)) == (2, 66)


def test_a_damaged_backup_is_refused_and_leaves_the_target_empty(
    tmp_path: Path, tiny: Any, services: list[Service], make_sessions: Any
) -> None:
    _small_backup(tmp_path, tiny, services)
    keys = tmp_path / "backup" / "data" / "memory" / "datastore" / "seg-000000.keys"
    good = keys.read_bytes()
    keys.write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])
    b = _settings(tmp_path, "b", None)
    with pytest.raises(BackupCorrupt, match="seg-000000.keys: .* the backup is damaged"):
        restore(b, tmp_path / "backup")
    # only the (empty) database the restore created is left; a good backup then restores
    assert sorted(p.name for p in b.data_dir.iterdir()) == ["memlm.sqlite"]
    keys.write_bytes(good)
    restore(b, tmp_path / "backup")
    assert _check_consistent(b, make_sessions(b.db_url)) == (2, 66)
    (tmp_path / "backup" / "db" / "documents.jsonl.gz").unlink()
    with pytest.raises(BackupCorrupt, match="1 files of the backup are missing"):
        restore(_settings(tmp_path, "c", None), tmp_path / "backup")
    (tmp_path / "backup" / "backup.json").unlink()
    with pytest.raises(BackupError, match="not a memlm backup: it has no backup.json"):
        restore(_settings(tmp_path, "c", None), tmp_path / "backup")


def test_the_commands(tmp_path: Path, tiny: Any, services: list[Service]) -> None:
    from memlm.cli import app

    a = _small_backup(tmp_path, tiny, services)
    b = _settings(tmp_path, "b", None)
    env = {"MEMLM_DATA_DIR": str(b.data_dir), "MEMLM_ENV": "development"}
    runner = CliRunner()
    out = runner.invoke(app, ["restore", str(tmp_path / "backup")], env=env)
    assert out.exit_code == 0, out.output
    assert "restored 2 documents and 66 datastore entries" in out.output
    again = runner.invoke(app, ["restore", str(tmp_path / "backup")], env=env)
    assert again.exit_code == 1
    assert "error: the data directory" in again.output and "is not empty" in again.output
    env = {"MEMLM_DATA_DIR": str(a.data_dir), "MEMLM_ENV": "development"}
    out = runner.invoke(app, ["backup", str(tmp_path / "second")], env=env)
    assert out.exit_code == 0, out.output
    assert "backup of 2 documents and 66 datastore entries" in out.output
    assert json.loads((tmp_path / "second" / "backup.json").read_text())["tables"] == {
        "day_stats": 1,
        "documents": 2,
        "document_spans": 2,
        "index_builds": 0,
        "policy_settings": 1,
    }


@pytest.fixture
def second_collection(milvus_url: str) -> Iterator[str]:
    """Another collection on the same server (``milvus_url`` gives one per test)."""
    import uuid

    base, _, query = milvus_url.partition("?")
    name = f"t_{uuid.uuid4().hex[:12]}"
    url = f"{base.rsplit('/', 1)[0]}/{name}?{query}"
    yield url
    from memlm.memory import open_milvus

    mem = open_milvus(url, 32)  # created if a failed test never made it: dropped either way
    mem.drop()
    mem.close()


@pytest.mark.milvus
def test_a_milvus_memory_is_exported_and_restored_into_a_new_collection(
    tmp_path: Path,
    tiny: Any,
    services: list[Service],
    sqlite_url: str,
    milvus_url: str,
    second_collection: str,
) -> None:
    """On Milvus the backup exports the entries of the documents done (float32 keys, as
    the collection holds them) and copies the recorded builds' records (the interpolation
    chosen beside each); restore upserts the entries into a new, empty collection, and
    /predict answers as before, from the same version."""
    a = _settings(tmp_path, "a", sqlite_url, milvus_url)
    svc = Service(a, tiny)
    services.append(svc)
    ids = _add(svc.sessions, TEXTS[:4])
    assert svc.drain() == 4
    svc.client.post("/admin/rebuild", headers=ADMIN)
    assert svc.drain() == 1
    assert svc.engine.served_version == 1
    before = svc.answers()
    assert {n["document_id"] for n in before[0]["neighbours"]} <= set(ids)
    assert before[0]["neighbours"]

    m = backup(a, tmp_path / "backup")
    stored = svc.engine.memory.count()
    assert m.memory == {
        "backend": "milvus",
        "entries": stored,
        "live_entries": stored,
        "documents": 4,
        "dim": 32,
        "collection": milvus_url.split("?")[0].rsplit("/", 1)[1],
        "index_version": 1,
    }
    assert sorted(r for r in m.files if r.startswith("milvus/")) == ["milvus/part-000000.npz"]
    assert {"data/memory/index/CURRENT", "data/memory/index/v000001/meta.json"} <= set(m.files)

    # the source collection is not empty: refused
    full = _settings(tmp_path, "full", None, milvus_url)
    with pytest.raises(TargetNotEmpty, match=f"holds {stored} entries"):
        restore(full, tmp_path / "backup")
    # a faiss target for a Milvus backup: refused with the setting to change
    with pytest.raises(BackupError, match="set MEMLM_MEMORY_URL to a new"):
        restore(_settings(tmp_path, "faiss", None), tmp_path / "backup")

    b = _settings(tmp_path, "b", None, second_collection)
    restore(b, tmp_path / "backup")
    restored = Service(b, tiny)
    services.append(restored)
    assert restored.engine.memory.count() == stored
    assert restored.engine.served_version == 1
    assert restored.engine.stats()["interpolation"] == svc.engine.stats()["interpolation"]
    assert restored.answers() == before


@pytest.mark.slow
def test_bundled_smollm2_answers_exactly_as_before_after_a_restore(
    tmp_path: Path, services: list[Service], sqlite_url: str
) -> None:
    """The real model: MoNIM stores only its surprising tokens, a build serves them; the
    restored service answers every context exactly as the original."""
    from memlm.encoder import Encoder

    smol = Encoder.load("smollm2-135m", threads=1)
    a = make_settings(tmp_path / "a", sqlite_url, model="smollm2-135m")
    svc = Service(a, smol)
    services.append(svc)
    _add(svc.sessions, TEXTS[:3])
    svc.client.post("/admin/rebuild", headers=ADMIN)
    assert svc.drain() == 4
    _add(svc.sessions, [TEXTS[3]], day=8)
    assert svc.drain() == 1
    before = svc.answers()
    assert 0 < svc.engine.memory.count() < 4 * 33  # MoNIM stored some tokens, not all
    backup(a, tmp_path / "backup")
    b = make_settings(tmp_path / "b", "", database_url=None, model="smollm2-135m")
    restore(b, tmp_path / "backup")
    restored = Service(b, smol)
    services.append(restored)
    assert restored.answers() == before


def test_a_backup_waits_for_a_running_build_and_says_so(
    tmp_path: Path, tiny: Any, services: list[Service]
) -> None:
    """A build holds build.lock for its whole run: the backup waits up to ``wait`` (the
    index versions and the calibrator's files change under a build), then says why."""
    from memlm.locks import FileLock

    a = _small_backup(tmp_path, tiny, services)
    build = FileLock(a.datastore_dir / "build.lock")
    build.acquire(timeout=0)
    try:
        with pytest.raises(
            BackupError, match=r"an index build held .*build.lock for more than 0.2 s"
        ):
            backup(a, tmp_path / "second", wait=0.2)
    finally:
        build.release()
    backup(a, tmp_path / "second", wait=0.2)
