"""An OpenAI-style completion run on the engine, with no knowledge of the wire format.

Every number comes from the two paths the rest of the API uses, never from a copy:

* the echoed prompt is scored by ``Engine.score_ids``, the path of ``/score`` (so its
  log-probabilities are ``/score``'s for the same tokens), admitted and priced as a
  ``/score`` of those tokens;
* each choice is a :class:`memlm.engine.generation.Generation`, the loop of ``/generate``, admitted
  once by its whole cost exactly as ``/generate`` is (reading its prompt, plus the
  ``max_tokens`` steps it may take, reserved), then stepped ``MEMLM_GENERATE_CHUNK_TOKENS``
  tokens per model-thread job, choice after choice, so other requests get the model thread
  between the jobs.

A request with an echo is admitted twice, as a /score and then as a /generate; both are
checked before any model work, so a refusal (429) almost always comes first. Each call
owns its choices (their generations, caches and random generators): nothing is shared
between requests but the engine.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

from starlette.concurrency import run_in_threadpool

from memlm.api import NeighbourOut
from memlm.api.openai import MAX_CHOICES
from memlm.db.errors import DomainError
from memlm.engine import EngineLike
from memlm.engine.generation import GenerateConfig, GeneratedToken
from memlm.engine.protocol import GenerationLike
from service.executor import Reservation
from service.provenance import provenance
from service.routes.generate import GENERATE, GENERATE_STEP
from service.routes.inference import SCORE, off_loop_if_long, request_cost
from service.state import AppState

# What a log-probability of 0 (or below float64's range) is reported as: JSON has no
# -Infinity, and /score reports the same.
NO_LOGPROB = -1e30


class BadRequest(DomainError):
    """A well-formed request that memlm cannot serve (OpenAI's 400)."""

    status_code = 400
    error = "invalid_request"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextTooLong(BadRequest):
    error = "context_length_exceeded"


class ModelNotFound(DomainError):
    status_code = 404
    error = "model_not_found"
    param = "model"


def finite(x: float) -> float:
    return x if math.isfinite(x) else NO_LOGPROB


def log_or_floor(p: float) -> float:
    return math.log(p) if p > 0 else NO_LOGPROB


@dataclass(frozen=True)
class PromptIn:
    ids: list[int]
    text: str | None  # as the caller gave it; None when given as token ids


@dataclass(frozen=True)
class Sampling:
    """How every choice of a request is generated."""

    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    top: int  # most probable tokens reported per token (0: none)
    neighbour: bool

    def config(self, choice: int) -> GenerateConfig:
        """Choice ``choice`` of a prompt samples with ``seed + choice``."""
        return GenerateConfig(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=None if self.seed is None else self.seed + choice,
            stop=self.stop,
            neighbour=self.neighbour,
            top=self.top,
        )


@dataclass
class Choice:
    """One choice in progress: its generation and the tokens it has produced."""

    index: int
    prompt: int
    gen: GenerationLike
    max_tokens: int
    tokens: list[GeneratedToken] = field(default_factory=list)


async def read_prompts(
    state: AppState, engine: EngineLike, prompt: str | list[str] | list[int] | list[list[int]]
) -> list[PromptIn]:
    """The prompts as token ids, checked against the vocabulary and the settings' limits."""
    if isinstance(prompt, str):
        return [await _read_text(state, engine, prompt)]
    if isinstance(prompt[0], str):
        return [await _read_text(state, engine, str(text)) for text in prompt]
    lists = (
        [cast(list[int], prompt)] if isinstance(prompt[0], int) else cast(list[list[int]], prompt)
    )
    vocab = engine.vocab_size
    for ids in lists:
        if max(ids) >= vocab:
            raise BadRequest(
                f"token id {max(ids)} is not in the vocabulary (0 to {vocab - 1})", "prompt"
            )
    return [PromptIn(list(ids), None) for ids in lists]


async def _read_text(state: AppState, engine: EngineLike, text: str) -> PromptIn:
    chars = state.settings.max_context_chars
    if len(text) > chars:
        raise ContextTooLong(
            f"a prompt has {len(text)} characters; at most {chars} (MEMLM_MAX_CONTEXT_CHARS)",
            "prompt",
        )
    ids = await off_loop_if_long(text, partial(engine.tokenize, text))
    if not ids:
        raise BadRequest("a prompt is empty after tokenisation", "prompt")
    return PromptIn(ids, text)


def check_sizes(
    state: AppState,
    engine: EngineLike,
    prompts: Sequence[PromptIn],
    n: int,
    max_tokens: int,
    echo: bool,
) -> None:
    """Refuse (400) what the model cannot read or the settings do not allow.

    A request may cost at most what the largest single /generate and /score may: its
    choices produce MEMLM_MAX_GENERATE_TOKENS tokens in all, its echo scores
    MEMLM_MAX_SCORE_TOKENS. An idle server admits any request whatever its cost, so these
    limits are what bound one request.
    """
    choices = len(prompts) * n
    if choices > MAX_CHOICES:
        raise BadRequest(f"{len(prompts)} prompts x n={n}; at most {MAX_CHOICES} choices", "n")
    limit = state.settings.max_generate_tokens
    if choices * max_tokens > limit:
        raise BadRequest(
            f"max_tokens: {max_tokens} for each of {choices} choice(s) is "
            f"{choices * max_tokens} tokens; at most {limit} in one request "
            "(MEMLM_MAX_GENERATE_TOKENS)",
            "max_tokens",
        )
    scored = sum(len(p.ids) for p in prompts)
    if echo and scored > state.settings.max_score_tokens:
        raise ContextTooLong(
            f"the prompts have {scored} tokens; an echo scores at most "
            f"{state.settings.max_score_tokens} in one request (MEMLM_MAX_SCORE_TOKENS)",
            "prompt",
        )
    longest = max(len(p.ids) for p in prompts)
    positions = engine.generation_positions
    if max_tokens and longest + max_tokens > positions:
        raise ContextTooLong(
            f"a prompt has {longest} tokens; with max_tokens {max_tokens} that exceeds the "
            f"model's {positions} positions",
            "prompt",
        )


def check_admission(state: AppState, prompts: int, n: int, max_tokens: int, echo: bool) -> None:
    """Refuse an overloaded queue (429) before any tokenisation or model work."""
    executor = state.executor
    if echo:
        executor.check(SCORE)
    if max_tokens:
        executor.check(GENERATE, later=(GENERATE_STEP, prompts * n * max_tokens))


async def score_echo(
    state: AppState, engine: EngineLike, prompts: Sequence[PromptIn], top: int, nearest: bool
) -> list[Any]:
    """``score_ids`` of every prompt (None for a one-token prompt: nothing to score), in one
    model-thread job admitted as /score is, by the tokens it reads."""

    def run() -> list[Any]:
        return [
            engine.score_ids(p.ids, top=top, nearest=nearest) if len(p.ids) > 1 else None
            for p in prompts
        ]

    cost = sum(request_cost(len(p.ids)) for p in prompts)
    result: list[Any] = await state.executor.call(run, kind=SCORE, cost=cost)
    return result


async def start_choices(
    state: AppState, engine: EngineLike, prompts: Sequence[PromptIn], n: int, sampling: Sampling
) -> tuple[list[Choice], Reservation]:
    """Read every choice's prompt in one job admitted as /generate is (its prompts, and the
    steps reserved); the choices of prompt p are indices p * n to p * n + n - 1."""

    def run() -> list[Choice]:
        return [
            Choice(
                p * n + j,
                p,
                engine.start_generation_ids(prompt.ids, sampling.config(j)),
                sampling.max_tokens,
            )
            for p, prompt in enumerate(prompts)
            for j in range(n)
        ]

    cost = sum(request_cost(len(p.ids)) for p in prompts) * n
    steps = (GENERATE_STEP, len(prompts) * n * sampling.max_tokens)
    choices, reserved = await state.executor.start(run, kind=GENERATE, cost=cost, later=steps)
    return choices, reserved


async def run_choices(
    state: AppState, choices: Sequence[Choice], reserved: Reservation
) -> AsyncIterator[tuple[Choice, list[GeneratedToken]]]:
    """Step the choices until all are done, one chunk of one choice per model-thread job,
    taking turns; yields each chunk as it comes. What the steps did not use is given back."""
    chunk = state.settings.generate_chunk_tokens
    with reserved:
        while live := [c for c in choices if not c.gen.done]:
            for c in live:
                left = c.max_tokens - len(c.tokens)
                tokens = await reserved.call(
                    partial(c.gen.step, chunk), cost=max(1, min(chunk, left))
                )
                c.tokens.extend(tokens)
                yield c, tokens


async def neighbours_of(state: AppState, found: Sequence[Any]) -> list[NeighbourOut | None]:
    """Provenance of each of ``found`` (engine Neighbours or None), in a worker thread."""
    hits = [f for f in found if f is not None]
    if not hits:
        return [None] * len(found)
    outs = iter(
        await run_in_threadpool(provenance, state.sessions, hits, state.cached["span_cache"])
    )
    return [None if f is None else next(outs) for f in found]
