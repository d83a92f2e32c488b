"""What the lifespan builds once and the routes receive: typed application state."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from memlm.engine import EngineLike
from memlm.settings import Settings
from service.executor import ModelExecutor
from service.metrics import Metrics

log = logging.getLogger(__name__)


@dataclass
class AppState:
    settings: Settings
    db: Engine
    sessions: sessionmaker[Session]
    executor: ModelExecutor
    metrics: Metrics
    engine: EngineLike | None = None  # None while the model loads
    load_error: str | None = None
    served_version: str | None = None
    calibrator_version: str | None = None  # the index version whose calibrator is served
    policy_factory: Any = None
    # Last values the poller saw, for /metrics (the scrape never touches the model).
    cached: dict[str, Any] = field(default_factory=dict)
