"""The engine facade: one object that the service and the workers drive.

It owns the encoder and the memory of one data directory (``memlm.memory``: the faiss
files or a Milvus collection, behind one protocol that the engine never goes around), and
offers the operations of the data flow (docs/architecture.md): memorise a document with
a policy, predict the next token, score a text, rebuild the index, forget a document.
No HTTP here, and the database only in opening.py (reads of its records); the caller
commits its own bookkeeping.

Modules, one responsibility each::

    facade.py    :class:`Engine` (every operation below) and ``Engine.open``
    core.py      state, served interpolation, scores of a text, build/write locks, reload,
                 rollback / recover (what the database did not commit)
    ingest.py    ``process_document`` = ``prepare_document`` + ``store_document``
    predict.py   ``predict`` / ``predict_batch`` (words, TRIME memory, neighbours)
    generation.py ``start_generation`` and the pieces :mod:`memlm.engine.generation` steps with
    score.py     ``score``, ``score_ids`` (with the top tokens of every position)
    tokens.py    the tokenizer for callers that speak token ids, the chat template
    build.py     ``rebuild``, ``compact``, ``train_calibrator``, ``reconcile_index``
    forget.py    ``forget_document``, ``hide_documents``
    stats.py     ``stats``
    results.py   the dataclasses the operations return
    errors.py    ``EngineInputError``
    protocol.py  ``EngineLike``: the calls the service and the workers make
    opening.py   ``open_engine`` from the settings, the policy factory and its params,
                 ``day_number``, ``reconcile_index`` (serve only recorded index versions)

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
    from memlm.engine.opening import (
        day_number,
        open_engine,
        policy_factory,
        policy_params,
        reconcile_index,
    )
    from memlm.engine.protocol import EngineLike
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
    from memlm.knnlm.policy import make_policy
    from memlm.memory import BuildInfo
    from memlm.memory.base import Committed, MemoryBehind, Recovered

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
    "EngineLike": "memlm.engine.protocol",
    "day_number": "memlm.engine.opening",
    "open_engine": "memlm.engine.opening",
    "policy_factory": "memlm.engine.opening",
    "policy_params": "memlm.engine.opening",
    "reconcile_index": "memlm.engine.opening",
    "MemoryOptions": "memlm.knnlm",
    "make_policy": "memlm.knnlm.policy",
    "BuildInfo": "memlm.memory",
    "Committed": "memlm.memory.base",
    "MemoryBehind": "memlm.memory.base",
    "Recovered": "memlm.memory.base",
}

__all__ = [
    "BUILD_LOCK",
    "ENGINE_CRASH_POINTS",
    "BuildInfo",
    "Committed",
    "ContextFit",
    "Engine",
    "EngineInputError",
    "EngineLike",
    "IngestResult",
    "MemoryBehind",
    "MemoryOptions",
    "Neighbour",
    "Prediction",
    "PreparedDocument",
    "RebuildInfo",
    "Recovered",
    "ScoreResult",
    "Suggestion",
    "day_number",
    "make_policy",
    "open_engine",
    "policy_factory",
    "policy_params",
    "reconcile_index",
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
