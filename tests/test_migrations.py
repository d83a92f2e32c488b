"""Every migration up and down on SQLite and PostgreSQL; models and migrations agree."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text

from memlm.db.errors import DatabaseNotMigrated
from memlm.db.migrate import (
    SCRIPT_LOCATION,
    alembic_config,
    check_migrated,
    current_revision,
    downgrade,
    head_revision,
    upgrade,
)
from memlm.db.models import Base
from memlm.db.session import make_engine

TABLES = {"documents", "document_spans", "day_stats", "index_builds", "policy_settings"}


def _revisions() -> list[str]:
    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    return [r.revision for r in reversed(list(script.walk_revisions()))]


def _tables(url: str) -> set[str]:
    eng = make_engine(url)
    try:
        return set(inspect(eng).get_table_names()) - {"alembic_version"}
    finally:
        eng.dispose()


def _every_step_up_and_down(url: str) -> None:
    revs = _revisions()
    assert revs[0] == "0001" and revs[-1] == head_revision()
    eng = make_engine(url)
    with pytest.raises(DatabaseNotMigrated, match="none \\(empty\\).*memlm db upgrade"):
        check_migrated(eng)
    for i, rev in enumerate(revs):
        upgrade(url, rev)
        assert current_revision(eng) == rev
        downgrade(url, revs[i - 1] if i else "base")
        upgrade(url, rev)
    assert _tables(url) == TABLES == set(Base.metadata.tables)
    check_migrated(eng)
    # autogenerate finds nothing to do: the migrations build exactly the models.
    command.check(alembic_config(url))
    downgrade(url, "base")
    assert _tables(url) == set() and current_revision(eng) is None
    eng.dispose()


def test_migrations_sqlite(tmp_path: Path) -> None:
    _every_step_up_and_down(f"sqlite:///{tmp_path / 'm.sqlite'}")


@pytest.mark.postgres
def test_migrations_postgres(pg_schema_url: str) -> None:
    _every_step_up_and_down(pg_schema_url)


def test_constraint_names_follow_the_convention(sqlite_url: str) -> None:
    eng = make_engine(sqlite_url)
    insp = inspect(eng)
    uniques = {u["name"] for u in insp.get_unique_constraints("documents")}
    assert uniques == {"uq_documents_content_hash", "uq_documents_source_external_id"}
    checks = {c["name"] for c in insp.get_check_constraints("documents")}
    assert checks == {"ck_documents_status"}
    eng.dispose()


def test_autogenerate_writes_plain_types_without_importing_the_models(tmp_path: Path) -> None:
    """A new migration must not depend on memlm code: UTCDateTime renders as sa.DateTime."""
    scripts = tmp_path / "migrations"
    shutil.copytree(SCRIPT_LOCATION, scripts, ignore=shutil.ignore_patterns("__pycache__"))
    for old in (scripts / "versions").glob("*.py"):
        old.unlink()  # an empty history: autogenerate writes every table
    cfg = alembic_config(f"sqlite:///{tmp_path / 'empty.sqlite'}")
    cfg.set_main_option("script_location", str(scripts))
    command.revision(cfg, message="everything", autogenerate=True, rev_id="x1")
    [new] = (scripts / "versions").glob("x1_*.py")
    body = new.read_text()
    assert body.count("sa.DateTime(timezone=True)") == 8  # retry_at joined in 0002
    assert "UTCDateTime" not in body and "memlm" not in body


def test_database_migrated_by_newer_code_is_refused_without_suggesting_upgrade(
    sqlite_url: str,
) -> None:
    eng = make_engine(sqlite_url)
    with eng.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = 'f00d'"))
    with pytest.raises(DatabaseNotMigrated) as err:
        check_migrated(eng)
    head = head_revision()
    assert str(err.value) == (
        f"database {sqlite_url} is at revision f00d, which this code does not know (it "
        f"needs {head}): run the newer memlm, or its `memlm db downgrade {head}`"
    )
    eng.dispose()


def test_alembic_command_line_from_the_checkout(tmp_path: Path) -> None:
    """`alembic upgrade head` at the repository root uses the top-level migrations/."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    assert root / "migrations" == SCRIPT_LOCATION
    url = f"sqlite:///{tmp_path / 'cli.sqlite'}"
    env = {**os.environ, "MEMLM_DATABASE_URL": url}
    out = subprocess.run(
        [sys.executable, "-m", "alembic", "upgrade", "head"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    eng = make_engine(url)
    try:
        assert current_revision(eng) == head_revision()
    finally:
        eng.dispose()
    assert _tables(url) == TABLES
