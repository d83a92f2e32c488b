"""Request and response bodies of the OpenAI-compatible API (``/v1/``): the legacy
completions, chat completions and models, as OpenAI's clients send and read them, and
vLLM's tokenizer endpoints.

A request names every field OpenAI defines for its endpoint; a field memlm cannot honour
is accepted only at its neutral value (``suffix: null``, ``presence_penalty: 0``...) and
refused otherwise, and an unknown field is refused, as OpenAI refuses one: nothing is
silently ignored but ``user``. memlm's own additions are extra fields (``neighbour`` in a
request, ``memlm`` in an answer) that standard clients neither send nor read.
docs/service.md has the field-by-field table.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from memlm.api import NeighbourOut

# OpenAI's own bounds, where memlm has no tighter one.
MAX_TOP_LOGPROBS = 20  # completions' `logprobs` and chat's `top_logprobs` (vLLM's default)
MAX_STOP = 8  # stop strings (memlm's /generate; OpenAI allows 4)
MAX_N = 16  # choices per prompt
# Prompts in one request, and prompts times choices: the admission prices a request by its
# whole cost; this bounds one body's bookkeeping (lm-evaluation-harness sends batch_size)
MAX_CHOICES = 64
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions
# A chat answer's default length: /generate's. OpenAI's runs to the context's end, which a
# base model that never says its end-of-turn token would spend on every unbounded call.
CHAT_DEFAULT_MAX_TOKENS = 32

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Prompt = (
    Annotated[str, Field(min_length=1)]
    | Annotated[
        list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_CHOICES)
    ]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_CHOICES)]
)
Stop = (
    Annotated[str, Field(min_length=1, max_length=100)]
    | Annotated[
        list[Annotated[str, Field(min_length=1, max_length=100)]], Field(max_length=MAX_STOP)
    ]
    | None
)


class OpenAIRequest(BaseModel):
    """Unknown fields refused (OpenAI: "Unrecognized request argument"); no lax coercion."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(OpenAIRequest):
    include_usage: bool | None = Field(
        None, description="a last chunk with `usage` and no choices, before `[DONE]`"
    )
    include_obfuscation: bool | None = Field(
        None, description="accepted and ignored: the chunks carry no obfuscation padding"
    )


# Fields OpenAI defines that memlm cannot honour, and the one value (besides null) each is
# accepted with: the value that changes nothing.
NEUTRAL: dict[str, Any] = {
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": {},
    "suffix": "",
    "tools": [],
    "best_of": 1,
}


def neutral_only(value: Any, info: ValidationInfo) -> Any:
    """Refuse a field memlm cannot honour unless it has its neutral value."""
    neutral = NEUTRAL[str(info.field_name)]
    if value is not None and value != neutral:
        raise ValueError(f"only {neutral!r} (or null) is supported by memlm")
    return value


class SamplingFields(OpenAIRequest):
    """What completions and chat completions share."""

    model: str = Field(min_length=1, description="the served model's id (GET /v1/models)")
    n: int = Field(1, ge=1, le=MAX_N, description="choices per prompt")
    temperature: float | None = Field(
        None,
        ge=0,
        le=2,
        allow_inf_nan=False,
        description="null: 1 (OpenAI's default); 0: greedy (the most probable token)",
    )
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(
        None,
        ge=0,
        le=2**63 - 1 - MAX_N,
        description="choice j of every prompt samples with seed + j",
    )
    stop: Stop = Field(None, description="the text ends before the first of these")
    stream: bool | None = Field(None, description="server-sent events, ending `data: [DONE]`")
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="accepted and ignored")
    frequency_penalty: float | None = Field(
        None, description="0 only", json_schema_extra={"enum": [0, None]}
    )
    presence_penalty: float | None = Field(
        None, description="0 only", json_schema_extra={"enum": [0, None]}
    )
    logit_bias: dict[str, float] | None = Field(
        None, description="{} only", json_schema_extra={"maxProperties": 0}
    )
    neighbour: bool = Field(
        False,
        description="memlm: each token's nearest neighbour in the memory, with provenance "
        "(needs read access)",
    )

    _neutral = field_validator("frequency_penalty", "presence_penalty", "logit_bias")(neutral_only)

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(SamplingFields):
    """POST /v1/completions: OpenAI's legacy completions."""

    # stated for clients: max_tokens 0 (score the prompt, generate nothing) needs echo
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"properties": {"max_tokens": {"not": {"const": 0}}}},
                {"properties": {"echo": {"const": True}}, "required": ["echo"]},
            ]
        }
    )

    prompt: Prompt = Field(
        description="a text, a list of texts, token ids, or a list of token-id lists",
        examples=["The central bank said on Tuesday that"],
    )
    max_tokens: int | None = Field(
        None,
        ge=0,
        description=f"tokens to generate per choice (null: {DEFAULT_MAX_TOKENS}); 0 only with "
        "`echo`: score the prompt",
    )
    echo: bool | None = Field(None, description="the prompt before the completion")
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="log-probabilities of every token, with this many most probable tokens",
    )
    best_of: int | None = Field(
        None,
        description="1 only: each choice is its own best (no ranking of extra samples)",
        json_schema_extra={"enum": [1, None]},
    )
    suffix: str | None = Field(
        None,
        description='"" only: the model does not fill in',
        json_schema_extra={"enum": ["", None]},
    )

    _neutral_suffix = field_validator("suffix", "best_of")(neutral_only)


