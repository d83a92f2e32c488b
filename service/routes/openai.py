"""The OpenAI-compatible API: GET /v1/models, POST /v1/completions, POST /v1/chat/completions.

Thin: a route parses the OpenAI request, runs it through :mod:`service.completions` (the
paths of /score and /generate, admitted as they are) and writes OpenAI's answer, whole or
as server-sent events (``data: <chunk>`` lines ending with ``data: [DONE]``). Errors under
/v1/ have OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``, so OpenAI's
clients raise their typed exceptions; 429 and 503 keep Retry-After. docs/service.md has the
field-by-field table of what is supported, ignored and refused.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import StreamingResponse

from memlm.api.openai import (
    DEFAULT_MAX_TOKENS,
    ChoiceExtra,
    Completion,
    CompletionChoice,
    CompletionRequest,
    MemoryInfo,
    ModelCard,
    ModelList,
    Usage,
)
from memlm.engine import EngineLike
from service.completions import (
    BadRequest,
    Choice,
    PromptIn,
    Sampling,
    check_admission,
    check_sizes,
    read_prompts,
    run_choices,
    score_echo,
    start_choices,
)
from service.deps import EngineDep, ReadAccess, ReadAuth, State
from service.errors import install_error_shape
from service.openai_format import (
    DONE,
    STREAM,
    Row,
    check_model,
    choice_extra,
    completion_logprobs,
    echo_rows,
    finish_reason,
    generated_rows,
    openai_error,
    responses,
    sse,
    stream_error,
    token_extras,
)
from service.provenance import check_neighbour_access
from service.routes import openai_chat
from service.state import AppState

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["openai"])

PREFIX = "/v1/"
_STARTED = int(time.time())  # a model's `created`: when this process started serving it


def install(app: FastAPI) -> None:
    """The routes, and OpenAI's error body for every error under /v1/."""
    app.include_router(router)
    app.include_router(openai_chat.router)
    install_error_shape(app, PREFIX, openai_error)


# --- models --------------------------------------------------------------------------------


async def _card(state: AppState, engine: EngineLike) -> ModelCard:
    stats = await state.executor.call(engine.stats)
    version = stats.get("index_version", state.served_version)
    info = engine.tokenizer_info()
    return ModelCard(
        id=state.settings.model,
        created=_STARTED,
        memlm=MemoryInfo(
            backend=str(stats.get("backend", "faiss")),
            entries=int(stats["entries"]),
            index_version=None if version is None else str(version),
            max_positions=engine.generation_positions,
            chat_template=bool(info.get("chat_template")),
        ),
    )


@router.get(
    "/models",
    response_model=ModelList,
    dependencies=[ReadAuth],
    responses=responses(401, 429, 503),
    summary="The served model, with its memory (OpenAI's models list)",
)
async def list_models(state: State, engine: EngineDep) -> ModelList:
    return ModelList(data=[await _card(state, engine)])


@router.get(
    "/models/{model:path}",
    response_model=ModelCard,
    dependencies=[ReadAuth],
    responses=responses(401, 404, 429, 503),
    summary="One model (only the served one exists)",
)
async def get_model(model: str, state: State, engine: EngineDep) -> ModelCard:
    check_model(state, model)
    return await _card(state, engine)


# --- completions ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Request:
    """A completion request checked and admitted: what the answer is written from."""

    id: str
    created: int
    model: str
    prompts: list[PromptIn]
    n: int
    echo: bool
    logprobs: int | None
    neighbour: bool
    scores: list[Any]  # score_ids of each prompt (echo), else None each
    echo_texts: list[str]  # each prompt's text as echoed ("" without echo)


def _sampling(body: CompletionRequest, max_tokens: int) -> Sampling:
    return Sampling(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=body.seed,
        stop=body.stops(),
        top=body.logprobs or 0,
        neighbour=body.neighbour,
    )


