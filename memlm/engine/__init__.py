"""The engine facade: one object that the service and the workers drive.

It owns the encoder, the datastore and the served memory index of one data directory,
and offers the operations of the data flow in DESIGN.md: memorise a document with a
policy, predict the next token, score a text, rebuild the index, forget a document.
No database and no HTTP here; the caller commits its own bookkeeping.

Modules, one responsibility each::

    facade.py    :class:`Engine` (every operation below) and ``Engine.open``
    core.py      state, served interpolation, scores of a text, build/write locks, reload
    ingest.py    ``process_document`` = ``prepare_document`` + ``store_document``
    predict.py   ``predict`` / ``predict_batch`` (words, TRIME memory, neighbours)
    score.py     ``score``
    build.py     ``rebuild``, ``compact``, ``train_calibrator``, ``reconcile_index``
    forget.py    ``forget_document``, ``hide_documents``
    stats.py     ``stats``
    results.py   the dataclasses the operations return
    errors.py    ``EngineInputError``

Importing the package is light (no torch, faiss or transformers): the names below load
their module on first use, so the service can name the engine before the model loads.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memlm.engine.core import BUILD_LOCK, ENGINE_CRASH_POINTS
    from memlm.engine.errors import EngineInputError
    from memlm.engine.facade import Engine
    from memlm.engine.results import (
        ContextFit,
        IngestResult,
        Neighbour,
        Prediction,
        PreparedDocument,
        RebuildInfo,
        ScoreResult,
        Suggestion,
    )
    from memlm.knnlm import MemoryOptions
    from memlm.policy import make_policy

# name -> the module that defines it
_LAZY = {
    "BUILD_LOCK": "memlm.engine.core",
    "ENGINE_CRASH_POINTS": "memlm.engine.core",
    "Engine": "memlm.engine.facade",
    "EngineInputError": "memlm.engine.errors",
    "ContextFit": "memlm.engine.results",
    "IngestResult": "memlm.engine.results",
    "Neighbour": "memlm.engine.results",
    "Prediction": "memlm.engine.results",
    "PreparedDocument": "memlm.engine.results",
    "RebuildInfo": "memlm.engine.results",
    "ScoreResult": "memlm.engine.results",
    "Suggestion": "memlm.engine.results",
    "MemoryOptions": "memlm.knnlm",
    "make_policy": "memlm.policy",
}

__all__ = [
    "BUILD_LOCK",
    "ENGINE_CRASH_POINTS",
    "ContextFit",
    "Engine",
    "EngineInputError",
    "IngestResult",
    "MemoryOptions",
    "Neighbour",
    "Prediction",
    "PreparedDocument",
    "RebuildInfo",
    "ScoreResult",
    "Suggestion",
    "make_policy",
]


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
