"""What a policy's run keeps: held-out search results, per-day counters, the run itself."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from memlm.encoder import TokenOutputs


@dataclass
class EvalTokens:
    """Search results of held-out tokens, kept for tuning; rows are tokens."""

    target_lm_logprob: list[np.ndarray] = field(default_factory=list)
    distances: list[np.ndarray] = field(default_factory=list)  # (n, k_max) float32
    values: list[np.ndarray] = field(default_factory=list)  # (n, k_max) int32, -1 padding
    day: list[np.ndarray] = field(default_factory=list)  # (n,) int32 day number
    doc: list[np.ndarray] = field(default_factory=list)  # (n,) int32 index of the doc in the plan
    gold: list[np.ndarray] = field(default_factory=list)  # (n,) int64 gold token
    # calibrator features known before the search
    top_logprob: list[np.ndarray] = field(default_factory=list)  # (n,) max log p_LM
    entropy: list[np.ndarray] = field(default_factory=list)  # (n,) entropy of p_LM
    lexical: list[np.ndarray] = field(default_factory=list)  # (n, 2) LexicalStats.features
    # TRIME Eq. 6 log p(gold) with local/long-term memory, one column per tau (optional)
    trime: list[np.ndarray] = field(default_factory=list)  # (n, len(taus)) float64
    # squared norm of each query key: the evidence interpolation's distance scale
    qnorm: list[np.ndarray] = field(default_factory=list)  # (n,) float32
    context: list[np.ndarray] = field(default_factory=list)  # (n,) float32 tokens before

    def add(
        self,
        o: TokenOutputs,
        dist: np.ndarray,
        vals: np.ndarray,
        day: int,
        doc: int,
        lexical: np.ndarray,
        trime: np.ndarray | None = None,
    ) -> None:
        self.target_lm_logprob.append(o.target_logprob.astype(np.float64))
        self.distances.append(dist)
        self.values.append(vals)
        self.day.append(np.full(len(o), day, np.int32))
        self.doc.append(np.full(len(o), doc, np.int32))
        self.gold.append(o.targets)
        self.top_logprob.append(o.top_logprob)
        self.entropy.append(o.entropy)
        self.lexical.append(lexical)
        self.qnorm.append((o.keys.astype(np.float64) ** 2).sum(axis=1).astype(np.float32))
        self.context.append(o.positions.astype(np.float32))
        if trime is not None:
            self.trime.append(trime)

    def arrays(self, k_max: int) -> dict[str, np.ndarray]:
        if not self.target_lm_logprob:
            return {
                "target_lm_logprob": np.zeros(0),
                "distances": np.zeros((0, k_max), np.float32),
                "values": np.zeros((0, k_max), np.int32),
                "day": np.zeros(0, np.int32),
                "doc": np.zeros(0, np.int32),
                "gold": np.zeros(0, np.int64),
                "top_logprob": np.zeros(0, np.float32),
                "entropy": np.zeros(0, np.float32),
                "lexical": np.zeros((0, 2), np.float32),
                "trime": np.zeros((0, 0)),
                "qnorm": np.zeros(0, np.float32),
                "context": np.zeros(0, np.float32),
            }
        out = {
            f.name: np.concatenate(getattr(self, f.name)) for f in fields(self) if f.name != "trime"
        }
        out["trime"] = np.concatenate(self.trime) if self.trime else np.zeros((0, 0))
        return out


@dataclass
class DayStats:
    day: str
    tokens_seen: int
    tokens_stored: int
    entries: int
    seconds: float
    ingest: dict[str, Any] = field(default_factory=dict)  # the interpolation MoNIM asked
    # what a policy that searches its memory would have stored deciding on the LM alone
    # (its memory empty): stored / seen against this splits MemRate into what the text's
    # difficulty and what the memory decide (None: the policy does not search)
    stored_lm_alone: int | None = None
    # wall time of the day's phases: ingest (search + policy + append), build, held-out search
    ingest_seconds: float = 0.0
    build_seconds: float = 0.0
    search_seconds: float = 0.0
    # waiting for another process's encode (--follow-encode); not in the phases above
    wait_seconds: float = 0.0
    # a consolidating policy (name +cons / +budget): the night's ConsolidationReport
    # (memlm.memory.consolidation) and the seconds spent counting usage while ingesting
    consolidation: dict[str, Any] | None = None
    usage_seconds: float = 0.0


@dataclass
class PolicyRun:
    name: str
    days: list[DayStats]
    dev: dict[str, np.ndarray]
    test: dict[str, np.ndarray]
    entries: int
    tokens_seen: int
    tokens_stored: int
    ood: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # corpus -> arrays

    @property
    def memrate(self) -> float:
        return self.tokens_stored / self.tokens_seen if self.tokens_seen else 0.0


def eval_tokens_of(arrays: dict[str, np.ndarray]) -> EvalTokens:
    """The EvalTokens whose ``arrays()`` are ``arrays`` (one chunk per field)."""
    out = EvalTokens()
    for f in fields(out):
        if f.name in ("qnorm", "context") and f.name not in arrays:  # from before they were kept
            arrays = {**arrays, f.name: np.full(len(arrays["gold"]), np.nan, np.float32)}
        a = arrays[f.name]
        if f.name == "trime" and a.size == 0:
            continue
        getattr(out, f.name).append(a)
    return out


def extend(into: EvalTokens, part: EvalTokens) -> None:
    for f in fields(into):
        getattr(into, f.name).extend(getattr(part, f.name))
