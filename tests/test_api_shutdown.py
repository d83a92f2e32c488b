"""Shutdown with a busy embedded worker: the API waits MEMLM_SHUTDOWN_SECONDS, no longer."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from tests.fakes import FakeEngine
from tests.service_helpers import make_settings


def _app_with_a_busy_worker(
    tmp_path: Path, sqlite_url: str, shutdown_seconds: float
) -> tuple[Any, threading.Event, list[threading.Thread]]:
    """The app with a worker thread that ignores the stop event until ``release`` is set
    (a long document); ``started`` gets that thread once the app is up."""
    release, started = threading.Event(), []

    def start(engine: Any, sessions: Any, stop: threading.Event) -> threading.Thread:
        t = threading.Thread(target=release.wait, daemon=True, name="busy-worker")
        t.start()
        started.append(t)
        return t

    settings = make_settings(tmp_path, sqlite_url, shutdown_seconds=shutdown_seconds)
    return create_app(settings, engine=FakeEngine(), worker=start, poll=False), release, started


def test_shutdown_abandons_a_worker_busy_past_the_limit(
    tmp_path: Path, sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    app, release, started = _app_with_a_busy_worker(tmp_path, sqlite_url, 0.2)
    try:
        with caplog.at_level(logging.WARNING, logger="service.app"), TestClient(app) as c:
            assert c.get("/healthz").status_code == 200
        # the lifespan returned while the worker still held its document
        assert started and started[0].is_alive()
        assert "still busy after MEMLM_SHUTDOWN_SECONDS=0.2 s" in caplog.text
    finally:
        release.set()


def test_shutdown_waits_for_a_worker_that_finishes_in_time(
    tmp_path: Path, sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    app, release, started = _app_with_a_busy_worker(tmp_path, sqlite_url, 60)
    with caplog.at_level(logging.WARNING, logger="service.app"), TestClient(app) as c:
        assert c.get("/healthz").status_code == 200
        threading.Timer(0.3, release.set).start()  # the document ends during the shutdown
    assert not started[0].is_alive()
    assert "still busy" not in caplog.text
