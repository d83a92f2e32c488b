"""`memlm db ...` and the start-up check of `serve`, `worker`, `scheduler` and `rebuild`."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from memlm.cli import app
from memlm.db.migrate import head_revision


def _run(tmp_path: Path, url: str, *args: str) -> tuple[int, str]:
    env = {"MEMLM_DATA_DIR": str(tmp_path / "data"), "MEMLM_DATABASE_URL": url}
    result = CliRunner().invoke(app, list(args), env=env)
    return result.exit_code, result.output


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'empty.sqlite'}"
    return str(request.getfixturevalue("pg_schema_url"))


@pytest.mark.parametrize("command", [["serve"], ["worker"], ["scheduler"], ["rebuild"]])
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
