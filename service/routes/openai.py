"""The OpenAI-compatible API: GET /v1/models, POST /v1/completions, POST /v1/chat/completions.

Thin: a route parses the OpenAI request, runs it through :mod:`service.completions` (the
paths of /score and /generate, admitted as they are) and writes OpenAI's answer, whole or
as server-sent events (``data: <chunk>`` lines ending with ``data: [DONE]``). Errors under
/v1/ have OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``, so OpenAI's
clients raise their typed exceptions; 429 and 503 keep Retry-After. docs/service.md has the
field-by-field table of what is supported, ignored and refused.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import StreamingResponse

from memlm.api.openai import (
    CHAT_DEFAULT_MAX_TOKENS,
    DEFAULT_MAX_TOKENS,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    ChoiceExtra,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    FinishReason,
    MemoryInfo,
    ModelCard,
    ModelList,
    OpenAIErrorOut,
    TokenExtra,
    TopLogprob,
    Usage,
)
from memlm.db.errors import DomainError
from memlm.engine import EngineLike
from memlm.engine.generation import GeneratedToken
from service.completions import (
    BadRequest,
    Choice,
    ContextTooLong,
    ModelNotFound,
    PromptIn,
    Sampling,
    check_admission,
    check_sizes,
    finite,
    log_or_floor,
    neighbours_of,
    read_prompts,
    run_choices,
    score_echo,
    start_choices,
)
from service.deps import EngineDep, ReadAccess, ReadAuth, State
from service.errors import error_responses, install_error_shape
from service.provenance import check_neighbour_access
from service.state import AppState

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["openai"])

PREFIX = "/v1/"
_STARTED = int(time.time())  # a model's `created`: when this process started serving it


# --- errors ------------------------------------------------------------------------------

_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


def openai_error(
    status: int, error: str, detail: Any, param: str | None
) -> tuple[int, dict[str, Any]]:
    """memlm's error as OpenAI writes it. 422 (the body does not validate) becomes 400, the
    status OpenAI's clients raise ``BadRequestError`` for; ``code`` is memlm's error code."""
    if status == 422:
        status = 400
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    message = detail if isinstance(detail, str) else json.dumps(detail)
    return status, {"error": {"message": message, "type": kind, "param": param, "code": error}}


def install(app: FastAPI) -> None:
    """The routes, and OpenAI's error body for every error under /v1/."""
    app.include_router(router)
    install_error_shape(app, PREFIX, openai_error)


def _responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` of a /v1 route: these statuses (and 500), and any other client
    error (a 405...), all with OpenAI's error body. The range also stands for the 422 that
    FastAPI would declare with its own body: /v1 answers a body that does not validate 400."""
    out = error_responses(*statuses, 500)
    out["4XX"] = {"description": "any other client error"}
    for status, response in out.items():
        response["model"] = OpenAIErrorOut
        if status == 400:
            response["description"] = (
                "the body does not validate or asks for what memlm cannot serve (`param` "
                "names the field, `code` says why: validation_error, invalid_request, "
                "context_length_exceeded...)"
            )
    return out


_STREAM = {
    "description": "with `stream: true`: server-sent events without an event name, `data: "
    '<chunk>` (the answer\'s shape, with the new text) per step, `data: {"error": ...}` on '
    "a failure after the first byte, then `data: [DONE]`",
    # the schema of one event, as schemathesis (and OpenAPI 3.2's itemSchema) reads a stream
    "content": {
        "text/event-stream": {
            "schema": {
                "type": "object",
                "required": ["data"],
                "properties": {
                    "event": {"type": "string", "enum": ["message"]},
                    "data": {"type": "string", "description": "a chunk's JSON, or [DONE]"},
                },
            }
        }
    },
}


def _sse(data: str) -> bytes:
    return f"data: {data}\n\n".encode()


DONE = _sse("[DONE]")


