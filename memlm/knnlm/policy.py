"""Memorisation policies: which (key -> next token) pairs enter the datastore.

Each policy maps per-token scores to a boolean "store" mask:

- FullMem stores every token.
- RandMem stores a seeded random fraction ``rate``.
- MoNIM stores x_t when log p(x_t | x_<t) < delta under the augmented model over the memory
  served at that time (the plain LM while the memory is empty); delta = -1.5.
- MoNIM + AMT uses delta_t = delta / (max_y log(p(y) / p(x_t)) + 0.5): a token that is already
  the top-1 faces 2 * delta, a badly ranked one a looser threshold.
- MoNIM(KL) (MoNIM App. C.1) looks at the information the key itself carries about x_t: the
  cross-entropy of softmax(E key) on x_t, E the output embedding.  The paper writes the rule
  as "KL < delta"; read literally with delta < 0 it would store nothing, and it contradicts
  the paper's own rationale (store what is new), so we store when the key's log-probability
  of x_t is below delta, i.e. -CE < delta, the same orientation as the loss rule.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from memlm.knnlm import KnnParams, augmented_scores

if TYPE_CHECKING:
    from memlm.encoder import Encoder, TokenOutputs

DEFAULT_DELTA = -1.5
# The key is the last MLP's input: projected through E it gives a flat distribution, so
# its log-probabilities sit far below the output's.  Measured on SmolLM2-135M over 25k news
# tokens: median -9.7, 10th percentile -11.7.  -10 stores about 42% there; -1.5 would
# store everything.  Other models need their own value (memlm eval --kl-delta).
DEFAULT_KL_DELTA = -10.0


@dataclass
class TokenScores:
    """What a policy may look at, per token of one document."""

    target_logprob: np.ndarray  # (n,) log p(x_t) under the augmented model
    max_logprob: np.ndarray  # (n,) max_y log p(y) under the augmented model
    key_ce: np.ndarray  # (n,) -log softmax(E key)[x_t] (NaN when not computed)
    doc_id: int | None = None  # the stream document scored (None: a text outside the stream)

    def __len__(self) -> int:
        return int(self.target_logprob.shape[0])


class Policy(Protocol):
    name: str
    needs_augmented: bool  # whether the memory must be searched to decide
    needs_key_ce: bool

    def decide(self, scores: TokenScores) -> np.ndarray: ...


@dataclass
class FullMem:
    name: str = "fullmem"
    needs_augmented: bool = False
    needs_key_ce: bool = False

    def decide(self, scores: TokenScores) -> np.ndarray:
        return np.ones(len(scores), dtype=bool)


class RandMem:
    """Stores each token with probability ``rate``, from seeded random streams.

    A stream document's mask comes from its own generator, ``default_rng([seed, doc_id])``
    (a SeedSequence over the stream's seed and the document's id), not from one generator
    advanced from document to document. Both give every document a different mask at the
    configured rate, but an advancing generator makes a document's mask depend on how many
    tokens were drawn before it: a document processed again after a crash (its first draws
    were spent), or by one of several workers in whatever order they claim, would get
    another mask than one uninterrupted worker gives it. Keyed by (seed, document id), the
    mask is the same whoever processes the document, whenever, and however often; distinct
    ids give independent streams (SeedSequence mixes the pair), so the stored share over
    many documents is ``rate`` as for one stream.

    Scores without a document id (``Engine.score`` of a free text, the evaluation harness)
    draw from one generator seeded once and advanced call after call, under a lock.
    """

    needs_augmented = False
    needs_key_ce = False

    def __init__(self, rate: float, seed: int = 0, name: str = "randmem"):
        if not 0.0 <= rate <= 1.0:
            raise ValueError("rate must be in [0, 1]")
        if seed < 0:
            raise ValueError("seed must be >= 0")
        self.name, self.rate, self.seed = name, rate, seed
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()  # numpy generators are not thread-safe

    def decide(self, scores: TokenScores) -> np.ndarray:
        if scores.doc_id is not None:
            if scores.doc_id < 0:
                raise ValueError("RandMem needs a document id >= 0")
            rng = np.random.default_rng([self.seed, scores.doc_id])
            return rng.random(len(scores)) < self.rate
        with self._lock:
            return self._rng.random(len(scores)) < self.rate


@dataclass
class MoNIM:
    delta: float = DEFAULT_DELTA
    name: str = "monim"
    needs_augmented: bool = True
    needs_key_ce: bool = False

    def decide(self, scores: TokenScores) -> np.ndarray:
        return scores.target_logprob < self.delta


@dataclass
class MoNIMAMT:
    delta: float = DEFAULT_DELTA
    name: str = "monim-amt"
    needs_augmented: bool = True
    needs_key_ce: bool = False

    def thresholds(self, scores: TokenScores) -> np.ndarray:
        gap = scores.max_logprob - scores.target_logprob  # >= 0
        return self.delta / (np.maximum(gap, 0.0) + 0.5)

    def decide(self, scores: TokenScores) -> np.ndarray:
        return scores.target_logprob < self.thresholds(scores)


@dataclass
class MoNIMKL:
    delta: float = DEFAULT_KL_DELTA
    name: str = "monim-kl"
    needs_augmented: bool = False
    needs_key_ce: bool = True

    def decide(self, scores: TokenScores) -> np.ndarray:
        if np.isnan(scores.key_ce).any():
            raise ValueError("MoNIM(KL) needs key_ce: set Encoder.compute_key_ce = True")
        return -scores.key_ce < self.delta


def token_scores(
    encoder: Encoder,
    out: TokenOutputs,
    dist: np.ndarray,
    vals: np.ndarray,
    params: KnnParams,
    *,
    lmbda: np.ndarray | None = None,
    temperature: np.ndarray | None = None,
) -> TokenScores:
    """The augmented-model scores of one document's tokens against its neighbours.

    dist, vals: (n, k) search results with -1 values as padding (MemoryIndex.search_values);
    ``lmbda``: (n,) lambda per token (the served calibrator's), else ``params.lmbda``;
    ``temperature``: (n,) T per token (the served combination's), else ``params.temperature``.
    """
    ids = np.where(vals >= 0, 0, -1)  # only validity matters to the kNN distribution
    value_lm = encoder.logprobs_for(out.hidden, out.lse, np.maximum(vals, 0))
    aug = augmented_scores(
        out.target_logprob,
        out.top_logprob,
        out.top_id,
        out.targets,
        dist,
        ids,
        vals,
        value_lm,
        params,
        lmbda=lmbda,
        temperature=temperature,
    )
    return TokenScores(aug.target_logprob, aug.max_logprob, out.key_ce)


POLICY_NAMES = ("fullmem", "randmem", "monim", "monim-amt", "monim-kl")


# delta is a log-probability threshold: 0 already stores every token not predicted with
# certainty, and below -100 (p < 4e-44) nothing is ever stored; outside that it is a typo.
DELTA_RANGE = (-100.0, 0.0)
# What each policy's ``params`` may hold (the keyword arguments make_policy takes for it):
# name -> (type, lowest, highest). RandMem's seed feeds numpy's generator (< 2**63).
POLICY_PARAMS: dict[str, dict[str, tuple[type, float, float]]] = {
    "fullmem": {},
    "randmem": {"rate": (float, 0.0, 1.0), "seed": (int, 0, 2**63 - 1)},
    "monim": {},
    "monim-amt": {},
    "monim-kl": {},
}
# Policies whose decision uses delta; the others refuse one rather than ignore it.
USES_DELTA = ("monim", "monim-amt", "monim-kl")


def check_policy(name: str, delta: float | None, params: dict[str, object]) -> None:
    """Raise ValueError, saying why, unless make_policy(name, delta=delta, **params) is
    meaningful: a known name, a finite delta in DELTA_RANGE for a policy that uses one,
    and only the params that policy takes, of the right type and in range."""
    if name not in POLICY_PARAMS:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    if delta is not None:
        if name not in USES_DELTA:
            raise ValueError(f"{name} takes no delta (only {', '.join(USES_DELTA)} do)")
        lo, hi = DELTA_RANGE
        if not (math.isfinite(delta) and lo <= delta <= hi):
            raise ValueError(f"delta must be a finite number in [{lo:g}, {hi:g}], got {delta}")
    allowed = POLICY_PARAMS[name]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        takes = ", ".join(allowed) if allowed else "none"
        raise ValueError(f"{name} takes no parameter {', '.join(unknown)} (it takes: {takes})")
    for key, value in params.items():
        kind, lo, hi = allowed[key]
        ok_type = isinstance(value, (int, float)) if kind is float else isinstance(value, int)
        if isinstance(value, bool) or not ok_type:
            what = "a number" if kind is float else "an integer"
            raise ValueError(f"{name} parameter {key} must be {what}, got {value!r}")
        number = float(value)  # type: ignore[arg-type]
        if not (math.isfinite(number) and lo <= number <= hi):
            raise ValueError(f"{name} parameter {key} must be in [{lo:g}, {hi:g}], got {value}")


def make_policy(
    name: str, *, delta: float | None = None, rate: float = 0.5, seed: int = 0
) -> Policy:
    """Build a policy by name (one of POLICY_NAMES); ``delta=None`` takes its default."""
    if name == "fullmem":
        return FullMem()
    if name == "randmem":
        return RandMem(rate, seed)
    if name == "monim":
        return MoNIM(DEFAULT_DELTA if delta is None else delta)
    if name == "monim-amt":
        return MoNIMAMT(DEFAULT_DELTA if delta is None else delta)
    if name == "monim-kl":
        return MoNIMKL(DEFAULT_KL_DELTA if delta is None else delta)
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
