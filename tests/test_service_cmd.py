"""`memlm db ...` and the start-up check of `serve`, `worker`, `scheduler` and `rebuild`."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from memlm.cli import app
from memlm.db.migrate import head_revision
from memlm.db.models import IndexBuild


def _run(tmp_path: Path, url: str, *args: str) -> tuple[int, str]:
    env = {"MEMLM_DATA_DIR": str(tmp_path / "data"), "MEMLM_DATABASE_URL": url}
    result = CliRunner().invoke(app, list(args), env=env)
    return result.exit_code, result.output


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'empty.sqlite'}"
    return str(request.getfixturevalue("pg_schema_url"))


@pytest.mark.parametrize(
    "command", [["serve"], ["worker"], ["scheduler"], ["rebuild"], ["compact"]]
)
def test_processes_refuse_an_unmigrated_database_and_name_the_fix(
    tmp_path: Path, empty_url: str, command: list[str]
) -> None:
    code, out = _run(tmp_path, empty_url, *command)
    assert code == 2
    assert f"is at revision none (empty), the code needs {head_revision()}" in out
    assert out.rstrip().endswith("run `memlm db upgrade`")


def test_db_upgrade_current_downgrade(tmp_path: Path, empty_url: str) -> None:
    head = head_revision()
    assert _run(tmp_path, empty_url, "db", "current") == (1, f"current none; head {head}\n")
    assert _run(tmp_path, empty_url, "db", "upgrade") == (0, f"{empty_url}: at head\n")
    assert _run(tmp_path, empty_url, "db", "current") == (0, f"current {head}; head {head}\n")
    assert _run(tmp_path, empty_url, "db", "downgrade", "base") == (0, f"{empty_url}: at base\n")
    assert _run(tmp_path, empty_url, "db", "current") == (1, f"current none; head {head}\n")


@pytest.mark.postgres
def test_messages_mask_the_database_password(tmp_path: Path, pg_schema_url: str) -> None:
    # The local server trusts every connection, so any password gets through.
    url = pg_schema_url.replace("postgres@", "postgres:hunter2@", 1)
    masked = pg_schema_url.replace("postgres@", "postgres:***@", 1)
    assert url != pg_schema_url
    assert _run(tmp_path, url, "worker") == (
        2,
        f"error: database {masked} is at revision none (empty), the code needs "
        f"{head_revision()}: run `memlm db upgrade`\n",
    )
    assert _run(tmp_path, url, "db", "upgrade") == (0, f"{masked}: at head\n")


@pytest.mark.parametrize("command", [["serve"], ["worker"]])
def test_processes_refuse_weak_tokens_outside_development(
    tmp_path: Path, command: list[str]
) -> None:
    """Fails fast, naming the variables, before it opens a database."""
    env = {
        "MEMLM_ENV": "production",
        "MEMLM_DATA_DIR": str(tmp_path / "data"),
        "MEMLM_INGEST_TOKEN": "same-secret-for-both-routes",
        "MEMLM_ADMIN_TOKEN": "same-secret-for-both-routes",
    }
    result = CliRunner().invoke(app, command, env=env)
    assert result.exit_code == 2
    assert "invalid settings" in result.output
    assert "MEMLM_INGEST_TOKEN equals MEMLM_ADMIN_TOKEN" in result.output
    assert not (tmp_path / "data").exists()


def test_compact_removes_forgotten_rows_and_queues_a_build(tmp_path: Path, sqlite_url: str) -> None:
    import numpy as np

    from memlm.datastore import Datastore
    from memlm.db.models import IndexBuild
    from memlm.db.session import make_engine, make_sessionmaker

    store = tmp_path / "data" / "memory" / "datastore"
    ds = Datastore.open(store, dim=4)
    keys = np.arange(40, dtype=np.float16).reshape(10, 4)
    ds.append(keys, np.arange(10), np.repeat([1, 2], 5), np.arange(10), 0)
    ds.delete_document(1)
    ds.close()
    code, out = _run(tmp_path, sqlite_url, "compact")
    assert code == 0, out
    # 5 rows of 8 + 20 bytes leave; the 5 kept rows gain a 4-byte id each
    assert out.startswith(
        "compacted 1 segments: 5 rows of forgotten documents removed, 120 bytes reclaimed "
        "(120 over the store's life)\nbuild request 1 (cli:"
    )
    blob = b"".join(f.read_bytes() for f in store.iterdir())
    assert not any(k.tobytes() in blob for k in keys[:5])
    assert all(k.tobytes() in blob for k in keys[5:])
    engine = make_engine(sqlite_url)
    with make_sessionmaker(engine)() as s:
        assert [b.requested_by for b in s.query(IndexBuild)] == ["cli"]
    engine.dispose()
    assert _run(tmp_path, sqlite_url, "compact", "--no-build")[1] == (
        "compacted 0 segments: 0 rows of forgotten documents removed, 0 bytes reclaimed "
        "(120 over the store's life)\n"
    )


def test_rebuild_retrain_queues_a_retraining_request(tmp_path: Path, sqlite_url: str) -> None:
    from memlm.db.session import make_engine, make_sessionmaker

    assert _run(tmp_path, sqlite_url, "db", "upgrade")[0] == 0
    code, out = _run(tmp_path, sqlite_url, "rebuild", "--key", "plain")
    assert code == 0 and "new=True" in out
    code, out = _run(tmp_path, sqlite_url, "rebuild", "--key", "forced", "--retrain")
    assert code == 0 and "new=True" in out
    with make_sessionmaker(make_engine(sqlite_url))() as s:
        rows = {r.request_key: r for r in s.query(IndexBuild).all()}
    assert rows["plain"].params == {} and rows["forced"].params == {"retrain": True}
