"""Generation: multi-token continuation under the kNN-augmented distribution, in one module.

Every step draws the next token from the same interpolation as ``/predict``:
p(y) = (1 - lambda) p_LM(y) + lambda p_kNN(y), with the served k, T and lambda (or the
calibrator's lambda, and the retrieval gate). The context is read once; each new token
extends the attention cache (``Encoder.start`` / ``Encoder.extend``, the path whole-word
suggestions use), so a step costs one one-token forward, one memory search and the
head, never a re-run of the context.

A :class:`Generation` owns everything of one call (its cache, its random generator, its
text): nothing is shared between calls but the model weights and the memory, and a
caller may run its steps in several pieces (the API runs them on its model thread, a few
tokens per job, between other requests).

The loop (:class:`Generation`, :func:`generate`, :func:`choose`, :class:`StopText`) is
model-agnostic: it drives any engine through the calls of :class:`GenerateMixin`
(``start_generation``, ``next_token``, ``nearest``), which :class:`memlm.engine.Engine`
mixes in and ``tests/fakes.py`` imitates.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from memlm.engine.errors import EngineInputError

if TYPE_CHECKING:
    from memlm.calibrator import ServedInterpolation
    from memlm.engine.predict import PredictMixin
    from memlm.engine.results import Neighbour, _NextToken

    _MixinBase = PredictMixin
else:  # the engine's other mixins come with it at run time (memlm.engine.facade)
    _MixinBase = object

FinishReason = Literal["length", "stop", "eos"]


@dataclass(frozen=True)
class GenerateConfig:
    """What to generate and how to choose each token."""

    max_tokens: int = 32
    temperature: float = 0.0  # 0: greedy (argmax of the augmented distribution)
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens with this much mass
    seed: int | None = None  # sampling only; None draws one (reported, to replay the call)
    stop: tuple[str, ...] = ()  # the text ends before the first of these; it is not returned
    neighbour: bool = False  # report each token's nearest neighbour in the memory
    stop_at_eos: bool = True  # the tokenizer's end-of-text token ends the text
    top: int = 0  # report each step's this many most probable tokens (OpenAI's logprobs)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.top < 0:
            raise ValueError("top must be >= 0")
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise ValueError("temperature must be finite and >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class GeneratedToken:
    token_id: int
    token: str  # the token decoded alone
    text: str  # what it adds to the returned text (held back while a stop string may start)
    prob: float  # under the augmented distribution (before temperature and top-p)
    lm_prob: float
    knn_prob: float
    lam: float  # lambda of this step (0 where the gate skipped the search or none was found)
    neighbour: Any = None  # the engine's Neighbour of the nearest entry, when asked
    # the step's ``GenerateConfig.top`` most probable tokens under the distribution of
    # ``prob``, most probable first: (id, decoded alone, probability)
    top: tuple[tuple[int, str, float], ...] = ()


def top_tokens(prob: np.ndarray, n: int) -> list[int]:
    """The ``n`` most probable tokens of a (V,) distribution, most probable first."""
    if n <= 0:
        return []
    best = np.argpartition(-prob, n - 1)[:n]
    return [int(t) for t in best[np.argsort(-prob[best], kind="stable")]]


# tokens the nucleus is first looked for among (the most probable ones); more only when
# their mass falls short of top_p
NUCLEUS_PREFIX = 256


def nucleus(q: np.ndarray, top_p: float) -> np.ndarray:
    """The tokens top-p keeps, most probable first (ties by token id): each token whose
    mass before it, in that order, is below ``top_p`` (the first always stays).

    The order is needed only as far as the mass reaches ``top_p``: the ``NUCLEUS_PREFIX``
    most probable tokens (with every token tied with the last of them) are sorted first,
    and when their mass reaches ``top_p`` the tokens after them can keep none, so the
    answer is the full stable sort's (the same values added in the same order) without
    sorting the whole vocabulary. Otherwise the whole vocabulary is sorted.
    """
    if len(q) > 4 * NUCLEUS_PREFIX:
        top = np.argpartition(-q, NUCLEUS_PREFIX - 1)[:NUCLEUS_PREFIX]
        cand = np.flatnonzero(q >= q[top].min())  # ascending ids: ties keep id order
        order = cand[np.argsort(-q[cand], kind="stable")]
        mass = np.cumsum(q[order])
        # the margin covers the rounding of the full sort's (sum + q) - q for the first
        # token left out, whose mass before it is then >= top_p as well
        if mass[-1] >= top_p + 1e-9:
            return order[mass - q[order] < top_p]
    order = np.argsort(-q, kind="stable")
    # keep tokens until the mass before them reaches top_p (the first always stays)
    before = np.cumsum(q[order]) - q[order]
    return order[before < top_p]


def choose(prob: np.ndarray, cfg: GenerateConfig, rng: np.random.Generator | None) -> int:
    """The next token from a (V,) distribution: argmax, or a temperature / top-p draw."""
    if cfg.greedy:
        return int(np.argmax(prob))
    assert rng is not None
    # the max subtracted before dividing: with a temperature of 5e-324 every log p / T was
    # -inf, and -inf - -inf made the distribution NaN (a 500); now the argmax keeps 0
    with np.errstate(divide="ignore", over="ignore"):
        logp = np.log(prob)
        q = np.exp((logp - logp.max()) / cfg.temperature)
    q /= q.sum()
    if cfg.top_p < 1.0:
        keep = nucleus(q, cfg.top_p)
        q2 = np.zeros_like(q)
        q2[keep] = q[keep]
        q = q2 / q2.sum()
    return int(rng.choice(len(q), p=q))


class StopText:
    """The returned text: decoded from all generated ids, stop strings cut off.

    Deltas are held back while the text ends with the beginning of a stop string or with
    an incomplete character (a byte of a multi-byte character decodes as U+FFFD), so the
    deltas of the tokens always add up to the final text.
    """

    def __init__(self, decode: Any, stop: Sequence[str]) -> None:
        self.decode = decode
        self.stop = tuple(stop)
        self.emitted = ""
        self.final: str | None = None
        self.matched: str | None = None

    def push(self, ids: Sequence[int], last: bool) -> str:
        """The characters to emit after ``ids``; sets ``final`` when a stop string shows."""
        text = self.decode(list(ids))
        cut = min(
            ((i, s) for s in self.stop if (i := text.find(s)) >= 0),
            default=None,
        )
        if cut is not None:
            self.final, self.matched = text[: cut[0]], cut[1]
            return self._delta(self.final)
        if last:
            self.final = text
            return self._delta(text)
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:n]):
                    hold = n
                    break
        end = len(text) - hold
        while end > 0 and text[end - 1] == "\ufffd":
            end -= 1
        return self._delta(text[:end]) if end > len(self.emitted) else ""

    def _delta(self, upto: str) -> str:
        if not upto.startswith(self.emitted):  # decoding changed an emitted character
            return ""
        out = upto[len(self.emitted) :]
        self.emitted = upto
        return out


class Generation:
    """One continuation in progress: :meth:`start` reads the context, :meth:`step` adds
    tokens until ``done``."""

    def __init__(self, engine: Any, context_ids: Sequence[int], cfg: GenerateConfig) -> None:
        """Use :meth:`start` (this reads the context through the model)."""
        if not context_ids:
            raise ValueError("the context is empty")
        self.engine = engine
        self.cfg = cfg
        self.served = engine.served  # one interpolation for the whole continuation
        self.context_tokens = len(context_ids)
        self.seed = None
        self.rng = None
        if not cfg.greedy:
            self.seed = cfg.seed if cfg.seed is not None else secrets.randbits(63)
            self.rng = np.random.default_rng(self.seed)
        self.index_version = engine.served_version  # the memory's, on every backend
        enc = engine.encoder
        keys, hidden, decoding = enc.start([list(context_ids)], cache=True)
        self._decoding = decoding
        self._key, self._hidden = keys[0, -1:], hidden[0, -1:]  # (1, d), (1, h)
        self._prev = int(context_ids[-1])
        self._eos = enc.tokenizer.eos_token_id if cfg.stop_at_eos else None
        self.ids: list[int] = []
        self._text = StopText(
            lambda ids: enc.tokenizer.decode(ids, skip_special_tokens=True), cfg.stop
        )
        self.finish_reason: FinishReason | None = None

    @classmethod
    def start(cls, engine: Any, context_ids: Sequence[int], cfg: GenerateConfig) -> Generation:
        return cls(engine, context_ids, cfg)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The text so far (final once ``done``: stop string excluded)."""
        return self._text.final if self._text.final is not None else self._text.emitted

    @property
    def stop_matched(self) -> str | None:
        return self._text.matched

    @torch.inference_mode()
    def step(self, n: int) -> list[GeneratedToken]:
        """Up to ``n`` more tokens (fewer when the continuation ends)."""
        out: list[GeneratedToken] = []
        engine, cfg = self.engine, self.cfg
        while len(out) < n and not self.done:
            nxt = engine.next_token(
                self._key,
                self._hidden,
                np.array([self._prev]),
                self.served,
                lookup=cfg.neighbour,
                context=np.array([self.context_tokens + len(self.ids)]),
            )
            prob = nxt.prob[0]
            tok = choose(prob, cfg, self.rng)
            self.ids.append(tok)
            eos = tok == self._eos
            last = eos or len(self.ids) >= cfg.max_tokens
            delta = self._text.push(self.ids[:-1] if eos else self.ids, last)
            if self._text.matched is not None:
                self.finish_reason = "stop"
            elif eos:
                self.finish_reason = "eos"
            elif last:
                self.finish_reason = "length"
            found = engine.nearest(nxt) if cfg.neighbour else None
            best = top_tokens(prob, cfg.top)
            names = engine.encoder.token_strings(best) if best else []
            out.append(
                GeneratedToken(
                    tok,
                    engine.encoder.tokenizer.decode([tok]),
                    delta,
                    float(prob[tok]),
                    float(nxt.lm[0, tok]),
                    float(nxt.knn[0, tok]),
                    float(nxt.lam[0]),
                    found,
                    tuple((t, name, float(prob[t])) for t, name in zip(best, names, strict=True)),
                )
            )
            if not self.done:  # the last token needs no forward
                key, hidden = engine.encoder.extend(
                    self._decoding, np.zeros(1, np.int64), np.array([tok], np.int64)
                )
                self._key, self._hidden, self._prev = key, hidden, tok
        if self.done:
            self._decoding = None  # the cache is not needed any more
        return out


