"""The dashboard in a real browser: Debian's chromium driven by playwright (which never
downloads a browser here: ``executable_path`` names the system one).

Skips, saying why, when playwright or chromium is missing (scripts/install.sh installs
chromium where apt-get works). Every wait is bounded (TIMEOUT_MS), so a page that never
draws fails in seconds instead of hanging CI.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from memlm.db.models import Document, IndexBuild
from service.app import create_app
from service.dashboard.auth import COOKIE
from tests.fakes import FakeEngine
from tests.service_helpers import ADMIN, INGEST, doc, make_settings, serve
from workers.ingest import IngestWorker

pytestmark = pytest.mark.browser

sync_api = pytest.importorskip(
    "playwright.sync_api",
    reason="playwright is not installed (pip install -e '.[dev]'): browser tests skipped",
)
CHROMIUM = os.environ.get("MEMLM_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip(
        f"no chromium at {CHROMIUM} (Debian: apt-get install chromium, which "
        "scripts/install.sh tries; or set MEMLM_CHROMIUM): browser tests skipped",
        allow_module_level=True,
    )

TIMEOUT_MS = 20_000
ADMIN_TOKEN = ADMIN["Authorization"].split()[1]
TEXTS = [  # three stream days; the one-word text fails (the model needs two tokens)
    (
        "The harbour authority in Port Elsinore announced a new ferry timetable on Monday.",
        "2017-02-07",
    ),
    ("Ferry operators said the new timetable would add two crossings every weekday.", "2017-02-07"),
    (
        "The central bank left its key interest rate unchanged and warned about prices.",
        "2017-02-08",
    ),
    ("Port Elsinore's mayor welcomed the ferry timetable and promised a car park.", "2017-02-08"),
    (
        "Heavy snow closed schools in the north of Scotland for a second day on Friday.",
        "2017-02-09",
    ),
    ("Economists expect the central bank to raise interest rates before the summer.", "2017-02-09"),
    ("Hello", "2017-02-09"),
]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage"]
        )
        try:
            yield b
        finally:
            b.close()


class Page:
    """A page in a fresh browser context, with its errors and every URL it asked for."""

    def __init__(self, browser: Any) -> None:
        self.context = browser.new_context(viewport={"width": 1400, "height": 1000})
        self.context.set_default_timeout(TIMEOUT_MS)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.urls: list[str] = []
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.on(
            "console",
            lambda m: self.errors.append(f"console: {m.text}") if m.type == "error" else None,
        )
        self.page.on("request", lambda r: self.urls.append(r.url))

    def login(self, base: str, token: str = ADMIN_TOKEN) -> None:
        self.page.goto(f"{base}/dashboard")
        self.page.fill("#token", token)
        self.page.click("button[type=submit]")
        self.page.wait_for_load_state()

    def wait_until(self, expr: str) -> None:
        """Until ``expr`` is true in the page (polled from here: the page's CSP forbids
        the eval that playwright's own wait_for_function needs)."""
        deadline = time.monotonic() + TIMEOUT_MS / 1000
        while not self.js(expr):
            assert time.monotonic() < deadline, f"timed out waiting for {expr}"
            time.sleep(0.1)

    def wait_drawn(self) -> None:
        """Until dashboard.js has rendered the first data (it stamps the body)."""
        self.wait_until("document.body.dataset.generatedAt !== undefined")

    def js(self, expr: str) -> Any:
        return self.page.evaluate(expr)

    def trace(self, chart: str, i: int, axis: str = "y") -> list[Any]:
        return list(self.js(f"document.getElementById('{chart}').data[{i}].{axis}"))

    def drawn(self, chart: str) -> bool:
        """plotly drew an SVG into the chart's div, and the div is shown."""
        return bool(
            self.page.evaluate(
                "(id) => { const el = document.getElementById(id);"
                " return !el.hidden && el.querySelectorAll('.main-svg').length > 0; }",
                chart,
            )
        )

    def text(self, selector: str) -> str:
        return str(self.page.inner_text(selector))

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Page]:
    p = Page(browser)
    try:
        yield p
    finally:
        p.close()


