"""``GET /dashboard`` (the page), its login, its static files and ``GET /admin/stats/history``.

The page is rendered here (Jinja2) with the data of its first paint inside it; its script
then polls ``/admin/stats/history`` and redraws in place. The chart code is plotly.js as
shipped inside the ``plotly`` Python package (``plotly/package_data/plotly.min.js``),
served from this process: nothing comes from a CDN, the page works offline.
"""

from __future__ import annotations

import datetime as dt
import logging
import secrets
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.concurrency import run_in_threadpool

from memlm.api.dashboard import DashboardData, HeldOut
from memlm.calibrator.heldout_curves import HeldOutCurves
from service.dashboard import history
from service.dashboard.auth import (
    clear_session,
    is_admin,
    require_dashboard_admin,
    same_origin,
    set_session,
)
from service.deps import Credentials, State
from service.errors import error_responses
from service.state import AppState
from service.stats import read_db, summarise

log = logging.getLogger(__name__)

router = APIRouter()
_templates = Environment(
    loader=PackageLoader("service.dashboard", "templates"),
    autoescape=select_autoescape(default=True),
)
# Everything the page loads comes from here: scripts only from this origin (no inline
# script runs), styles inline too (plotly.js adds its own <style>), no framing.
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'"
)
_PAGE_HEADERS = {
    "Content-Security-Policy": _CSP,
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}
_STATIC = Path(str(resources.files("service.dashboard") / "static"))
_OWN_FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}


def plotly_js() -> Path:
    """plotly.min.js from the installed ``plotly`` package (the chart code, offline)."""
    import plotly

    return Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _curves(state: AppState) -> HeldOutCurves:
    curves = state.cached.get("dashboard_heldout")
    if curves is None:
        curves = state.cached.setdefault("dashboard_heldout", HeldOutCurves())
    return curves


async def collect(state: AppState) -> DashboardData:
    """The dashboard's data: the database, then the engine's figures (if it is loaded)."""
    now = _utcnow()

    def db() -> tuple[dict[str, Any], dict[str, Any]]:
        with state.sessions.begin() as s:
            return read_db(s, state.settings), history.read(s, now)

    stats_db, hist = await run_in_threadpool(db)
    engine = state.engine
    engine_stats = None
    model = "ready"
    if engine is None:
        model = "failed" if state.load_error is not None else "loading"
        why = "failed to load (see the server log)" if model == "failed" else "is still loading"
        heldout = HeldOut(tokens=0, recording=False, note=f"the model {why}", days=[])
        stats = None
    else:
        engine_stats = await state.executor.call(engine.stats)
        version = engine_stats.get("index_version", state.served_version)
        stats = summarise(stats_db, engine_stats, None if version is None else str(version))
        recording = state.settings.calibrator_training
        heldout = await run_in_threadpool(_curves(state).compute, engine, recording)
    return DashboardData(
        generated_at=now,
        refresh_seconds=state.settings.dashboard_refresh_seconds,
        model=model,
        stats=stats,
        days=history.days(hist["day_stats"]),
        memory=history.memory(hist["builds"], engine_stats, now),
        throughput=history.throughput(hist["timing"]),
        queue=history.queue(hist["counts"], hist["waiting_retry"]),
        failed=history.failed(hist["failed_total"], hist["failed"]),
        builds=history.builds(hist["builds"]),
        heldout=heldout,
    )


@router.get(
    "/admin/stats/history",
    tags=["admin"],
    response_model=DashboardData,
    responses=error_responses(401, 429, 503),
    summary="The dashboard's time series and figures",
)
async def stats_history(request: Request, state: State, creds: Credentials) -> DashboardData:
    """MemRate per stream day, memory size per build, worker speed, queue, failures,
    builds and held-out perplexity per day. Admin bearer token, or the dashboard's
    session cookie (this route and ``GET /dashboard`` are the only ones that take it)."""
    require_dashboard_admin(request, state, creds)
    return await collect(state)


def _page(name: str, code: int = 200, **context: Any) -> HTMLResponse:
    html = _templates.get_template(name).render(**context)
    return HTMLResponse(html, status_code=code, headers=_PAGE_HEADERS)


@router.get("/dashboard", include_in_schema=False)
async def dashboard(request: Request, state: State, creds: Credentials) -> Response:
    if not is_admin(request, state, creds):
        return _page("login.html", error=None)
    data = await collect(state)
    return _page("dashboard.html", data=data.model_dump(mode="json", by_alias=True))


async def _form_token(request: Request) -> str | None:
    """The ``token`` field of a urlencoded form (the login form's only field)."""
    if request.headers.get("content-type", "").split(";")[0].strip() != (
        "application/x-www-form-urlencoded"
    ):
        return None
    body = (await request.body()).decode("utf-8", errors="replace")
    values = parse_qs(body, keep_blank_values=True).get("token", [])
    return values[0].strip() if len(values) == 1 else None


@router.post("/dashboard/login", include_in_schema=False)
async def login(request: Request, state: State) -> Response:
    """Trade the admin token (a form field, never the URL) for the session cookie."""
    if not same_origin(request):
        return _page("login.html", 403, error="refused: the form was sent from another site")
    token = await _form_token(request)
    admin = state.settings.admin_token.get_secret_value()
    if token is None or not secrets.compare_digest(token.encode(), admin.encode()):
        log.warning("dashboard login refused (wrong token)")
        return _page("login.html", 401, error="That is not the admin token.")
    response = RedirectResponse("/dashboard", status_code=status.HTTP_303_SEE_OTHER)
    set_session(response, request, admin, state.settings.dashboard_session_hours * 3600)
    response.headers["Cache-Control"] = "no-store"
    return response


@router.post("/dashboard/logout", include_in_schema=False)
async def logout(request: Request) -> Response:
    if not same_origin(request):
        return _page("login.html", 403, error="refused: the form was sent from another site")
    response = RedirectResponse("/dashboard", status_code=status.HTTP_303_SEE_OTHER)
    clear_session(response, request)
    return response


@router.get("/dashboard/static/{name}", include_in_schema=False)
async def static(name: str) -> Response:
    """The page's script and style, and plotly.js from the plotly package."""
    if name == "plotly.min.js":
        return FileResponse(
            plotly_js(),
            media_type="text/javascript",
            headers={"Cache-Control": "public, max-age=86400", "X-Content-Type-Options": "nosniff"},
        )
    if name not in _OWN_FILES:
        raise HTTPException(status.HTTP_404_NOT_FOUND, "no such file")
    return FileResponse(
        _STATIC / name,
        media_type=_OWN_FILES[name],
        headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"},
    )
