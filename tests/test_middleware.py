"""The ASGI middleware: behind a real uvicorn server a 500 leaves the connection usable; a
request refused a slot is answered before its body is read."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.executor import REQUEST
from tests.fakes import FakeEngine
from tests.service_helpers import make_settings, serve


def _by_name(name: str, delta: float | None, params: dict[str, Any]) -> str:
    return name


@pytest.fixture
def server(tmp_path: Path, sqlite_url: str) -> Iterator[tuple[str, FakeEngine]]:
    """The app over the fake engine, served by uvicorn on 127.0.0.1 from a thread."""
    engine = FakeEngine()
    settings = make_settings(tmp_path, sqlite_url)
    app = create_app(settings, engine=engine, policy_factory=_by_name, run_worker=False, poll=False)
    with serve(app, timeout_keep_alive=30, start_timeout=20) as url:
        yield url, engine


def _local_port(r: httpx.Response) -> int:
    """The client-side port of the TCP connection that carried ``r``."""
    stream = r.extensions["network_stream"]
    return int(stream.get_extra_info("client_addr")[1])


def test_a_500_keeps_the_keep_alive_connection(
    server: tuple[str, FakeEngine],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before CatchAll, Starlette re-raised after its 500 and uvicorn closed the socket."""
    url, engine = server

    def boom(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("secret path /etc/shadow")

    monkeypatch.setattr(engine, "score", boom)
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    with caplog.at_level(logging.ERROR), httpx.Client(base_url=url, limits=limits) as client:
        first = client.get("/healthz")
        r = client.post("/score", json={"text": "a b"})
        assert r.status_code == 500
        assert r.json() == {"error": "internal_error", "detail": "internal server error"}
        assert r.headers.get("connection") != "close"
        after = client.get("/healthz")
        assert after.status_code == 200
        # one TCP connection carried all three requests
        assert _local_port(first) == _local_port(r) == _local_port(after)
    logged = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert [rec.getMessage() for rec in logged] == ["unhandled error on POST /score"]
    assert "Exception in ASGI application" not in caplog.text


def test_a_refused_request_is_answered_before_its_body_is_read(
    tmp_path: Path, sqlite_url: str
) -> None:
    """RequestSlots runs outside BodyGuard: a 429 for want of a slot reads no body (it used
    to run inside, after BodyGuard had read up to MEMLM_MAX_BODY_BYTES)."""
    settings = make_settings(tmp_path, sqlite_url, queue_budget_s=2.0, overload_delay_seconds=0)
    app = create_app(settings, engine=FakeEngine(), run_worker=False, poll=False)
    body = b'{"context": "the cat"}'
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/predict",
        "raw_path": b"/predict",
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"testserver"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
    }

    def call() -> tuple[int, list[int]]:
        """(the response status, the size of each body chunk the app received)."""
        reads: list[int] = []
        status: list[int] = []

        async def receive() -> dict[str, Any]:
            reads.append(len(body))
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])

        portal: Any = client.portal  # the app's event loop, started by the TestClient
        portal.call(app, dict(scope), receive, send)
        return status[0], reads

    with TestClient(app) as client:
        ex = app.state.memlm.executor
        ex.observe(REQUEST, 1, 1.5)  # 1.5 s a request: a second in flight is over 2 s
        ex.enter_request()
        try:
            assert call() == (429, [])
        finally:
            ex.leave_request(served=False)
        assert call() == (200, [len(body)])  # a slot is free: the body is read once
