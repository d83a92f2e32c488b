"""The FastAPI application: ``create_app(settings)``; heavy parts are built in the lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

from fastapi import FastAPI
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from memlm.db.migrate import check_migrated
from memlm.db.repositories import BuildRepository, DocumentRepository, StatsRepository
from memlm.db.session import make_engine, make_sessionmaker
from memlm.engine import EngineLike, reconcile_index
from memlm.engine import open_engine as _open_engine
from memlm.engine import policy_factory as default_policy_factory
from memlm.settings import Settings
from service.dashboard import routes as dashboard_routes
from service.errors import error_responses, install_error_handlers
from service.executor import ModelExecutor
from service.metrics import Metrics
from service.middleware import BodyGuard, CatchAll, RequestMetrics, RequestSlots
from service.openapi import install_openapi
from service.provenance import SpanCache
from service.routes import admin, documents, generate, health, inference, openai, tokenizer
from service.routes.inference import predict_many
from service.state import AppState

log = logging.getLogger(__name__)

EngineFactory = Callable[[Settings], EngineLike]
# Starts what runs beside the API over its engine (the embedded ingest worker) and returns
# its thread, which stops once the event is set: given by the composition root
# (memlm.cli.compose), so that the service never imports the workers.
WorkerStarter = Callable[[EngineLike, sessionmaker[Session], threading.Event], threading.Thread]

# Longest pause between two attempts to open the engine.
LOAD_RETRY_MAX_SECONDS = 60.0

DESCRIPTION = """\
memlm memorises a stream of dated documents in a kNN-LM datastore with the MoNIM
policy and answers next-token and scoring requests from the LM augmented with it.

