"""POST /predict and POST /score: the model runs on the executor thread, never here."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from memlm.api import (
    MemoryOptionsIn,
    MemoryOut,
    NeighbourOut,
    PredictRequest,
    PredictResponse,
    ScoreRequest,
    ScoreResponse,
    Suggestion,
    WordSuggestionOut,
)
from memlm.db.repositories import PolicyRepository
from memlm.engine import policy_params
from memlm.knnlm import MemoryOptions
from memlm.settings import Settings
from service.deps import EngineDep, ReadAccess, ReadAuth, State
from service.errors import InvalidRequest, PayloadTooLarge, error_responses
from service.provenance import check_neighbour_access, provenance
from service.state import AppState

router = APIRouter(tags=["inference"])

T = TypeVar("T")

# The executor's kinds of job: each has its own seconds-per-token estimate.
PREDICT, SCORE = "predict", "score"

# What a request costs the model thread beyond its tokens (the memory search, the head,
# the top-N), in tokens: without it a flood of one-token contexts would be admitted as
# if nearly free. The true share depends on the model (a one-token /predict costs 6 ms
# and a 128-token one 8 ms with tiny-gpt2; SmolLM2 spends ~10 ms per token); the estimate
# is a ratio of sums over the recent mix of requests, so it is right on average for any
# steady mix and this only sets how a sudden change of lengths is judged.
BASE_COST = 32


def request_cost(tokens: int) -> int:
    """The executor's cost of a request whose model reads ``tokens`` tokens."""
    return BASE_COST + tokens


# Texts up to this many characters are tokenised on the event loop: about 0.5 ms for
# 1,000 characters of news (tiny-gpt2's and SmolLM2's tokenizer, loaded 2-core machine),
# less than a hop to the thread pool and back costs under load. Longer ones go to the
# pool: 20,000 characters take 15-60 ms (random characters are the slow case).
INLINE_CHARS = 1000


async def off_loop_if_long(text: str, fn: Callable[[], T]) -> T:
    """``fn()`` (a tokenisation of ``text``) inline when short, in the thread pool if long."""
    if len(text) <= INLINE_CHARS:
        return fn()
    return await run_in_threadpool(fn)


@dataclass(frozen=True)
class PredictOptions:
    """What one micro-batch of /predict requests shares (the executor groups by it)."""

    top_n: int
    neighbours: int
    words: int
    memory: MemoryOptions | None


def predict_many(engine: Any, items: Sequence[tuple[str, PredictOptions]]) -> list[Any]:
    """The executor's batch function: all items share their options."""
    o = items[0][1]
    contexts = [c for c, _ in items]
    kwargs: dict[str, Any] = {"top_n": o.top_n, "neighbours": o.neighbours}
    if o.words:
        kwargs["words"] = o.words
    if o.memory is not None:
        kwargs["memory"] = o.memory
    batch = getattr(engine, "predict_batch", None)
    if batch is not None:
        return list(batch(contexts, **kwargs))
    return [engine.predict(c, **kwargs) for c in contexts]


def memory_options(body: MemoryOptionsIn, settings: Settings) -> MemoryOptions | None:
    """The request's TRIME memory, None when it asks for none."""
    if not (body.local_memory or body.long_memory):
        return None
    return MemoryOptions(
        local=True,
        long_segments=body.long_memory,
        tau=settings.trime_tau if body.tau is None else body.tau,
    )


def memory_out(memory: MemoryOptions | None) -> MemoryOut | None:
    if memory is None:
        return None
    return MemoryOut(local_memory=memory.local, long_memory=memory.long_segments, tau=memory.tau)


def _lambda(pred: Any) -> float:
    for name in ("lam", "lambda_", "lmbda"):
        if hasattr(pred, name):
            return float(getattr(pred, name))
    raise AttributeError("prediction has no lambda")


def _version(pred: Any, state: AppState) -> str | None:
    """The index version this answer searched (a fake engine's answer does not say)."""
    v = getattr(pred, "index_version", state.served_version)
    return None if v is None else str(v)


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -1e30


def _check_size(state: AppState, text: str, name: str) -> None:
    limit = state.settings.max_context_chars
    if len(text) > limit:
        raise PayloadTooLarge(f"{name} has {len(text)} characters; at most {limit}")


