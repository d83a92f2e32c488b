"""POST /generate: a continuation under the augmented distribution, whole or streamed.

The model work goes through the same executor as /predict, admitted once by its whole
cost: reading the context plus the ``max_tokens`` steps it may take (reserved,
:meth:`service.executor.ModelExecutor.start`), so 429 comes before anything is streamed
and long generations cannot crowd the model thread past the budget. The steps follow as
jobs of ``MEMLM_GENERATE_CHUNK_TOKENS`` tokens each, queued as parts of the admitted
request, so /predict and /score get the model thread between them. Each call owns its
:class:`memlm.engine.generation.Generation` (cache, random generator).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Sequence
from functools import partial
from typing import Any

from fastapi import APIRouter
from fastapi.responses import StreamingResponse
from fastapi.sse import format_sse_event
from starlette.concurrency import run_in_threadpool

from memlm.api import (
    GenerateDone,
    GeneratedTokenOut,
    GenerateRequest,
    GenerateResponse,
    NeighbourOut,
)
from memlm.db.errors import DomainError
from memlm.engine.generation import GenerateConfig, GeneratedToken
from service.deps import EngineDep, ReadAccess, State
from service.errors import InvalidRequest, PayloadTooLarge, error_body, error_responses
from service.executor import Reservation
from service.provenance import check_neighbour_access, provenance
from service.routes.inference import off_loop_if_long, request_cost
from service.state import AppState

log = logging.getLogger(__name__)

router = APIRouter(tags=["inference"])

# The executor's kinds: reading the context (admitted by its cost) and the steps.
GENERATE, GENERATE_STEP = "generate", "generate-step"

_STREAM = {
    "description": "with `stream: true`: server-sent events, `event: token` (data: a "
    "GeneratedTokenOut) per token, then `event: done` (data: GenerateDone) or "
    '`event: error` (data: {"error", "detail"})',
    # the schema of one event, as schemathesis (and OpenAPI 3.2's itemSchema) reads a stream
    "content": {
        "text/event-stream": {
            "schema": {
                "type": "object",
                "required": ["event", "data"],
                "properties": {
                    "event": {"type": "string", "enum": ["token", "done", "error"]},
                    "data": {"type": "string", "description": "the event's JSON object"},
                },
            }
        }
    },
}


def _config(body: GenerateRequest) -> GenerateConfig:
    return GenerateConfig(
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=tuple(body.stop),
        neighbour=body.neighbour,
    )


async def _token_outs(state: AppState, tokens: Sequence[GeneratedToken]) -> list[GeneratedTokenOut]:
    found = [t.neighbour for t in tokens if t.neighbour is not None]
    nbrs: list[NeighbourOut] = []
    if found:  # database reads and snippets: a worker thread, not the event loop
        nbrs = await run_in_threadpool(
            provenance,
            state.sessions,
            found,
            state.cached["span_cache"],
        )
    it = iter(nbrs)
    return [
        GeneratedTokenOut(
            token=t.token,
            token_id=t.token_id,
            text=t.text,
            prob=t.prob,
            lm_prob=t.lm_prob,
            knn_prob=t.knn_prob,
            **{"lambda": t.lam},
            neighbour=next(it) if t.neighbour is not None else None,
        )
        for t in tokens
    ]


async def _chunks(
    state: AppState, gen: Any, steps: Reservation
) -> AsyncIterator[list[GeneratedTokenOut]]:
    """The continuation's tokens, a chunk per model-thread job, until it is done; then
    what the steps did not use is given back (an early stop or end of text)."""
    n = state.settings.generate_chunk_tokens
    with steps:
        while not gen.done:
            # the last chunk is shorter when max_tokens is not a multiple of n
            cost = max(1, min(n, steps.left))
            tokens = await steps.call(partial(gen.step, n), cost=cost)
            yield await _token_outs(state, tokens)


def _done(gen: Any, produced: int) -> GenerateDone:
    version = gen.index_version
    return GenerateDone(
        text=gen.text,
        finish_reason=gen.finish_reason,
        stop=gen.stop_matched,
        seed=gen.seed,
        context_tokens=gen.context_tokens,
        generated_tokens=produced,
        index_version=None if version is None else str(version),
    )


def _event(name: str, data: str) -> bytes:
    return format_sse_event(event=name, data_str=data)


async def _stream(state: AppState, gen: Any, steps: Reservation) -> AsyncIterator[bytes]:
    produced = 0
    try:
        async for chunk in _chunks(state, gen, steps):
            for tok in chunk:
                produced += 1
                yield _event("token", tok.model_dump_json(by_alias=True))
        yield _event("done", _done(gen, produced).model_dump_json())
    except DomainError as exc:  # the headers are gone: the error is the last event
        yield _event("error", json.dumps(error_body(exc.error, str(exc))))
    except Exception:
        log.exception("/generate failed half-way through a stream")
        yield _event("error", json.dumps(error_body("internal_error", "internal server error")))


@router.post(
    "/generate",
    response_model=GenerateResponse,
    responses={200: _STREAM, **error_responses(400, 401, 413, 422, 429, 503)},
    summary="A continuation under the memory-augmented distribution (JSON or SSE)",
)
async def generate(
    body: GenerateRequest, state: State, engine: EngineDep, may_read: ReadAccess
) -> Any:
    """Up to ``max_tokens`` tokens, greedy or sampled, each with its LM and memory share.

    `neighbour: true` names memorised documents and tokens: it needs read access (a read,
    ingest or admin token; anyone in development), else 401 even where reads are open.
    """
    limit = state.settings.max_generate_tokens
    if body.max_tokens > limit:
        raise InvalidRequest(
            f"max_tokens: {body.max_tokens} asked; at most {limit} (MEMLM_MAX_GENERATE_TOKENS)"
        )
    chars = state.settings.max_context_chars
    if len(body.context) > chars:
        raise PayloadTooLarge(f"context has {len(body.context)} characters; at most {chars}")
    if body.neighbour:
        check_neighbour_access(may_read)
    executor = state.executor
    steps = (GENERATE_STEP, body.max_tokens)  # the tokens it will produce, at most
    executor.check(GENERATE, later=steps)  # refuse an overloaded queue before tokenising
    tokens = await off_loop_if_long(body.context, partial(engine.count_tokens, body.context))
    positions = engine.generation_positions
    if tokens + body.max_tokens > positions:
        raise PayloadTooLarge(
            f"context has {tokens} tokens; with max_tokens {body.max_tokens} that exceeds "
            f"the model's {positions} positions"
        )
    gen, reserved = await executor.start(
        partial(engine.start_generation, body.context, _config(body)),
        kind=GENERATE,
        cost=request_cost(tokens),
        later=steps,
    )
    if body.stream:
        return StreamingResponse(
            _stream(state, gen, reserved),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    out: list[GeneratedTokenOut] = []
    async for chunk in _chunks(state, gen, reserved):
        out.extend(chunk)
    return GenerateResponse(**_done(gen, len(out)).model_dump(), tokens=out)