def _stream_error(exc: Exception) -> bytes:
    """The last chunk of a stream that failed after its headers were sent."""
    if isinstance(exc, DomainError):
        _, body = openai_error(exc.status_code, exc.error, str(exc), getattr(exc, "param", None))
    else:
        log.exception("a /v1 stream failed half-way", exc_info=exc)
        _, body = openai_error(500, "internal_error", "internal server error", None)
    return _sse(json.dumps(body))


def _check_model(state: AppState, model: str) -> str:
    served = state.settings.model
    if model != served:
        raise ModelNotFound(f"the model `{model}` does not exist; this server serves `{served}`")
    return served


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
    responses=_responses(401, 429, 503),
    summary="The served model, with its memory (OpenAI's models list)",
)
async def list_models(state: State, engine: EngineDep) -> ModelList:
    return ModelList(data=[await _card(state, engine)])


@router.get(
    "/models/{model:path}",
    response_model=ModelCard,
    dependencies=[ReadAuth],
    responses=_responses(401, 404, 429, 503),
    summary="One model (only the served one exists)",
)
async def get_model(model: str, state: State, engine: EngineDep) -> ModelCard:
    _check_model(state, model)
    return await _card(state, engine)


# --- per-token rows, shared by completions and chat ------------------------------------------


@dataclass(frozen=True)
class Row:
    """One token of an answer: its log-probability, the most probable tokens there, and
    what the memory did (memlm's extras)."""

    token: str
    logprob: float | None  # None: a prompt's first token (nothing predicts it)
    top: dict[str, float] | None
    lm: float | None
    knn: float | None
    lam: float | None
    found: Any = None  # the engine's Neighbour, when asked for


def _keep_max(top: dict[str, float], token: str, logprob: float) -> None:
    # two ids can decode to one string (pieces of a character): the dict keeps the larger
    top[token] = max(top.get(token, logprob), logprob)


def echo_rows(engine: EngineLike, prompt: PromptIn, score: Any) -> list[Row]:
    """The prompt's tokens as ``score_ids`` scored them (the first one has nothing)."""
    rows = [Row(engine.token_strings(prompt.ids[:1])[0], None, None, None, None, None)]
    if score is None:
        return rows
    for j, lp in enumerate(score.logprobs):
        logprob = finite(float(lp))
        top: dict[str, float] = {}
        for _, name, tlp in score.top[j] if score.top else []:
            _keep_max(top, name, finite(tlp))
        _keep_max(top, score.tokens[j], logprob)
        rows.append(
            Row(
                score.tokens[j],
                logprob,
                top,
                finite(float(score.lm_logprobs[j])),
                finite(float(score.knn_logprobs[j])),
                float(score.lambdas[j]),
                score.nearest[j] if score.nearest else None,
            )
        )
    return rows


def generated_rows(tokens: Sequence[GeneratedToken]) -> list[Row]:
    """Generated tokens under the distribution each was drawn from (before temperature)."""
    rows = []
    for t in tokens:
        logprob = log_or_floor(t.prob)
        top: dict[str, float] = {}
        for _, name, p in t.top:
            _keep_max(top, name, log_or_floor(p))
        _keep_max(top, t.token, logprob)
        rows.append(
            Row(
                t.token,
                logprob,
                top,
                log_or_floor(t.lm_prob),
                log_or_floor(t.knn_prob),
                t.lam,
                t.neighbour,
            )
        )
    return rows


async def _extras(state: AppState, rows: Sequence[Row], neighbour: bool) -> list[TokenExtra]:
    found = await neighbours_of(state, [r.found for r in rows]) if neighbour else []
    return [
        TokenExtra(
            lm_logprob=r.lm,
            knn_logprob=r.knn,
            **{"lambda": r.lam},
            neighbour=found[i] if neighbour else None,
        )
        for i, r in enumerate(rows)
    ]