class TextPart(OpenAIRequest):
    type: Literal["text"]
    text: str


class ChatMessageIn(OpenAIRequest):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] = Field(description="a text, or parts of type text")
    name: str | None = Field(None, description="accepted and ignored")

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(OpenAIRequest):
    type: Literal["text"]


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions: served with the tokenizer's chat template."""

    # stated for clients: top_logprobs above 0 needs logprobs true
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"properties": {"top_logprobs": {"enum": [0, None]}}},
                {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
            ]
        }
    )

    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated name of the next")
    max_completion_tokens: int | None = Field(
        None,
        ge=1,
        description=f"tokens to generate per choice (null: {CHAT_DEFAULT_MAX_TOKENS}, as "
        "/generate; the end-of-turn token ends an answer before)",
    )
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = Field(None, description='{"type": "text"} only')
    tools: list[dict[str, Any]] | None = Field(
        None, description="[] only: no tool calls", json_schema_extra={"maxItems": 0}
    )
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: bool | None = Field(None, description="accepted and ignored")

    _neutral_tools = field_validator("tools")(neutral_only)


# --- answers -----------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TokenExtra(BaseModel):
    """memlm: what the memory did for one token (parallel to ``logprobs.tokens``)."""

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    lm_logprob: float | None = Field(description="under the bare LM (null: the first token)")
    knn_logprob: float | None = Field(
        description="under the memory alone (-1e30: no neighbour holds it)"
    )
    lambda_: float | None = Field(alias="lambda", description="the memory's weight there")
    neighbour: NeighbourOut | None = Field(
        None, description="the nearest entry of the memory (with `neighbour: true`)"
    )


class ChoiceExtra(BaseModel):
    """memlm: how a choice was made (extra: standard clients ignore it)."""

    finish_reason: Literal["length", "stop", "eos"] | None = Field(
        default=None, description="memlm's own: eos (end of text) where OpenAI's says stop"
    )
    stop: str | None = Field(default=None, description="the stop string that ended it")
    seed: int | None = Field(default=None, description="the seed of a sampled choice")
    index_version: str | None = Field(default=None, description="the built index version searched")
    tokens: list[TokenExtra] | None = Field(
        default=None, description="per token, with `logprobs` or `neighbour` asked"
    )


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(
        description="under the served model (the LM with the memory), as /score gives them; "
        "null for a prompt's first token"
    )
    top_logprobs: list[dict[str, float] | None] = Field(
        description="the `logprobs` most probable tokens there, and the token itself"
    )
    text_offset: list[int] = Field(
        description="where each token starts in the prompt followed by the text"
    )


# OpenAI's reasons: the end of text and a stop string are both a stop
FinishReason = Literal["stop", "length"]


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = Field(
        description="null in a stream's chunks before the last of the choice"
    )
    memlm: ChoiceExtra | None = None


class Completion(BaseModel):
    """The answer, and each chunk of a stream."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason
    memlm: ChoiceExtra | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    memlm: ChoiceExtra | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class MemoryInfo(BaseModel):
    """memlm: the memory the model is served with."""

    backend: str = Field(description="faiss or milvus")
    entries: int
    index_version: str | None = None
    max_positions: int = Field(description="prompt plus generated tokens at most")
    chat_template: bool = Field(description="whether /v1/chat/completions can serve it")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "memlm"
    memlm: MemoryInfo


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str = Field(
        description="invalid_request_error, authentication_error, rate_limit_error, "
        "server_error or service_unavailable_error"
    )
    param: str | None = Field(description="the request field at fault")
    code: str | None = Field(description="memlm's error code (model_not_found, ...)")


class OpenAIErrorOut(BaseModel):
    """The body of every error under /v1/, as OpenAI's clients read it."""

    error: OpenAIErrorDetail


# --- the tokenizer endpoints of vLLM's server (lm-evaluation-harness's remote tokenizer) ---


class TokenizeRequest(OpenAIRequest):
    prompt: str = Field(description="the text to tokenise")
    add_special_tokens: bool = Field(
        True,
        description="with the special tokens the tokenizer adds around a text; false: the "
        "ids memlm reads for a prompt (it never adds them)",
    )
    model: str | None = Field(None, description="the served model's id, if given")


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int = Field(description="prompt plus generated tokens at most")


class DetokenizeRequest(OpenAIRequest):
    tokens: list[Annotated[int, Field(ge=0)]]
    model: str | None = Field(None, description="the served model's id, if given")


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int = Field(description="prompt plus generated tokens at most")
