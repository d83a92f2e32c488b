"""Opening the real engine from the settings, and what the service and the workers agree
on around it: the policy of the active policy row, the engine's day, and which built
index versions may be served (those the database recorded).

The one module of the engine package that reads the database (its repositories); the
model loads only inside :func:`open_engine`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from memlm.db.repositories import BuildRepository, StatsRepository
from memlm.engine.protocol import EngineLike
from memlm.locks import LockBusy, PgAdvisoryLock, ProcessLock, advisory_key
from memlm.settings import Settings

log = logging.getLogger(__name__)

EPOCH = dt.date(1970, 1, 1)
# RandMem's rate when MEMLM_RANDMEM_RATE=monim but MoNIM measured nothing yet (the default).
DEFAULT_RATE = 0.3


def day_number(day: dt.date) -> int:
    """The engine's day: days since 1970-01-01 (what the datastore keeps as provenance)."""
    return (day - EPOCH).days


def open_engine(settings: Settings, *, encoder: Any = None, writer: bool = True) -> EngineLike:
    """Open the real engine on the settings' data directory (loads the model).

    A writer opens it shared (``memlm worker`` processes may join the same data
    directory); ``writer=False`` opens it read-only, for an API whose workers are other
    processes. Both follow the others' writes with ``engine.sync()``.
    """
    from memlm.calibrator.constant import SERVED_DEFAULT, SERVED_GRID
    from memlm.calibrator.heldout import HeldOutConfig
    from memlm.engine.facade import Engine  # heavy: torch, transformers, faiss
    from memlm.knnlm import KnnParams
    from memlm.knnlm.policy import DEFAULT_DELTA
    from memlm.memory.consolidation import ConsolidationConfig
    from memlm.memory.pointers import PointerConfig

    # A writer shares the data directory: other worker processes may append in turn.
    extra: dict[str, Any] = {"shared": True} if writer else {"readonly": True}

    # Served before a build chooses: the measured default, with any value the settings fix.
    # Each build tunes the values the settings leave open on the held-out tokens.
    knn = KnnParams(
        k=settings.knn_k or SERVED_DEFAULT.k,
        temperature=settings.knn_temperature or SERVED_DEFAULT.temperature,
        lmbda=SERVED_DEFAULT.lmbda if settings.knn_lambda is None else settings.knn_lambda,
    )
    engine: EngineLike = Engine.open(
        settings.datastore_dir,
        model=settings.model,
        knn=knn,
        grid=SERVED_GRID.fixed(
            k=settings.knn_k, temperature=settings.knn_temperature, lmbda=settings.knn_lambda
        ),
        policy=settings.policy,
        delta=settings.delta,
        rate=DEFAULT_RATE if settings.randmem_rate == "monim" else settings.randmem_rate,
        threads=settings.threads,
        precision=settings.precision,
        device=settings.device,
        encoder=encoder,
        gate_theta=settings.gate_theta,
        rerank_depth=settings.rerank_depth,
        ingest_rerank_depth=settings.ingest_rerank_depth,
        pointers=None if settings.pointers is None else PointerConfig(min_hits=settings.pointers),
        heldout=HeldOutConfig(
            enabled=settings.calibrator_training,  # a read-only engine never records
            share=settings.calibrator_sample,
            day_tokens=settings.calibrator_day_tokens,
            min_tokens=settings.calibrator_min_tokens,
            max_tokens=settings.calibrator_max_tokens,
        ),
        memory_url=settings.memory_url,
        # lambda per token from the retrieval evidence, unless the settings fix lambda
        evidence=settings.knn_lambda is None,
        consolidation=ConsolidationConfig(
            sample=settings.consolidate_sample,
            delta=DEFAULT_DELTA if settings.delta is None else settings.delta,
            budget=settings.memory_budget_entries,
            criterion=settings.budget_criterion,
            recent=settings.budget_recent_share,
        ),
        build_lock=shared_build_lock(settings),
        **extra,
    )
    return engine


def shared_build_lock(settings: Settings) -> ProcessLock | None:
    """The build lock of processes that share the memory but no data directory (workers
    whose liveness is the database): a PostgreSQL advisory lock named by the memory's URL,
    so that one of them at a time builds, or drops generations it thinks abandoned. None:
    the data directory's lock file (``Engine.building``)."""
    if settings.liveness != "database" or settings.memory_url is None:
        return None
    key = advisory_key("memlm-build", settings.db_url, settings.memory_url)
    return PgAdvisoryLock(settings.db_url, key, f"index builds of {settings.memory_url}")


def policy_factory(name: str, delta: float | None, params: dict[str, Any]) -> Any:
    """The engine's policy argument for the active policy row (name, delta, params)."""
    from memlm.knnlm.policy import make_policy  # heavy import, only once the engine is used

    return make_policy(name, delta=delta, **params)


# The policies whose measured MemRate RandMem may copy (``rate: "monim"``).
MONIM_POLICIES = ("monim", "monim-amt", "monim-kl")


def policy_params(name: str, params: dict[str, Any], settings: Settings, session: Any) -> Any:
    """The active policy row's params completed from the settings, for ``policy_factory``.

    RandMem takes ``MEMLM_RANDMEM_RATE`` and ``MEMLM_RANDMEM_SEED`` unless the row names
    its own; a rate of ``"monim"`` (in either) is the cumulative MemRate that the MoNIM
    policies measured on this stream (``day_stats``), or the settings' numeric default
    when they have not run yet.
    """
    if name != "randmem":
        return dict(params)
    out = {"rate": settings.randmem_rate, "seed": settings.randmem_seed, **params}
    if out["rate"] == "monim":
        measured = StatsRepository(session).memrate(MONIM_POLICIES)
        if measured is None:
            log.warning("RandMem at MoNIM's rate: MoNIM has not run; using %s", DEFAULT_RATE)
        out["rate"] = DEFAULT_RATE if measured is None else measured
    return out


def reconcile_index(
    engine: EngineLike, sessions: sessionmaker[Session], *, delete: bool
) -> list[int]:
    """Serve only recorded index versions; with ``delete`` (the worker at start) remove
    the orphans of builds killed before their record. Returns the orphan versions.

    Orphans are deleted, not adopted: their build request is still marked running, so
    start-up queues it again and it is rebuilt from the datastore as it is now, this time
    with its calibrator step and its record (an adopted directory may lack both).
    """
    with contextlib.ExitStack() as held:
        if delete:
            try:  # the records are read under the lock: a build finishing now is kept
                held.enter_context(engine.building(timeout=0))
            except LockBusy:  # another process builds: its directory is not an orphan
                delete = False
        with sessions() as s:
            recorded = BuildRepository(s).recorded_versions()
        orphans = engine.reconcile_index(recorded, delete=delete)
    for v in orphans:
        if delete:
            log.warning("deleted index version %d: no build record names it", v)
        else:
            log.warning("not serving index version %d: no build record names it", v)
    return orphans