def _completion_logprobs(rows: Sequence[Row], offset: int) -> CompletionLogprobs:
    offsets = []
    for r in rows:
        offsets.append(offset)
        offset += len(r.token)
    return CompletionLogprobs(
        tokens=[r.token for r in rows],
        token_logprobs=[r.logprob for r in rows],
        top_logprobs=[r.top for r in rows],
        text_offset=offsets,
    )


def _finish(choice: Choice | None) -> FinishReason:
    """OpenAI's finish_reason: the end of text is a natural stop."""
    if choice is None:  # an echo without generation: max_tokens (0) reached
        return "length"
    return "length" if choice.gen.finish_reason == "length" else "stop"


def _choice_extra(
    state: AppState, choice: Choice | None, tokens: list[TokenExtra] | None
) -> ChoiceExtra:
    if choice is None:
        return ChoiceExtra(
            finish_reason="length", index_version=state.served_version, tokens=tokens
        )
    gen = choice.gen
    version = gen.index_version
    return ChoiceExtra(
        finish_reason=gen.finish_reason,
        stop=gen.stop_matched,
        seed=gen.seed,
        index_version=None if version is None else str(version),
        tokens=tokens,
    )


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
    responses={200: _STREAM, **_responses(400, 401, 404, 413, 429, 503)},
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
    model = _check_model(state, body.model)
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
        logprobs=None if req.logprobs is None else _completion_logprobs(rows, start),
        finish_reason=_finish(choice),
        memlm=_choice_extra(
            state, choice, await _extras(state, rows, req.neighbour) if detail else None
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
        extra = await _extras(state, rows, req.neighbour) if detail else None
        body = Completion(
            id=req.id,
            created=req.created,
            model=req.model,
            choices=[
                CompletionChoice(
                    text=text,
                    index=index,
                    logprobs=None if req.logprobs is None else _completion_logprobs(rows, start),
                    finish_reason=_finish(choice) if last else None,
                    memlm=_choice_extra(state, choice, extra)
                    if last
                    else (ChoiceExtra(tokens=extra) if extra is not None else None),
                )
            ],
        )
        return _sse(body.model_dump_json())

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
            yield _sse(body.model_dump_json())
    except Exception as exc:  # the headers are gone: the error is the last chunk
        yield _stream_error(exc)
    finally:  # a client that left before the steps began must not keep the reservation
        if reserved is not None:
            reserved.close()
    yield DONE


# --- chat completions --------------------------------------------------------------------------


def _chat_logprobs(rows: Sequence[Row], top: int) -> ChatLogprobs:
    def entry(token: str, logprob: float) -> TopLogprob:
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))

    content = []
    for r in rows:
        assert r.logprob is not None and r.top is not None
        best = sorted(r.top.items(), key=lambda kv: -kv[1])[:top]
        content.append(
            ChatTokenLogprob(
                **entry(r.token, r.logprob).model_dump(),
                top_logprobs=[entry(t, lp) for t, lp in best],
            )
        )
    return ChatLogprobs(content=content)


def _answer_tokens(choice: Choice, tokens: Sequence[GeneratedToken]) -> list[GeneratedToken]:
    """The tokens of the assistant's message: the end-of-turn token is not one."""
    if tokens and choice.gen.finish_reason == "eos" and tokens[-1] is choice.tokens[-1]:
        return list(tokens[:-1])
    return list(tokens)


