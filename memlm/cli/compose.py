"""The composition root of the service: the API, and the ingest worker beside it.

The service and the workers never import each other; what runs together in one process
is decided here (`memlm up`, and `memlm serve` with MEMLM_EMBEDDED_WORKER), and tests
that need the API with its embedded worker call :func:`build_app` as the CLI does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI
    from sqlalchemy.orm import Session, sessionmaker

    from memlm.engine import EngineLike
    from memlm.settings import Settings
    from service.app import WorkerStarter

PolicyFactory = Callable[[str, float | None, dict[str, Any]], Any]


def ingest_worker(settings: Settings, policy_factory: PolicyFactory) -> WorkerStarter:
    """What the app starts once its engine is loaded: the ingest worker (and its index
    builder) as a thread over that engine, until the app's shutdown sets the event."""

    def start(
        engine: EngineLike, sessions: sessionmaker[Session], stop: threading.Event
    ) -> threading.Thread:
        from workers.ingest import IngestWorker

        worker = IngestWorker(engine, sessions, settings, policy_factory=policy_factory)
        t = threading.Thread(target=worker.run, args=(stop,), name="memlm-ingest", daemon=True)
        t.start()
        return t

    return start


def build_app(
    settings: Settings,
    *,
    engine: EngineLike | None = None,
    policy_factory: PolicyFactory | None = None,
    embedded_worker: bool | None = None,
    poll: bool = True,
) -> FastAPI:
    """The API, with the ingest worker in the same process when ``embedded_worker``
    (default: ``settings.embedded_worker``); the other arguments go to ``create_app``."""
    from memlm.engine import policy_factory as default_policy_factory
    from service.app import create_app

    factory = policy_factory or default_policy_factory
    with_worker = settings.embedded_worker if embedded_worker is None else embedded_worker
    return create_app(
        settings,
        engine=engine,
        policy_factory=factory,
        worker=ingest_worker(settings, factory) if with_worker else None,
        poll=poll,
    )
