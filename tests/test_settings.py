"""The one settings object: environment, defaults, and refusals at start-up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from memlm.settings import DEFAULT_SECRET, Settings


def make(**kw: Any) -> Settings:
    return Settings(_env_file=None, **kw)  # type: ignore[call-arg]


def test_defaults_are_the_embedded_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    s = make()
    assert s.env == "development" and s.model == "smollm2-135m" and s.policy == "monim"
    assert s.delta is None and s.rebuild_cron == "0 3 * * *"
    assert s.db_url == f"sqlite:///{tmp_path / 'memlm-data' / 'memlm.sqlite'}"
    assert s.ingest_token.get_secret_value() == DEFAULT_SECRET and s.uses_default_secret()


def test_environment_variables_use_the_prefix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MEMLM_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("MEMLM_DATABASE_URL", "postgresql+psycopg://u@h/db")
    monkeypatch.setenv("MEMLM_THREADS", "1")
    monkeypatch.setenv("MEMLM_ADMIN_TOKEN", "a")
    s = make()
    assert s.data_dir == tmp_path and s.threads == 1
    assert s.db_url == "postgresql+psycopg://u@h/db"
    assert s.admin_token.get_secret_value() == "a"
    assert s.datastore_dir == tmp_path / "memory"


def test_default_secret_refused_outside_development() -> None:
    with pytest.raises(ValidationError, match="MEMLM_ADMIN_TOKEN is the development default"):
        make(env="production", ingest_token="r" * 16)
    with pytest.raises(ValidationError, match="MEMLM_INGEST_TOKEN"):
        make(env="test", admin_token="real")
    ok = make(env="production", ingest_token="i" * 16, admin_token="a" * 16)
    assert not ok.uses_default_secret()


@pytest.mark.parametrize("env", ["test", "production"])
@pytest.mark.parametrize(
    ("ingest", "admin", "needle"),
    [
        ("", "a" * 16, "MEMLM_INGEST_TOKEN is empty"),
        ("i" * 16, " " * 20, "MEMLM_ADMIN_TOKEN is empty"),
        ("i" * 15, "a" * 16, "MEMLM_INGEST_TOKEN has 15 characters; use at least 16"),
        ("i" * 16, "short", "MEMLM_ADMIN_TOKEN has 5 characters; use at least 16"),
        ("s" * 40, "s" * 40, "MEMLM_INGEST_TOKEN equals MEMLM_ADMIN_TOKEN"),
    ],
)
def test_weak_tokens_refused_outside_development(
    env: str, ingest: str, admin: str, needle: str
) -> None:
    with pytest.raises(ValidationError, match=needle):
        make(env=env, ingest_token=ingest, admin_token=admin)
    dev = make(env="development", ingest_token=ingest, admin_token=admin)  # allowed there
    assert dev.admin_token.get_secret_value() == admin


def test_reads_are_protected_outside_development_unless_opened() -> None:
    tokens = {"ingest_token": "i" * 16, "admin_token": "a" * 16}
    assert not make().reads_protected
    assert make(protect_read=True).reads_protected
    for env in ("test", "production"):
        assert make(env=env, **tokens).reads_protected
        assert not make(env=env, protect_read=False, **tokens).reads_protected
    assert make(**tokens).read_tokens() == ["i" * 16, "a" * 16]
    assert make(read_token="r" * 16, **tokens).read_tokens() == ["r" * 16, "i" * 16, "a" * 16]


def test_read_token_is_checked_like_the_others() -> None:
    with pytest.raises(ValidationError, match="MEMLM_READ_TOKEN is the development default"):
        make(
            env="production", ingest_token="i" * 16, admin_token="a" * 16, read_token=DEFAULT_SECRET
        )
    with pytest.raises(ValidationError, match="MEMLM_READ_TOKEN is empty"):
        make(read_token="")
    assert make(read_token=DEFAULT_SECRET).uses_default_secret()  # development: a warning


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("policy", "everything", "unknown policy"),
        ("rebuild_cron", "every night", "5 fields"),
        ("database_url", "mysql://x", "sqlite:// or postgresql"),
        ("queue_size", 0, "greater than or equal to 1"),
        ("knn_lambda", 1.5, "less than or equal to 1"),
        ("calibrator_max_tokens", 512, "must be at least MEMLM_CALIBRATOR_MIN_TOKENS"),
        ("delta", float("nan"), "MEMLM_DELTA: delta must be a finite number in"),
        ("delta", 2.0, "MEMLM_DELTA: delta must be a finite number in"),
        ("max_neighbours", 1001, "less than or equal to 1000"),
    ],
)
def test_bad_values_fail_fast(field: str, value: object, needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        make(**{field: value})


def test_precision_and_device_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEMLM_PRECISION", raising=False)
    monkeypatch.delenv("MEMLM_DEVICE", raising=False)
    s = make()
    assert (s.precision, s.device) == ("auto", "auto")
    s = make(precision="bfloat16", device="cuda:1")
    assert (s.precision, s.device) == ("bfloat16", "cuda:1")
    with pytest.raises(ValidationError):
        make(precision="fp8")
    with pytest.raises(ValidationError):
        make(device="gpu")


def test_worker_liveness_is_a_setting_with_a_default_from_the_deployment() -> None:
    """Workers that share a data directory tell who lives by lock files; workers that
    share only PostgreSQL and a memory server by advisory locks (workers.liveness)."""
    pg = "postgresql+psycopg://u@h/db"
    milvus = "milvus://milvus:19530/memlm"
    assert make().liveness == "file"  # SQLite, the faiss files
    assert make(database_url=pg).liveness == "file"  # one data directory, shared
    assert make(memory_url=milvus).liveness == "file"  # SQLite: one machine anyway
    assert make(database_url=pg, memory_url=milvus).liveness == "database"
    assert make(database_url=pg, worker_liveness="database").liveness == "database"
    assert make(database_url=pg, memory_url=milvus, worker_liveness="file").liveness == "file"
    with pytest.raises(ValidationError, match="WORKER_LIVENESS=database needs a PostgreSQL"):
        make(worker_liveness="database")
    with pytest.raises(ValidationError):
        make(worker_liveness="redis")
