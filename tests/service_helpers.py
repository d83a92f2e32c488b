"""Helpers shared by the API and worker tests (not fixtures: plain functions)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memlm.settings import Settings

INGEST = {"Authorization": "Bearer ingest-secret-for-tests"}
ADMIN = {"Authorization": "Bearer admin-secret-for-tests"}
READ = {"Authorization": "Bearer read-secret-for-tests"}


def make_settings(tmp_path: Path, db_url: str, **over: Any) -> Settings:
    base: dict[str, Any] = {
        "env": "test",
        "data_dir": tmp_path / "data",
        "database_url": db_url,
        "ingest_token": "ingest-secret-for-tests",
        "admin_token": "admin-secret-for-tests",
        "read_token": "read-secret-for-tests",
        # Reads open, as most tests are about something else: outside development, open
        # reads answer snippets only to a token (READ); tests of protection set None/True.
        "protect_read": False,
        "worker_poll_seconds": 0.05,
        "index_poll_seconds": 3600,
    }
    base.update(over)
    return Settings(_env_file=None, **base)  # type: ignore[call-arg]


def doc(text: str, day: str = "2017-02-07", source: str = "test", **kw: Any) -> dict[str, Any]:
    return {"text": text, "published_at": day, "source": source, **kw}