@router.post(
    "/chat/completions",
    response_model=ChatCompletion,
    responses={200: _STREAM, **_responses(400, 401, 404, 413, 429, 503)},
    summary="Chat completions, with the model's own chat template",
)
async def chat_completions(
    body: ChatCompletionRequest, state: State, engine: EngineDep, may_read: ReadAccess
) -> Any:
    """The conversation is written in the tokenizer's chat template and continued as
    /v1/completions continues a prompt; 400 for a model whose tokenizer has none."""
    model = _check_model(state, body.model)
    if body.neighbour:
        check_neighbour_access(may_read)
    if body.top_logprobs and not body.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    if not engine.tokenizer_info().get("chat_template"):
        raise BadRequest(
            f"the model `{model}` has no chat template (a base LM): use /v1/completions",
            "messages",
        )
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    chars = sum(len(m["content"]) for m in messages)
    if chars > state.settings.max_context_chars:
        raise ContextTooLong(
            f"the messages have {chars} characters; at most {state.settings.max_context_chars} "
            "(MEMLM_MAX_CONTEXT_CHARS)",
            "messages",
        )
    max_tokens = body.max_completion_tokens or body.max_tokens or CHAT_DEFAULT_MAX_TOKENS
    check_admission(state, 1, body.n, max_tokens, echo=False)
    ids = engine.chat_ids(messages)
    prompt = PromptIn(ids, None)
    check_sizes(state, engine, [prompt], body.n, max_tokens, echo=False)
    sampling = Sampling(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=body.seed,
        stop=body.stops(),
        top=body.top_logprobs or 0,
        neighbour=body.neighbour,
    )
    choices, reserved = await start_choices(state, engine, [prompt], body.n, sampling)
    ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    logprobs = bool(body.logprobs)
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _chat_stream(
                state, engine, ident, created, model, len(ids), choices, reserved, body, usage
            ),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    async for _ in run_choices(state, choices, reserved):
        pass
    out = []
    for c in choices:
        rows = generated_rows(_answer_tokens(c, c.tokens))
        detail = logprobs or body.neighbour
        out.append(
            ChatChoice(
                index=c.index,
                message=ChatMessageOut(content=c.gen.text),
                logprobs=_chat_logprobs(rows, sampling.top) if logprobs else None,
                finish_reason=_finish(c),
                memlm=_choice_extra(
                    state, c, await _extras(state, rows, body.neighbour) if detail else None
                ),
            )
        )
    made = sum(len(c.tokens) for c in choices)
    return ChatCompletion(
        id=ident,
        created=created,
        model=model,
        choices=out,
        usage=Usage(prompt_tokens=len(ids), completion_tokens=made, total_tokens=len(ids) + made),
    )


async def _chat_stream(
    state: AppState,
    engine: EngineLike,
    ident: str,
    created: int,
    model: str,
    prompt_tokens: int,
    choices: list[Choice],
    reserved: Any,
    body: ChatCompletionRequest,
    usage: bool,
) -> AsyncIterator[bytes]:
    def chunk(choice: ChatChunkChoice) -> bytes:
        out = ChatCompletionChunk(id=ident, created=created, model=model, choices=[choice])
        return _sse(out.model_dump_json())

    logprobs, detail = bool(body.logprobs), bool(body.logprobs or body.neighbour)
    try:
        for c in choices:
            yield chunk(
                ChatChunkChoice(index=c.index, delta=ChatDelta(role="assistant", content=""))
            )
        async for c, tokens in run_choices(state, choices, reserved):
            rows = generated_rows(_answer_tokens(c, tokens))
            extra = await _extras(state, rows, body.neighbour) if detail else None
            done = c.gen.done
            yield chunk(
                ChatChunkChoice(
                    index=c.index,
                    delta=ChatDelta(content="".join(t.text for t in tokens)),
                    logprobs=_chat_logprobs(rows, body.top_logprobs or 0) if logprobs else None,
                    finish_reason=_finish(c) if done else None,
                    memlm=_choice_extra(state, c, extra)
                    if done
                    else (ChoiceExtra(tokens=extra) if extra is not None else None),
                )
            )
        if usage:
            made = sum(len(c.tokens) for c in choices)
            out = ChatCompletionChunk(
                id=ident,
                created=created,
                model=model,
                choices=[],
                usage=Usage(
                    prompt_tokens=prompt_tokens,
                    completion_tokens=made,
                    total_tokens=prompt_tokens + made,
                ),
            )
            yield _sse(out.model_dump_json())
    except Exception as exc:  # the headers are gone: the error is the last chunk
        yield _stream_error(exc)
    finally:  # a client that left before the steps began must not keep the reservation
        reserved.close()
    yield DONE
