"""What the engine's operations return (frozen dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memlm.encoder import TokenOutputs
from memlm.knnlm.words import WordSuggestion
from memlm.memory import BuildInfo


@dataclass(frozen=True)
class IngestResult:
    tokens_seen: int
    tokens_stored: int
    # datastore ids [first_entry, end_entry) hold this document's entries (None on Milvus:
    # its ids are doc_id * 2**24 + position, memlm.memory.milvus_backend)
    first_entry: int | None
    end_entry: int | None


@dataclass(frozen=True)
class PreparedDocument:
    """A document encoded, scored and decided on, ready to append (``Engine.store_document``)."""

    doc_id: int
    day: int
    token_ids: list[int]
    outputs: TokenOutputs
    store: np.ndarray  # (n,) bool: the policy's decision per scored token
    # (len(token_ids), 2) character span of every token: stored beside the document so that
    # a neighbour's snippet is a slice of its text, not a re-tokenisation (service/provenance)
    char_spans: np.ndarray | None = None
    # the policy's search (ids, values, gold tokens) that memory usage counts once the
    # document is stored for the first time (memlm.memory.usage); None: no search
    usage: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None


@dataclass(frozen=True)
class RebuildInfo(BuildInfo):
    """A new index version, what the calibrator training at that build did, and the
    interpolation it serves (``interpolation.json``: constant chosen, calibrator or not)."""

    calibrator: dict[str, Any] = field(default_factory=dict)
    # what the compaction before the build removed (rows of forgotten documents)
    compaction: dict[str, int] = field(default_factory=dict)
    interpolation: dict[str, Any] = field(default_factory=dict)
    # what the consolidation before the build retired, and why (None: it is off)
    consolidation: dict[str, Any] | None = None


@dataclass(frozen=True)
class Suggestion:
    token: str
    token_id: int
    prob: float
    lm_prob: float
    knn_prob: float
    trime_prob: float | None = None  # LM + local / long-term memory (TRIME Eq. 6), if asked


@dataclass(frozen=True)
class Neighbour:
    entry_id: int
    doc_id: int
    position: int  # token position of the value in its document
    token: str
    token_id: int
    distance: float  # squared L2
    day: int = 0


@dataclass(frozen=True)
class Prediction:
    suggestions: list[Suggestion]
    lam: float
    neighbours: list[Neighbour]
    context_tokens: int = 0
    words: list[WordSuggestion] = field(default_factory=list)
    index_version: int | None = None  # the built index version searched (None: fresh only)


@dataclass(frozen=True)
class _NextToken:
    """Next-token distributions of R rows, each (R, V), and the search behind them."""

    prob: np.ndarray  # (1 - lambda) * base + lambda * knn, base = trime if given else lm
    lm: np.ndarray
    knn: np.ndarray
    trime: np.ndarray | None
    lam: np.ndarray  # (R,) 0 where the gate skipped the search or nothing was found
    dist: np.ndarray  # (R, k)
    eids: np.ndarray
    vals: np.ndarray


@dataclass(frozen=True)
class ScoreResult:
    tokens: list[str]  # the scored tokens (every token but the first)
    lm_logprobs: list[float]
    logprobs: list[float]
    lm_ppl: float
    ppl: float
    would_store: list[bool]
    trime_logprobs: list[float] | None = None  # LM + local / long-term memory, if asked
    trime_ppl: float | None = None
    # per scored token: log p_kNN of it and the lambda it was scored with (0 where the
    # gate skipped the search or no neighbour was found)
    knn_logprobs: list[float] = field(default_factory=list)
    lambdas: list[float] = field(default_factory=list)
    # ``score_ids(top=N)``: per scored token, the N most probable tokens of the augmented
    # distribution at its position, most probable first: (id, decoded alone, log-prob)
    top: list[list[tuple[int, str, float]]] | None = None
    # ``score_ids(nearest=True)``: per scored token, the nearest entry of its search
    nearest: list[Neighbour | None] | None = None


@dataclass(frozen=True)
class ContextFit:
    """The end of a context that ``predict`` reads (``Engine.fit_context``)."""

    text: str  # the context from the first token read on (all of it when it fits)
    tokens: int  # tokens of ``text``
    total: int  # tokens of the whole context
