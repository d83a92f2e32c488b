"""Shared, generic fixtures: migrated databases (SQLite and PostgreSQL) and settings."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session, sessionmaker

PG_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/test"

# Tests run the encoder in float32, and so do the worker and API processes they start
# (they inherit this). MEMLM_PRECISION=auto would probe: seconds per process, and on a
# processor with fast bfloat16 it picks bfloat16, whose keys a test's float32 engine then
# refuses (KeyPrecisionMismatch). Tests of the probe and the default delete it or pass
# precision= themselves.
os.environ.setdefault("MEMLM_PRECISION", "float32")

# the real Milvus server (session-scoped; skips with its reason where it cannot start)
from tests.milvus_fixtures import (  # noqa: E402
    milvus_server,  # noqa: F401
    milvus_url,  # noqa: F401
    start_shared_server,
)

# one live `memlm up` for the OpenAI-compatible API's clients (session-scoped)
from tests.openai_fixtures import memlm_up  # noqa: E402,F401


def pytest_configure(config: pytest.Config) -> None:
    # a parallel run (make test: pytest -n) shares one Milvus server: one start (15-30 s)
    # and one server's memory instead of one per worker
    config.stash[_SHARED_MILVUS] = start_shared_server(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    server = config.stash.get(_SHARED_MILVUS, None)
    if server is not None:
        server.stop()


_SHARED_MILVUS = pytest.StashKey[Any]()


@pytest.fixture(scope="session")
def _migrated_sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from memlm.db.migrate import upgrade

    path = tmp_path_factory.mktemp("db-template") / "memlm.sqlite"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture
def sqlite_url(tmp_path: Path, _migrated_sqlite_template: Path) -> str:
    """A SQLite database at the migration head, private to the test (a copied file)."""
    path = tmp_path / "memlm.sqlite"
    shutil.copy(_migrated_sqlite_template, path)
    return f"sqlite:///{path}"


def _pg_reachable() -> str | None:
    try:
        eng = create_engine(PG_SERVER, connect_args={"connect_timeout": 3})
        with eng.connect() as conn:
            conn.execute(text("select 1"))
        eng.dispose()
    except Exception as exc:  # noqa: BLE001 - any failure means "not reachable"
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


@pytest.fixture
def pg_schema_url() -> Iterator[str]:
    """An empty PostgreSQL schema of its own (dropped afterwards), as a URL whose
    connections use it as search_path; skips when the server cannot be reached."""
    reason = _pg_reachable()
    if reason is not None:
        pytest.skip(f"PostgreSQL at 127.0.0.1:5432/test unreachable ({reason})")
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
def pg_url(pg_schema_url: str) -> str:
    """A private PostgreSQL schema at the migration head."""
    from memlm.db.migrate import upgrade

    upgrade(pg_schema_url)
    return pg_schema_url


@pytest.fixture
def make_sessions() -> Iterator[Callable[[str], sessionmaker[Session]]]:
    """A session factory per URL; their engines are disposed after the test."""
    from memlm.db.session import make_engine, make_sessionmaker

    engines: list[Engine] = []

    def make(url: str) -> sessionmaker[Session]:
        engines.append(make_engine(url))
        return make_sessionmaker(engines[-1])

    yield make
    for e in engines:
        e.dispose()
