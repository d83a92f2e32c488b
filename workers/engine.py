"""The engine as the service and the workers see it, and how they open it.

``EngineLike`` names exactly the calls the front doors make, so tests can pass the
exact fake in ``tests/fakes.py`` and the real :class:`memlm.engine.Engine` alike.
"""

from __future__ import annotations

import datetime as dt
import logging
from contextlib import AbstractContextManager
from typing import Any, Protocol

from memlm.settings import Settings

log = logging.getLogger(__name__)

EPOCH = dt.date(1970, 1, 1)
# RandMem's rate when MEMLM_RANDMEM_RATE=monim but MoNIM measured nothing yet (the default).
DEFAULT_RATE = 0.3


def day_number(day: dt.date) -> int:
    """The engine's day: days since 1970-01-01 (what the datastore keeps as provenance)."""
    return (day - EPOCH).days


class EngineLike(Protocol):
    def process_document(
        self, doc_id: int, text: str, day: int, *, policy: Any = None, crash_at: str | None = None
    ) -> Any: ...

    def prepare_document(self, doc_id: int, text: str, day: int, *, policy: Any = None) -> Any: ...

    def store_document(self, prep: Any, *, crash_at: str | None = None) -> Any: ...

    def exclusive(self) -> AbstractContextManager[None]: ...

    def building(self, timeout: float | None = None) -> AbstractContextManager[None]: ...

    def predict(self, context: str, *, top_n: int = 10, neighbours: int = 0) -> Any: ...

    def score(self, text: str, *, policy: Any = None) -> Any: ...

    def fit_context(self, context: str, *, long_segments: int = 0) -> Any: ...

    def count_tokens(self, text: str) -> int: ...

    def rebuild(self, *, crash_at: str | None = None) -> Any: ...

    def reload_index(self) -> Any: ...

    def forget_document(
        self, doc_id: int, text: str | None = None, *, entries: range | None = None
    ) -> int: ...

    def truncate_datastore(self, n: int) -> None: ...

    def stats(self) -> dict[str, Any]: ...


def open_engine(settings: Settings, *, encoder: Any = None, writer: bool = True) -> EngineLike:
    """Open the real engine on the settings' data directory (loads the model).

    A writer opens it shared (``memlm worker`` processes may join the same data
    directory); ``writer=False`` opens it read-only, for an API whose workers are other
    processes. Both follow the others' writes with ``engine.sync()``.
    """
    from memlm.engine import Engine  # heavy: torch, transformers, faiss
    from memlm.heldout import HeldOutConfig
    from memlm.interpolation import SERVED_DEFAULT, SERVED_GRID
    from memlm.knnlm import KnnParams

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
        encoder=encoder,
        gate_theta=settings.gate_theta,
        heldout=HeldOutConfig(
            enabled=settings.calibrator_training,  # a read-only engine never records
            share=settings.calibrator_sample,
            day_tokens=settings.calibrator_day_tokens,
            min_tokens=settings.calibrator_min_tokens,
            max_tokens=settings.calibrator_max_tokens,
        ),
        memory_url=settings.memory_url,
        **extra,
    )
    return engine


def policy_factory(name: str, delta: float | None, params: dict[str, Any]) -> Any:
    """The engine's policy argument for the active policy row (name, delta, params)."""
    from memlm.engine import make_policy  # heavy import, only once the engine is used

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
        from memlm.db.repositories import StatsRepository

        measured = StatsRepository(session).memrate(MONIM_POLICIES)
        if measured is None:
            log.warning("RandMem at MoNIM's rate: MoNIM has not run; using %s", DEFAULT_RATE)
        out["rate"] = DEFAULT_RATE if measured is None else measured
    return out