@contextlib.contextmanager
def server_logs() -> Iterator[list[str]]:
    """Every log line of the server (uvicorn's access and error logs, the app's). Enter it
    after uvicorn started: its logging set-up replaces the handlers of its loggers."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    handler = Keep(level=logging.DEBUG)
    loggers = [logging.getLogger(n) for n in ("", "uvicorn", "uvicorn.access", "uvicorn.error")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield lines
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


def _fresh_service(tmp_path: Path, sqlite_url: str, **over: Any) -> Any:
    settings = make_settings(tmp_path, sqlite_url, **over)
    return create_app(settings, engine=FakeEngine(), run_worker=False, poll=False)


def test_empty_state_is_said_in_words(tmp_path: Path, sqlite_url: str, page: Page) -> None:
    with serve(_fresh_service(tmp_path, sqlite_url)) as base:
        page.login(base)
        page.wait_drawn()
        assert "Nothing ingested yet" in page.text("#banner")
        for chart, words in (
            ("chart-memrate", "Nothing ingested yet"),
            ("chart-heldout", "No held-out perplexity yet"),
            ("chart-memory", "The memory is empty"),
            ("chart-throughput", "No document processed yet"),
            ("chart-queue", "No document yet"),
            ("chart-builds", "No index built yet"),
        ):
            assert not page.drawn(chart), chart
            assert page.page.is_visible(f"#{chart}-empty"), chart
            assert words in page.text(f"#{chart}-empty"), chart
        assert page.text("#failed-empty") == "No failed documents."
        assert page.text("#kpi-memrate") == "–"
        assert page.text("#kpi-entries") == "0"
        assert page.text("#kpi-index") == "none"
        assert page.errors == []


@pytest.fixture(scope="module")
def tiny() -> Any:
    from memlm.encoder import Encoder

    return Encoder.load("tiny-llama", threads=1)


def test_charts_show_the_stream_and_follow_it(
    tmp_path: Path, sqlite_url: str, page: Page, tiny: Any
) -> None:
    """A small stream through the real engine (tiny random Llama): every chart's numbers
    are the database's; a document ingested later shows up without a reload."""
    from memlm.engine import open_engine, policy_factory

    settings = make_settings(
        tmp_path,
        sqlite_url,
        model="tiny-llama",
        knn_k=8,
        knn_temperature=1.0,
        knn_lambda=0.5,
        calibrator_sample=1.0,
        dashboard_refresh_seconds=1,
        memory_budget_entries=1_000_000,  # says how it retires; never binds here
    )
    engine = open_engine(settings, encoder=tiny)
    app = create_app(settings, engine=engine, run_worker=False, poll=False)
    with serve(app) as base:
        sessions = app.state.memlm.sessions
        worker = IngestWorker(engine, sessions, settings, policy_factory=policy_factory)
        worker.start(timeout=5)
        api = httpx.Client(base_url=base, timeout=30)
        try:
            body = [doc(t, day=d, source=f"s{i}") for i, (t, d) in enumerate(TEXTS)]
            assert api.post("/ingest", headers=INGEST, json={"documents": body}).status_code == 202
            while worker.step() is not None:
                pass
            assert api.post("/admin/rebuild", headers=ADMIN).status_code == 202
            while worker.step() is not None:
                pass
            history = api.get("/admin/stats/history", headers=ADMIN).json()

            page.login(base)
            page.wait_drawn()
            page.js("window.__loadedOnce = true")  # gone if the page reloads

            # MemRate per day: the database's documents, day by day, against FullMem's 100%
            with sessions() as s:
                docs = s.scalars(select(Document).where(Document.status == "done")).all()
                builds = s.scalars(select(IndexBuild)).all()
            days: dict[str, list[int]] = {}
            for x in docs:
                acc = days.setdefault(x.published_at.isoformat(), [0, 0])
                acc[0] += x.tokens_seen or 0
                acc[1] += x.tokens_stored or 0
            assert page.drawn("chart-memrate")
            assert (
                page.trace("chart-memrate", 0, "x")
                == sorted(days)
                == [
                    "2017-02-07",
                    "2017-02-08",
                    "2017-02-09",
                ]
            )
            want = [100 * days[d][1] / days[d][0] for d in sorted(days)]
            assert page.trace("chart-memrate", 0) == pytest.approx(want)
            seen = stored = 0
            cumulative = []
            for d in sorted(days):
                seen, stored = seen + days[d][0], stored + days[d][1]
                cumulative.append(100 * stored / seen)
            assert page.trace("chart-memrate", 1) == pytest.approx(cumulative)
            assert page.trace("chart-memrate", 2) == [100, 100, 100]  # FullMem
            bars = page.js("document.querySelectorAll('#chart-memrate .barlayer .point').length")
            assert bars == 3
            assert page.text("#kpi-memrate") == f"{100 * stored / seen:.1f}%"
            assert page.text("#kpi-entries") == f"{engine.stats()['entries']:,}"

            # held-out perplexity per day: what the history computed from the records
            assert page.drawn("chart-heldout")
            h = history["heldout"]["days"]
            assert len(h) == 3
            assert page.trace("chart-heldout", 0) == pytest.approx([d["lm_ppl"] for d in h])
            assert page.trace("chart-heldout", 1) == pytest.approx([d["augmented_ppl"] for d in h])

            # memory size: the build, then now; bytes on the right axis
            assert page.drawn("chart-memory")
            [build] = builds
            assert page.trace("chart-memory", 0) == [build.entries, engine.stats()["entries"]]
            assert page.trace("chart-memory", 1) == [
                build.params["sizes"]["bytes_on_disk"],
                engine.stats()["bytes_on_disk"],
            ]

            # worker speed: every processed token in some bucket
            assert page.drawn("chart-throughput")
            tp = history["throughput"]["points"]
            assert len(page.trace("chart-throughput", 0)) == len(tp)
            width = history["throughput"]["bucket_seconds"]
            total = sum(y * width for y in page.trace("chart-throughput", 0))
            assert total == pytest.approx(sum(x.tokens_seen for x in docs))

            # queue by status, failed documents with their reason
            queue = dict(
                zip(page.trace("chart-queue", 0), page.trace("chart-queue", 0, "x"), strict=True)
            )
            assert queue["done"] == len(docs) == 6 and queue["failed"] == 1
            assert queue["pending"] == 0
            failed = page.text("#failed-table tbody")
            assert "EngineInputError: the text must hold at least two tokens" in failed
            assert "s6" in failed

            # index versions: the build's row, the calibrator's reason for not training
            rows = page.js("document.querySelectorAll('#builds-table tbody tr').length")
            assert rows == 1
            row = page.text("#builds-table tbody tr")
            assert f"v{build.version}" in row and f"{build.entries:,}" in row
            assert f"fewer than the {settings.calibrator_min_tokens} training needs" in row
            assert page.drawn("chart-builds")
            assert "the constant" in page.text("#calibrator")
            budget = "1,000,000 entries, retiring by spread, every day alike"
            assert budget in page.text("#calibrator")
            assert "(budget 1,000,000, spread, every day alike)" in row

            # a new day arrives: the page redraws by itself (no reload)
            more = [
                doc("Rain is expected across the south of England on Tuesday.", day="2017-02-10")
            ]
            assert api.post("/ingest", headers=INGEST, json={"documents": more}).status_code == 202
            while worker.step() is not None:
                pass
            page.wait_until("document.getElementById('chart-memrate').data[0].x.length === 4")
            assert page.js("window.__loadedOnce") is True
            assert page.trace("chart-memrate", 0, "x")[-1] == "2017-02-10"
            assert page.errors == []
        finally:
            api.close()
            worker.lock.release()