def generate(
    engine: Any, context_ids: Sequence[int], cfg: GenerateConfig
) -> tuple[Generation, list[GeneratedToken]]:
    """The whole continuation in one call (benchmarks, scripts)."""
    gen = Generation.start(engine, context_ids, cfg)
    tokens = gen.step(cfg.max_tokens)
    return gen, tokens


# --- the engine's side ----------------------------------------------------------------------


class GenerateMixin(_MixinBase):
    """What :class:`Generation` uses of the engine, by public names."""

    @property
    def generation_positions(self) -> int:
        """Context plus generated tokens that a continuation may hold (the model's positions)."""
        return self.encoder.max_positions

    def start_generation(self, context: str, cfg: GenerateConfig) -> Generation:
        """Read ``context`` and return the continuation to step."""
        return self.start_generation_ids(self.encoder.tokenize(context), cfg)

    def start_generation_ids(self, ids: Sequence[int], cfg: GenerateConfig) -> Generation:
        """``start_generation`` of a context given as token ids."""
        if not ids:
            raise EngineInputError("the context is empty after tokenisation")
        if len(ids) + cfg.max_tokens > self.generation_positions:
            raise EngineInputError(
                f"the context has {len(ids)} tokens; with max_tokens {cfg.max_tokens} that "
                f"exceeds the model's {self.generation_positions} positions"
            )
        return Generation.start(self, ids, cfg)

    def next_token(
        self,
        keys: torch.Tensor,
        hidden: torch.Tensor,
        prev: np.ndarray,
        served: ServedInterpolation,
        *,
        lookup: bool = False,
        context: np.ndarray | None = None,
    ) -> _NextToken:
        """The augmented next-token distributions of R rows: keys (R, d), head inputs
        (R, h), their last tokens (R,), tokens of context before each (R,); the same
        computation as ``predict``."""
        return self._next_token(
            keys, hidden, prev, k=served.params.k, lookup=lookup, served=served, context=context
        )

    def nearest(self, nxt: _NextToken, row: int = 0) -> Neighbour | None:
        """The nearest neighbour of a row's search, with its provenance (None if none)."""
        found = self._neighbours(nxt.eids[row], nxt.vals[row], nxt.dist[row], 1)
        return found[0] if found else None
