"""Bodies of `/predict` and `/score` (and the memory options they share)."""

from __future__ import annotations

import datetime as dt

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    model_validator,
)

from memlm.api.common import (
    JsonInt,
    Strict,
)

# --- predict and score -------------------------------------------------------------------


class MemoryOptionsIn(Strict):
    """TRIME local / long-term memory (TRIME Eq. 6): the input's own earlier tokens."""

    model_config = ConfigDict(
        # _tau_needs_memory, stated for clients: tau is null (or absent) unless a memory is on
        json_schema_extra={
            "anyOf": [
                {"properties": {"tau": {"type": "null"}}},
                {"properties": {"local_memory": {"const": True}}, "required": ["local_memory"]},
                {"properties": {"long_memory": {"minimum": 1}}, "required": ["long_memory"]},
            ]
        }
    )

    local_memory: bool = Field(
        False, description="earlier tokens of the same window join the LM softmax (Eq. 6)"
    )
    long_memory: JsonInt = Field(
        0,
        ge=0,
        le=16,
        description="earlier windows of the same text that join it too (implies local memory)",
    )
    tau: float | None = Field(
        None,
        # sim / tau must stay finite in float32: a tau of 5e-324 gave inf scores and NaN
        # probabilities (answered as null); 0.001 is 2000x below the default of 2
        ge=0.001,
        le=100,
        description="temperature of the memory's similarities; null: the server's default",
    )

    @model_validator(mode="after")
    def _tau_needs_memory(self) -> MemoryOptionsIn:
        if self.tau is not None and not (self.local_memory or self.long_memory):
            raise ValueError("tau applies only with local_memory or long_memory")
        return self


class PredictRequest(MemoryOptionsIn):
    context: str = Field(min_length=1, examples=["The prime minister said on Tuesday that"])
    top_n: JsonInt = Field(10, ge=1, le=100)
    neighbours: JsonInt = Field(
        0, ge=0, description="how many neighbours to return (at most MEMLM_MAX_NEIGHBOURS)"
    )
    words: JsonInt = Field(
        0,
        ge=0,
        le=50,
        description="how many whole-word suggestions to return (a short beam search "
        "over the next tokens; 0: none)",
    )


class Suggestion(BaseModel):
    token: str
    token_id: int | None = None
    prob: float = Field(description="interpolated probability")
    lm_prob: float = Field(description="probability under the bare LM")
    knn_prob: float = Field(description="probability under the memory (kNN)")
    trime_prob: float | None = Field(
        None, description="under the LM with local / long-term memory, when asked for"
    )


class WordSuggestionOut(BaseModel):
    word: str = Field(description="the word as it would be appended (leading space included)")
    tokens: list[str] = Field(description="its most probable tokenisation")
    prob: float = Field(description="interpolated probability of the whole word")
    lm_prob: float = Field(description="under the bare LM")
    knn_prob: float = Field(description="under the memory (kNN) alone")


class NeighbourOut(BaseModel):
    """A memorised entry and its provenance: only for callers with read access (401
    otherwise, even where reads are open; docs/service.md)."""

    entry_id: int
    document_id: int
    token: str
    distance: float
    position: int
    title: str | None = None
    published_at: dt.date | None = None
    source: str | None = None
    snippet: str | None = Field(
        default=None,
        description="the document's text around the token, marked [[ ]]; null for a "
        "document being forgotten",
    )


class PredictResponse(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    suggestions: list[Suggestion]
    words: list[WordSuggestionOut] = Field(
        default_factory=list, description="whole-word suggestions (empty unless asked for)"
    )
    lambda_: float = Field(alias="lambda", serialization_alias="lambda")
    neighbours: list[NeighbourOut]
    memory: MemoryOut | None = None
    index_version: str | None = Field(None, description="the built index version searched")
    context_tokens: int = Field(
        description="tokens of the context the model read (its last window, plus "
        "long_memory windows before it)"
    )
    input_tokens: int = Field(description="tokens of the context as sent")
    truncated: bool = Field(
        description="true when the context was longer than what the model reads: its "
        "earlier tokens were dropped"
    )


class MemoryOut(BaseModel):
    local_memory: bool
    long_memory: int
    tau: float


class ScoreRequest(MemoryOptionsIn):
    text: str = Field(min_length=1, examples=["The central bank raised its key rate."])


class ScoreResponse(BaseModel):
    tokens: list[str]
    lm_logprobs: list[float]
    logprobs: list[float]
    lm_ppl: float
    ppl: float
    would_store: list[bool]
    policy: str
    trime_logprobs: list[float] | None = Field(
        None, description="under the LM with local / long-term memory, when asked for"
    )
    trime_ppl: float | None = None
    memory: MemoryOut | None = None


PredictResponse.model_rebuild()
ScoreResponse.model_rebuild()
