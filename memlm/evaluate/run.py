"""One policy over the stream: ingest each day, rebuild, search the held-out tokens."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from memlm.datastore import Datastore
from memlm.encoder import TokenOutputs, WindowConfig
from memlm.evaluate.cache import TokenCache
from memlm.evaluate.plan import DayPlan, day_number
from memlm.index import IndexParams, MemoryIndex, build_index
from memlm.interpolation import (
    MIN_TUNE_TOKENS,
    SERVED_DEFAULT,
    SERVED_GRID,
    TuneGrid,
    choose_constant,
)
from memlm.knnlm import KnnParams
from memlm.lexical import LexicalStats
from memlm.policy import Policy, TokenScores, token_scores


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


@dataclass
class PolicyRun:
    name: str
    days: list[DayStats]
    dev: dict[str, np.ndarray]
    test: dict[str, np.ndarray]
    entries: int
    tokens_seen: int
    tokens_stored: int

    @property
    def memrate(self) -> float:
        return self.tokens_stored / self.tokens_seen if self.tokens_seen else 0.0


@dataclass(frozen=True)
class TrimeSpec:
    """TRIME local (and long-term) memory inside the LM's softmax (TRIME Eq. 5/6)."""

    long_segments: int = 0  # earlier windows of the same document; 0: local memory only
    # SmolLM2 key similarities are ~2-3.5 against logit log-sum-exps of 12-31, so the
    # grid reaches small tau (docs/trime.md)
    taus: tuple[float, ...] = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 4.0, 8.0)

    def columns(self, o: TokenOutputs, window: WindowConfig) -> np.ndarray:
        from memlm.trime_memory import cached_doc_logprobs

        if len(o) == 0:
            return np.zeros((0, len(self.taus)))
        return cached_doc_logprobs(
            o.keys,
            o.targets,
            o.target_logprob,
            o.lse,
            o.positions,
            window.windows(int(o.positions[-1]) + 1),
            long_tokens=self.long_segments * window.context,
            taus=self.taus,
        )


def run_policy(
    policy: Policy | None,
    plans: Sequence[DayPlan],
    cache: TokenCache,
    workdir: Path,
    *,
    ingest_params: KnnParams | None,
    k_max: int,
    index_kind: str = "auto",
    on_day: Callable[[DayStats], None] | None = None,
    trime: TrimeSpec | None = None,
    served_grid: TuneGrid = SERVED_GRID,
    served_default: KnnParams = SERVED_DEFAULT,
    served_min_tokens: int = MIN_TUNE_TOKENS,
) -> PolicyRun:
    """Ingest the stream with ``policy`` (None: the bare LM) and search the held-out tokens.

    ``ingest_params``: the constant MoNIM scores with; None: the interpolation the service
    would serve, ``served_default`` until the dev tokens of the days so far (each searched
    against its evening's memory, as the service's held-out tokens are) choose one from
    ``served_grid`` after an evening's build, as the service does at its nightly build.
    """
    name = policy.name if policy is not None else "bare"
    shutil.rmtree(workdir, ignore_errors=True)
    ds = Datastore.open(workdir / "datastore", dim=cache.encoder.dim)
    index = MemoryIndex(ds, workdir / "index")
    dev, test = EvalTokens(), EvalTokens()
    lexical = LexicalStats(cache.encoder.vocab_size)
    days: list[DayStats] = []
    seen = stored = 0
    doc_no = 0
    served: dict[str, Any] = {
        "params": ingest_params or served_default,
        "source": "fixed" if ingest_params is not None else "default",
    }
    for plan in plans:
        t0 = time.perf_counter()
        dnum = day_number(plan.day)
        day_seen = day_stored = 0
        knn: KnnParams = served["params"]
        asked = {
            "k": knn.k,
            "temperature": knn.temperature,
            "lambda": knn.lmbda,
            "source": served["source"],
        }
        outs = cache.get_many([d.text for d in plan.train])
        for o in outs:
            doc_no += 1
            n = len(o)
            lexical.update(np.concatenate([o.prev_tokens[:1], o.targets]))
            day_seen += n
            if policy is None or n == 0:
                continue
            if policy.needs_augmented:
                dist, _, vals = index.search_values(o.keys, knn.k)
                scores = token_scores(cache.encoder, o, dist, vals, knn)
            else:
                nan = np.full(n, np.nan)
                scores = TokenScores(nan, nan, o.key_ce)
            mask = policy.decide(scores)
            if mask.any():
                ds.append(
                    o.keys[mask].astype(np.float16),
                    o.targets[mask].astype(np.int32),
                    np.full(int(mask.sum()), doc_no, np.int64),
                    o.positions[mask],
                    np.full(int(mask.sum()), dnum, np.int32),
                )
                index.refresh()
            day_stored += int(mask.sum())
        if policy is not None and len(ds) > 0:
            params = (
                IndexParams.exact()
                if index_kind == "flat"
                else IndexParams.for_size(ds.num_live, ds.dim)
            )
            build_index(ds, workdir / "index", params, progress=False)
            index.reload()
        for split, docs in (("dev", plan.dev), ("test", plan.test)):
            target = dev if split == "dev" else test
            for i, o in enumerate(cache.get_many([d.text for d in docs])):
                dist, _, vals = index.search_values(o.keys, k_max)
                cols = None if trime is None else trime.columns(o, cache.window)
                target.add(o, dist, vals, dnum, i, lexical.features(o.prev_tokens), cols)
        if ingest_params is None and policy is not None and policy.needs_augmented:
            choice = choose_constant(
                dev.arrays(k_max), served_grid, served_default, min_tokens=served_min_tokens
            )
            served = {"params": choice.params, "source": choice.source}
        seen += day_seen
        stored += day_stored
        stats = DayStats(
            plan.day.isoformat(),
            day_seen,
            day_stored,
            ds.num_live,
            time.perf_counter() - t0,
            asked if policy is not None and policy.needs_augmented else {},
        )
        days.append(stats)
        if on_day:
            on_day(stats)
    return PolicyRun(name, days, dev.arrays(k_max), test.arrays(k_max), ds.num_live, seen, stored)
