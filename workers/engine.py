"""Moved: the engine's protocol and opening live in :mod:`memlm.engine` (``protocol.py``,
``opening.py``), where the service and the workers both import them from; these names stay
importable here for callers written before the move (benchmarks, other branches)."""

from memlm.engine.opening import (
    DEFAULT_RATE,
    EPOCH,
    MONIM_POLICIES,
    day_number,
    open_engine,
    policy_factory,
    policy_params,
)
from memlm.engine.protocol import EngineLike

__all__ = [
    "DEFAULT_RATE",
    "EPOCH",
    "MONIM_POLICIES",
    "EngineLike",
    "day_number",
    "open_engine",
    "policy_factory",
    "policy_params",
]
