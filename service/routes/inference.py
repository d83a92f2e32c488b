"""POST /predict and POST /score: the model runs on the executor thread, never here."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from memlm.db.repositories import DocumentRepository, PolicyRepository
from service.deps import EngineDep, ReadAuth, State
from service.errors import PayloadTooLarge
from service.provenance import neighbours_out
from service.schemas import (
    PredictRequest,
    PredictResponse,
    ScoreRequest,
    ScoreResponse,
    Suggestion,
)
from service.state import AppState

router = APIRouter(tags=["inference"])


def predict_many(engine: Any, items: Sequence[tuple[str, int, int]]) -> list[Any]:
    """The executor's batch function: all items share top_n and neighbours."""
    _, top_n, k = items[0]
    contexts = [c for c, _, _ in items]
    batch = getattr(engine, "predict_batch", None)
    if batch is not None:
        return list(batch(contexts, top_n=top_n, neighbours=k))
    return [engine.predict(c, top_n=top_n, neighbours=k) for c in contexts]


def _lambda(pred: Any) -> float:
    for name in ("lam", "lambda_", "lmbda"):
        if hasattr(pred, name):
            return float(getattr(pred, name))
    raise AttributeError("prediction has no lambda")


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
    dependencies=[ReadAuth],
    summary="Next-token suggestions with the memory's neighbours",
)
async def predict(body: PredictRequest, state: State, engine: EngineDep) -> PredictResponse:
    """Top-N next tokens under the LM, the memory and their interpolation."""
    _check_size(state, body.context, "context")
    key = (state.cached["predict_many"], body.top_n, body.neighbours)
    pred = await state.executor.batched(key[0], key, (body.context, body.top_n, body.neighbours))
    docs = {}
    if pred.neighbours:

        def lookup() -> dict[int, Any]:
            with state.sessions() as s:
                return DocumentRepository(s).many(int(n.doc_id) for n in pred.neighbours)

        docs = await run_in_threadpool(lookup)
    return PredictResponse(
        suggestions=[
            Suggestion(
                token=s.token,
                token_id=getattr(s, "token_id", None),
                prob=s.prob,
                lm_prob=s.lm_prob,
                knn_prob=s.knn_prob,
            )
            for s in pred.suggestions
        ],
        **{"lambda": _lambda(pred)},
        neighbours=neighbours_out(pred.neighbours, docs, state.cached.get("char_span")),
        index_version=state.served_version,
    )


@router.post(
    "/score",
    response_model=ScoreResponse,
    dependencies=[ReadAuth],
    summary="Per-token log-probabilities and what the policy would store",
)
async def score(body: ScoreRequest, state: State, engine: EngineDep) -> ScoreResponse:
    _check_size(state, body.text, "text")

    def active_policy() -> tuple[str, Any]:
        with state.sessions.begin() as s:
            row = PolicyRepository(s).get(
                default_policy=state.settings.policy, default_delta=state.settings.delta
            )
            factory = state.policy_factory
            return row.policy, factory(row.policy, row.delta, row.params) if factory else None

    name, policy = await run_in_threadpool(active_policy)
    res = await state.executor.call(partial(engine.score, body.text, policy=policy))
    return ScoreResponse(
        tokens=list(res.tokens),
        lm_logprobs=[_finite(float(x)) for x in res.lm_logprobs],
        logprobs=[_finite(float(x)) for x in res.logprobs],
        lm_ppl=float(res.lm_ppl),
        ppl=float(res.ppl),
        would_store=[bool(x) for x in res.would_store],
        policy=name,
    )