def test_login_keeps_the_token_out_of_urls_storage_and_logs(
    tmp_path: Path, sqlite_url: str, page: Page
) -> None:
    app = _fresh_service(tmp_path, sqlite_url, dashboard_refresh_seconds=1)
    with serve(app, log_level="info") as base, server_logs() as logs:
        page.login(base, "wrong-token-for-this-test")
        assert "That is not the admin token." in page.text("#login-error")
        assert page.page.is_visible("#token")
        # the browser reports the 401 of the refused form, and nothing else
        assert [e for e in page.errors if "401" not in e] == []
        page.errors.clear()

        page.login(base)
        page.wait_drawn()
        assert page.page.url == f"{base}/dashboard"
        # a poll or two with the cookie
        first = page.js("document.body.dataset.generatedAt")
        page.wait_until(f"document.body.dataset.generatedAt !== '{first}'")

        [cookie] = page.context.cookies()
        assert cookie["name"] == COOKIE and cookie["httpOnly"] is True
        assert cookie["sameSite"] == "Strict" and cookie["path"] == "/"
        assert ADMIN_TOKEN not in cookie["value"]
        assert page.js("document.cookie") == ""  # HttpOnly: scripts cannot read it
        storage = page.js("JSON.stringify([localStorage, sessionStorage])")
        assert ADMIN_TOKEN not in storage
        assert ADMIN_TOKEN not in page.page.content()
        assert page.urls and not [u for u in page.urls if ADMIN_TOKEN in u]
        assert any("/admin/stats/history" in u for u in page.urls)

        # the cookie opens the dashboard's data, not the admin API
        assert page.page.request.get(f"{base}/admin/stats/history").status == 200
        assert page.page.request.get(f"{base}/admin/stats").status == 401
        assert page.page.request.post(f"{base}/admin/rebuild").status == 401

        page.page.click("text=Log out")
        page.page.wait_for_selector("#token")
        assert page.context.cookies() == []
        assert page.errors == []
    access = [line for line in logs if "/dashboard" in line or "/admin/stats/history" in line]
    assert access, "the access log was not captured"
    assert "dashboard login refused" in "\n".join(logs)
    assert not [line for line in logs if ADMIN_TOKEN in line]
