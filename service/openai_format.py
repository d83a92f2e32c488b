"""OpenAI's shapes for the /v1 routes: its error body, server-sent events, and the per-token
rows (tokens, log-probs, top log-probs, memlm's extras) that completions and chat share."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from memlm.api.openai import (
    ChoiceExtra,
    CompletionLogprobs,
    FinishReason,
    OpenAIErrorOut,
    TokenExtra,
)
from memlm.db.errors import DomainError
from memlm.engine import EngineLike
from memlm.engine.generation import GeneratedToken
from service.completions import (
    Choice,
    ModelNotFound,
    PromptIn,
    finite,
    log_or_floor,
    neighbours_of,
)
from service.errors import error_responses
from service.state import AppState

log = logging.getLogger(__name__)


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


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
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


STREAM = {
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


def sse(data: str) -> bytes:
    return f"data: {data}\n\n".encode()


DONE = sse("[DONE]")


def stream_error(exc: Exception) -> bytes:
    """The last chunk of a stream that failed after its headers were sent."""
    if isinstance(exc, DomainError):
        _, body = openai_error(exc.status_code, exc.error, str(exc), getattr(exc, "param", None))
    else:
        log.exception("a /v1 stream failed half-way", exc_info=exc)
        _, body = openai_error(500, "internal_error", "internal server error", None)
    return sse(json.dumps(body))


def check_model(state: AppState, model: str) -> str:
    served = state.settings.model
    if model != served:
        raise ModelNotFound(f"the model `{model}` does not exist; this server serves `{served}`")
    return served


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


def keep_max(top: dict[str, float], token: str, logprob: float) -> None:
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
            keep_max(top, name, finite(tlp))
        keep_max(top, score.tokens[j], logprob)
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
            keep_max(top, name, log_or_floor(p))
        keep_max(top, t.token, logprob)
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


async def token_extras(state: AppState, rows: Sequence[Row], neighbour: bool) -> list[TokenExtra]:
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


def completion_logprobs(rows: Sequence[Row], offset: int) -> CompletionLogprobs:
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


def finish_reason(choice: Choice | None) -> FinishReason:
    """OpenAI's finish_reason: the end of text is a natural stop."""
    if choice is None:  # an echo without generation: max_tokens (0) reached
        return "length"
    return "length" if choice.gen.finish_reason == "length" else "stop"


def choice_extra(
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