@router.post(
    "/completions",
    response_model=Completion,
    responses={200: STREAM, **responses(400, 401, 404, 413, 429, 503)},
    summary="OpenAI's legacy completions: generate, or score a prompt (echo, logprobs)",
)
async def completions(
    body: CompletionRequest, state: State, engine: EngineDep, may_read: ReadAccess
) -> Any:
    """Each choice's tokens under the memory-augmented model, as /generate makes them; with
    `echo` and `logprobs`, the prompt's log-probabilities as /score gives them.

    `neighbour: true` (memlm) names memorised documents and tokens: it needs read access (a
    read, ingest or admin token; anyone in development), else 401 even where reads are open.
    """
    model = check_model(state, body.model)
    if body.neighbour:
        check_neighbour_access(may_read)
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    echo = bool(body.echo)
    if max_tokens == 0 and not echo:
        raise BadRequest(
            "max_tokens 0 needs echo: it scores the prompt, generates nothing", "max_tokens"
        )
    n_prompts = (
        1 if isinstance(body.prompt, str) or isinstance(body.prompt[0], int) else len(body.prompt)
    )
    check_admission(state, n_prompts, body.n, max_tokens, echo)
    prompts = await read_prompts(state, engine, body.prompt)
    check_sizes(state, engine, prompts, body.n, max_tokens, echo)
    top = body.logprobs or 0
    scores: list[Any] = [None] * len(prompts)
    if echo:
        scores = await score_echo(state, engine, prompts, top, body.neighbour)
    req = _Request(
        id=f"cmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=model,
        prompts=prompts,
        n=body.n,
        echo=echo,
        logprobs=body.logprobs,
        neighbour=body.neighbour,
        scores=scores,
        echo_texts=[
            (p.text if p.text is not None else engine.detokenize(p.ids)) if echo else ""
            for p in prompts
        ],
    )
    choices: list[Choice] = []
    reserved = None
    if max_tokens:
        choices, reserved = await start_choices(
            state, engine, prompts, body.n, _sampling(body, max_tokens)
        )
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _completion_stream(state, engine, req, choices, reserved, usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    if reserved is not None:
        async for _ in run_choices(state, choices, reserved):
            pass
    out = [
        await _whole_choice(state, engine, req, i, choices) for i in range(len(prompts) * body.n)
    ]
    return Completion(
        id=req.id, created=req.created, model=model, choices=out, usage=_usage(req, choices)
    )


def _usage(req: _Request, choices: Sequence[Choice]) -> Usage:
    prompt = sum(len(p.ids) for p in req.prompts)
    made = sum(len(c.tokens) for c in choices)
    return Usage(prompt_tokens=prompt, completion_tokens=made, total_tokens=prompt + made)


async def _whole_choice(
    state: AppState, engine: EngineLike, req: _Request, index: int, choices: Sequence[Choice]
) -> CompletionChoice:
    p = index // req.n
    choice = choices[index] if choices else None
    rows = echo_rows(engine, req.prompts[p], req.scores[p]) if req.echo else []
    if choice is not None:
        rows += generated_rows(choice.tokens)
    text = req.echo_texts[p] + ("" if choice is None else choice.gen.text)
    start = 0 if req.echo else len(req.prompts[p].text or engine.detokenize(req.prompts[p].ids))
    detail = req.logprobs is not None or req.neighbour
    return CompletionChoice(
        text=text,
        index=index,
        logprobs=None if req.logprobs is None else completion_logprobs(rows, start),
        finish_reason=finish_reason(choice),
        memlm=choice_extra(
            state, choice, await token_extras(state, rows, req.neighbour) if detail else None
        ),
    )


async def _completion_stream(
    state: AppState,
    engine: EngineLike,
    req: _Request,
    choices: list[Choice],
    reserved: Any,
    usage: bool,
) -> AsyncIterator[bytes]:
    """The echo of each choice (if asked), then each chunk of tokens as it is made."""
    detail = req.logprobs is not None or req.neighbour
    offsets: dict[int, int] = {}

    async def chunk(
        index: int, text: str, rows: list[Row], choice: Choice | None, last: bool
    ) -> bytes:
        start = offsets.get(index, 0)
        offsets[index] = start + sum(len(r.token) for r in rows)
        extra = await token_extras(state, rows, req.neighbour) if detail else None
        body = Completion(
            id=req.id,
            created=req.created,
            model=req.model,
            choices=[
                CompletionChoice(
                    text=text,
                    index=index,
                    logprobs=None if req.logprobs is None else completion_logprobs(rows, start),
                    finish_reason=finish_reason(choice) if last else None,
                    memlm=choice_extra(state, choice, extra)
                    if last
                    else (ChoiceExtra(tokens=extra) if extra is not None else None),
                )
            ],
        )
        return sse(body.model_dump_json())

    try:
        for index in range(len(req.prompts) * req.n):
            p = index // req.n
            if not req.echo:
                offsets[index] = len(req.prompts[p].text or engine.detokenize(req.prompts[p].ids))
                continue
            rows = echo_rows(engine, req.prompts[p], req.scores[p])
            yield await chunk(index, req.echo_texts[p], rows, None, last=not choices)
        if reserved is not None:
            async for c, tokens in run_choices(state, choices, reserved):
                text = "".join(t.text for t in tokens)
                yield await chunk(c.index, text, generated_rows(tokens), c, c.gen.done)
        if usage:
            body = Completion(
                id=req.id,
                created=req.created,
                model=req.model,
                choices=[],
                usage=_usage(req, choices),
            )
            yield sse(body.model_dump_json())
    except Exception as exc:  # the headers are gone: the error is the last chunk
        yield stream_error(exc)
    finally:  # a client that left before the steps began must not keep the reservation
        if reserved is not None:
            reserved.close()
    yield DONE
