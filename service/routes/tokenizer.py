"""GET /tokenizer_info, POST /tokenize and POST /detokenize: the served tokenizer, in the
shape of vLLM's server.

lm-evaluation-harness's ``local-completions`` looks for these beside ``/v1/completions``
and, when it finds them, tokenises with the server's own tokenizer: its token counts (the
context length of a log-likelihood) are then the served model's, with no tokenizer to
download. Tokenising needs no model thread: these run on the event loop (short texts) or
the thread pool, never behind the model queue.
"""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from memlm.api.openai import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from service.deps import EngineDep, ReadAuth, State
from service.errors import InvalidRequest, PayloadTooLarge, error_responses
from service.routes.inference import INLINE_CHARS, off_loop_if_long
from service.state import AppState

router = APIRouter(tags=["tokenizer"], dependencies=[ReadAuth])

# Ids decoded on the event loop, at most: about the text INLINE_CHARS are tokenised from
# (news runs at about 4 characters a token).
INLINE_TOKENS = INLINE_CHARS // 4


def _check_model(state: AppState, model: str | None) -> None:
    if model is not None and model != state.settings.model:
        raise InvalidRequest(
            f"model: `{model}` is not served; this server serves `{state.settings.model}`"
        )


@router.get(
    "/tokenizer_info",
    response_model=TokenizerInfo,
    responses=error_responses(401, 503),
    summary="The served tokenizer's special tokens and chat template",
)
def tokenizer_info(engine: EngineDep) -> TokenizerInfo:
    info = engine.tokenizer_info()
    return TokenizerInfo(
        eos_token=info["eos_token"],
        bos_token=info["bos_token"],
        pad_token=info["pad_token"],
        chat_template=info["chat_template"],
        model_max_length=engine.generation_positions,
    )


@router.post(
    "/tokenize",
    response_model=TokenizeResponse,
    responses=error_responses(400, 401, 413, 422, 503),
    summary="A text's token ids under the served tokenizer",
)
async def tokenize(body: TokenizeRequest, state: State, engine: EngineDep) -> TokenizeResponse:
    _check_model(state, body.model)
    limit = state.settings.max_context_chars
    if len(body.prompt) > limit:
        raise PayloadTooLarge(f"prompt has {len(body.prompt)} characters; at most {limit}")
    ids = await off_loop_if_long(
        body.prompt, partial(engine.tokenize, body.prompt, special=body.add_special_tokens)
    )
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=engine.generation_positions)


@router.post(
    "/detokenize",
    response_model=DetokenizeResponse,
    responses=error_responses(400, 401, 413, 422, 503),
    summary="The text of token ids under the served tokenizer",
)
async def detokenize(
    body: DetokenizeRequest, state: State, engine: EngineDep
) -> DetokenizeResponse:
    _check_model(state, body.model)
    vocab = engine.vocab_size
    bad = [t for t in body.tokens if t >= vocab]
    if bad:
        raise InvalidRequest(f"tokens: {bad[0]} is not in the vocabulary (0 to {vocab - 1})")
    if len(body.tokens) <= INLINE_TOKENS:
        return DetokenizeResponse(prompt=engine.detokenize(body.tokens))
    return DetokenizeResponse(prompt=await run_in_threadpool(engine.detokenize, body.tokens))