@router.post(
    "/predict",
    response_model=PredictResponse,
    response_model_by_alias=True,
    responses=error_responses(400, 401, 413, 422, 429, 503),
    summary="Next-token suggestions with the memory's neighbours",
)
async def predict(
    body: PredictRequest, state: State, engine: EngineDep, may_read: ReadAccess
) -> PredictResponse:
    """Top-N next tokens under the LM, the memory and their interpolation.

    `neighbours` above 0 name memorised documents and tokens: they need read access (a
    read, ingest or admin token; anyone in development), else 401 even where reads are open.
    """
    _check_size(state, body.context, "context")
    limit = state.settings.max_neighbours
    if body.neighbours > limit:
        raise InvalidRequest(
            f"neighbours: {body.neighbours} asked; at most {limit} (MEMLM_MAX_NEIGHBOURS)"
        )
    if body.neighbours:
        check_neighbour_access(may_read)
    executor = state.executor
    executor.check(PREDICT)  # refuse an overloaded queue before tokenising
    fit = await off_loop_if_long(
        body.context, partial(engine.fit_context, body.context, long_segments=body.long_memory)
    )
    memory = memory_options(body, state.settings)
    opts = PredictOptions(body.top_n, body.neighbours, body.words, memory)
    fn = state.cached["predict_many"]
    pred = await executor.batched(
        fn, (fn, opts), (fit.text, opts), kind=PREDICT, cost=request_cost(fit.tokens)
    )
    neighbours: list[NeighbourOut] = []
    if pred.neighbours:  # database reads and snippets: a worker thread, not the event loop
        neighbours = await run_in_threadpool(
            provenance,
            state.sessions,
            pred.neighbours,
            state.cached["span_cache"],
        )
    return PredictResponse(
        suggestions=[
            Suggestion(
                token=s.token,
                token_id=getattr(s, "token_id", None),
                prob=s.prob,
                lm_prob=s.lm_prob,
                knn_prob=s.knn_prob,
                trime_prob=getattr(s, "trime_prob", None),
            )
            for s in pred.suggestions
        ],
        words=[
            WordSuggestionOut(
                word=w.word,
                tokens=list(w.tokens),
                prob=w.prob,
                lm_prob=w.lm_prob,
                knn_prob=w.knn_prob,
            )
            for w in getattr(pred, "words", [])
        ],
        **{"lambda": _lambda(pred)},
        neighbours=neighbours,
        memory=memory_out(memory),
        index_version=_version(pred, state),
        context_tokens=fit.tokens,
        input_tokens=fit.total,
        truncated=fit.tokens < fit.total,
    )


@router.post(
    "/score",
    response_model=ScoreResponse,
    dependencies=[ReadAuth],
    responses=error_responses(400, 401, 413, 422, 429, 503),
    summary="Per-token log-probabilities and what the policy would store",
)
async def score(body: ScoreRequest, state: State, engine: EngineDep) -> ScoreResponse:
    _check_size(state, body.text, "text")
    executor = state.executor
    executor.check(SCORE)  # refuse an overloaded queue before tokenising
    tokens = await off_loop_if_long(body.text, partial(engine.count_tokens, body.text))
    limit = state.settings.max_score_tokens
    if tokens > limit:
        raise PayloadTooLarge(f"text has {tokens} tokens; at most {limit} (MEMLM_MAX_SCORE_TOKENS)")

    def active_policy() -> tuple[str, Any]:
        with state.sessions.begin() as s:
            row = PolicyRepository(s).get(
                default_policy=state.settings.policy, default_delta=state.settings.delta
            )
            factory = state.policy_factory
            if factory is None:
                return row.policy, None
            params = policy_params(row.policy, row.params, state.settings, s)
            return row.policy, factory(row.policy, row.delta, params)

    name, policy = await run_in_threadpool(active_policy)
    memory = memory_options(body, state.settings)
    kwargs: dict[str, Any] = {"policy": policy}
    if memory is not None:
        kwargs["memory"] = memory
    res = await executor.call(
        partial(engine.score, body.text, **kwargs), kind=SCORE, cost=request_cost(tokens)
    )
    trime = getattr(res, "trime_logprobs", None)
    return ScoreResponse(
        tokens=list(res.tokens),
        lm_logprobs=[_finite(float(x)) for x in res.lm_logprobs],
        logprobs=[_finite(float(x)) for x in res.logprobs],
        lm_ppl=float(res.lm_ppl),
        ppl=float(res.ppl),
        would_store=[bool(x) for x in res.would_store],
        policy=name,
        trime_logprobs=None if trime is None else [_finite(float(x)) for x in trime],
        trime_ppl=getattr(res, "trime_ppl", None),
        memory=memory_out(memory),
    )