Errors always have the body `{"error": "<code>", "detail": "<message>"}`.
Ingest and admin routes need `Authorization: Bearer <token>`.
"""


def _engine_version(engine: EngineLike) -> str | None:
    v = engine.served_version
    return None if v is None else str(v)


async def sync_index(state: AppState) -> None:
    """Serve the newest finished build and the newest datastore entries; refresh metrics.

    Runs on the model thread, between requests, so no request sees a half-swapped index.
    """
    engine = state.engine
    if engine is None:
        return

    def read_db() -> tuple[str | None, int, int, int, list[int]]:
        with state.sessions() as s:
            active = BuildRepository(s).active()
            rows = StatsRepository(s).per_day()
            docs = DocumentRepository(s)
            pending = docs.pending_count()
            forgetting = docs.forgetting_ids()
        seen = sum(r.tokens_seen for r in rows)
        stored = sum(r.tokens_stored for r in rows)
        return (None if active is None else active.version), seen, stored, pending, forgetting

    want, seen, stored, pending, forgetting = await run_in_threadpool(read_db)
    # the worker is another process: re-read what it wrote
    await state.executor.call(engine.sync, wait=True)
    if forgetting:  # forgets another API process accepted
        await state.executor.call(partial(engine.hide_documents, forgetting), wait=True)
    if want is not None and want != state.served_version:
        await state.executor.call(engine.reload_index, wait=True)
    stats = await state.executor.call(engine.stats, wait=True)
    version = stats.get("index_version")
    if version is not None and str(version) != state.served_version:
        log.info("serving index version %s", version)
    state.served_version = None if version is None else str(version)
    cal = stats.get("calibrator") or {}
    served_cal = cal.get("index_version") if cal.get("active") else None
    state.calibrator_version = None if served_cal is None else str(served_cal)
    m = state.metrics
    m.entries.set(float(stats["entries"]))
    m.memrate.set(stored / seen if seen else 0.0)
    m.pending.set(float(pending))
    m.index_version.set(float(str(version)) if str(version).isdigit() else 0.0)


def _attach(state: AppState, engine: EngineLike) -> None:
    state.cached["predict_many"] = partial(predict_many, engine)
    state.cached["span_cache"] = SpanCache(engine.char_spans)
    state.engine = engine


def create_app(
    settings: Settings | None = None,
    *,
    engine: EngineLike | None = None,
    engine_factory: EngineFactory | None = None,
    policy_factory: Callable[[str, float | None, dict[str, Any]], Any] | None = None,
    worker: WorkerStarter | None = None,
    run_worker: bool | None = None,
    poll: bool = True,
) -> FastAPI:
    """The app. Pass ``engine`` (tests) or let the lifespan open the real one.

    ``worker`` starts a thread over the same engine once it is loaded (the embedded
    ingest worker: ``memlm.cli.compose.build_app`` passes it), and the engine is then
    opened as a writer. ``run_worker``: the older switch, kept for its callers; False is
    the same as no ``worker``. ``poll`` keeps the served index in step with builds.
    """
    settings = settings or Settings()
    if run_worker is False:
        worker = None
    elif run_worker and worker is None:
        raise TypeError("run_worker=True needs the worker: pass worker= (memlm.cli.compose)")
    factory = engine_factory or partial(_open_engine, writer=worker is not None)
    policy_factory = policy_factory or default_policy_factory

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        db = make_engine(settings.db_url)
        try:
            check_migrated(db)  # refuses an unmigrated database, naming the fix
            executor = ModelExecutor(
                queue_size=settings.queue_size,
                max_batch=settings.max_batch,
                budget_s=settings.queue_budget_s,
                min_retry_after=settings.retry_after_seconds,
            )
        except BaseException:
            # the connection the check opened must not wait for the garbage collector
            db.dispose()
            raise
        sessions = make_sessionmaker(db)
        metrics: Metrics = app.state.metrics
        metrics.track_queue(executor.depth)
        state = AppState(settings, db, sessions, executor, metrics, policy_factory=policy_factory)
        app.state.memlm = state
        stop = threading.Event()
        tasks: list[asyncio.Task[None]] = []
        threads: list[threading.Thread] = []

        async def load() -> None:
            # Retried with backoff: with a separate worker (docker compose) the API may
            # start before the worker has created the datastore it opens read-only.
            delay = settings.index_poll_seconds
            while True:
                try:
                    eng = (
                        engine if engine is not None else await asyncio.to_thread(factory, settings)
                    )
                    break
                except Exception as exc:
                    log.exception("loading the engine failed; retrying in %.0f s", delay)
                    state.load_error = type(exc).__name__
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, max(LOAD_RETRY_MAX_SECONDS, delay))
            state.load_error = None
            # Serve only recorded builds; the worker (the writer) deletes the orphans. What
            # is served now is the record: sync_index must not reload CURRENT over it.
            await asyncio.to_thread(reconcile_index, eng, sessions, delete=False)
            state.served_version = await asyncio.to_thread(_engine_version, eng)
            _attach(state, eng)
            if worker is not None:
                threads.append(worker(eng, sessions, stop))
            await sync_index(state)
            log.info("ready: model %s, index version %s", settings.model, state.served_version)

        async def poller() -> None:
            while True:
                await asyncio.sleep(settings.index_poll_seconds)
                try:
                    await sync_index(state)
                except Exception:
                    log.exception("index sync failed; retrying at the next poll")

        if engine is not None:
            await load()  # tests: ready as soon as the client starts
        else:
            tasks.append(asyncio.create_task(load()))
        if poll:
            tasks.append(asyncio.create_task(poller()))
        try:
            yield
        finally:
            stop.set()
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            deadline = time.monotonic() + settings.shutdown_seconds
            for t in threads:
                t.join(timeout=max(0.0, deadline - time.monotonic()))
                if t.is_alive():
                    log.warning(
                        "embedded worker still busy after MEMLM_SHUTDOWN_SECONDS=%g s; "
                        "abandoning it: its document goes back to the queue and is redone",
                        settings.shutdown_seconds,
                    )
            executor.close()
            db.dispose()

    app = FastAPI(
        title="memlm",
        version="0.1.0",
        description=DESCRIPTION,
        lifespan=lifespan,
        responses=error_responses(500),  # any route, when something unexpected fails
    )
    app.state.metrics = Metrics()
    install_error_handlers(app)
    for module in (documents, inference, generate, admin, health, tokenizer):
        app.include_router(module.router)
    openai.install(app)  # /v1/: the OpenAI-compatible API, with OpenAI's error body
    app.include_router(dashboard_routes.router)
    install_openapi(app, settings)
    # Starlette runs the last added outermost. BodyGuard reads the whole body (up to
    # MEMLM_MAX_BODY_BYTES) before the app sees it, so RequestSlots must be outside it:
    # a refused request is answered 429 without its body ever being read.
    app.add_middleware(BodyGuard, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestSlots)
    app.add_middleware(RequestMetrics, metrics=app.state.metrics)
    app.add_middleware(CatchAll)  # outermost of ours: a 500 is a normal response
    return app
