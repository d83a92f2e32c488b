"""POST /v1/chat/completions: the completion of the conversation in the model's own chat
template (refused, 400, for a model that ships none; docs/service.md says why), whole or
streamed, with the per-token rows of :mod:`service.openai_format`."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from memlm.api.openai import (
    CHAT_DEFAULT_MAX_TOKENS,
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
    TopLogprob,
    Usage,
)
from memlm.engine import EngineLike
from memlm.engine.generation import GeneratedToken
from service.completions import (
    BadRequest,
    Choice,
    ContextTooLong,
    PromptIn,
    Sampling,
    check_admission,
    check_sizes,
    run_choices,
    start_choices,
)
from service.deps import EngineDep, ReadAccess, State
from service.openai_format import (
    DONE,
    STREAM,
    Row,
    check_model,
    choice_extra,
    finish_reason,
    generated_rows,
    responses,
    sse,
    stream_error,
    token_extras,
)
from service.provenance import check_neighbour_access
from service.state import AppState

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["openai"])


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
    responses={200: STREAM, **responses(400, 401, 404, 413, 429, 503)},
    summary="Chat completions, with the model's own chat template",
)
async def chat_completions(
    body: ChatCompletionRequest, state: State, engine: EngineDep, may_read: ReadAccess
) -> Any:
    """The conversation is written in the tokenizer's chat template and continued as
    /v1/completions continues a prompt; 400 for a model whose tokenizer has none."""
    model = check_model(state, body.model)
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
                finish_reason=finish_reason(c),
                memlm=choice_extra(
                    state, c, await token_extras(state, rows, body.neighbour) if detail else None
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
        return sse(out.model_dump_json())

    logprobs, detail = bool(body.logprobs), bool(body.logprobs or body.neighbour)
    try:
        for c in choices:
            yield chunk(
                ChatChunkChoice(index=c.index, delta=ChatDelta(role="assistant", content=""))
            )
        async for c, tokens in run_choices(state, choices, reserved):
            rows = generated_rows(_answer_tokens(c, tokens))
            extra = await token_extras(state, rows, body.neighbour) if detail else None
            done = c.gen.done
            yield chunk(
                ChatChunkChoice(
                    index=c.index,
                    delta=ChatDelta(content="".join(t.text for t in tokens)),
                    logprobs=_chat_logprobs(rows, body.top_logprobs or 0) if logprobs else None,
                    finish_reason=finish_reason(c) if done else None,
                    memlm=choice_extra(state, c, extra)
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
            yield sse(out.model_dump_json())
    except Exception as exc:  # the headers are gone: the error is the last chunk
        yield stream_error(exc)
    finally:  # a client that left before the steps began must not keep the reservation
        reserved.close()
    yield DONE
