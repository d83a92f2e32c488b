"""Request and response bodies of the HTTP API (pydantic), with OpenAPI examples."""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from memlm.settings import POLICIES

DocumentStatus = Literal["pending", "processing", "done", "failed", "forgetting", "forgotten"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- ingest -----------------------------------------------------------------------------


class DocumentIn(Strict):
    text: str = Field(min_length=1, examples=["The central bank raised its key rate on Tuesday."])
    published_at: dt.date = Field(examples=["2017-02-07"])
    source: str = Field(min_length=1, max_length=200, examples=["www.bbc.com"])
    external_id: str | None = Field(None, min_length=1, max_length=200, examples=["bbc-123"])
    title: str = Field("", max_length=1000, examples=["Rates rise again"])
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("text")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("text is empty")
        return v

    @field_validator("published_at", mode="before")
    @classmethod
    def _date_only(cls, v: Any) -> Any:
        # Accept "2017-02-07" and "2017-02-07T10:00:00Z"; reject anything else clearly.
        if isinstance(v, str) and len(v) > 10 and v[10] in "T ":
            try:
                return dt.datetime.fromisoformat(v.replace("Z", "+00:00")).date()
            except ValueError:
                raise ValueError(f"published_at {v!r} is not an ISO date") from None
        return v


class IngestRequest(Strict):
    documents: list[DocumentIn] = Field(min_length=1)

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "documents": [
                        {
                            "text": "The central bank raised its key rate on Tuesday.",
                            "published_at": "2017-02-07",
                            "source": "www.bbc.com",
                            "external_id": "bbc-123",
                            "title": "Rates rise again",
                        }
                    ]
                }
            ]
        },
    )


class AcceptedDocument(BaseModel):
    id: int
    status: DocumentStatus
    duplicate: bool = False


class IngestResponse(BaseModel):
    documents: list[AcceptedDocument]


class DocumentOut(BaseModel):
    id: int
    status: DocumentStatus
    source: str
    external_id: str | None
    title: str
    published_at: dt.date
    metadata: dict[str, Any]
    created_at: dt.datetime | None
    processed_at: dt.datetime | None
    error: str | None
    policy: str | None
    tokens_seen: int | None
    tokens_stored: int | None
    entry_start: int | None
    entry_end: int | None


# --- predict and score -------------------------------------------------------------------


class MemoryOptionsIn(Strict):
    """TRIME local / long-term memory (TRIME Eq. 6): the input's own earlier tokens."""

    local_memory: bool = Field(
        False, description="earlier tokens of the same window join the LM softmax (Eq. 6)"
    )
    long_memory: int = Field(
        0,
        ge=0,
        le=16,
        description="earlier windows of the same text that join it too (implies local memory)",
    )
    tau: float | None = Field(
        None,
        gt=0,
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
    top_n: int = Field(10, ge=1, le=100)
    neighbours: int = Field(0, ge=0, le=100, description="how many neighbours to return")
    words: int = Field(
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
    entry_id: int
    document_id: int
    token: str
    distance: float
    position: int
    title: str | None = None
    published_at: dt.date | None = None
    source: str | None = None
    snippet: str | None = None


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


# --- admin ------------------------------------------------------------------------------


class DayStatOut(BaseModel):
    day: dt.date
    policy: str
    documents: int
    tokens_seen: int
    tokens_stored: int
    entries_forgotten: int
    memrate: float
    cumulative_memrate: float


class IndexOut(BaseModel):
    version: str | None
    built_at: dt.datetime | None
    entries: int | None
    seconds: float | None
    served_version: str | None


class CalibratorOut(BaseModel):
    active: bool = Field(description="a calibrator sets lambda per token (else the constant)")
    index_version: str | None = Field(
        description="the index version whose calibrator is served (the served one or older)"
    )
    trained_for: str | None = Field(description="the index version it was trained for")
    train_tokens: int | None = None
    val_tokens: int | None = None
    gate: bool = Field(description="a retrieval gate is loaded")
    gate_theta: float
    training: bool = Field(description="each rebuild trains it on recorded held-out tokens")
    pending_tokens: int = Field(description="held-out tokens waiting for the next rebuild")


class InterpolationOut(BaseModel):
    index_version: str | None = Field(description="the served index version")
    chosen_for: str | None = Field(
        description="the build whose choice is served (the served version or older; null: "
        "no build chose yet, the default is served)"
    )
    k: int
    temperature: float
    lambda_: float = Field(alias="lambda", description="the constant lambda")
    source: str = Field(
        description="tuned (on the held-out tokens), default (too few of them yet) or fixed "
        "(MEMLM_KNN_K, MEMLM_KNN_TEMPERATURE and MEMLM_KNN_LAMBDA all set)"
    )
    lambda_source: str = Field(
        description="constant, or calibrator when it beat the constant on its validation tokens"
    )
    heldout_tokens: int = Field(description="held-out tokens the choice was made on")
    heldout_ppl: float | None = Field(description="their perplexity with the constant")
    heldout_bare_ppl: float | None = Field(description="their perplexity with the bare LM")
    calibrator_val_ppl: float | None = None
    constant_val_ppl: float | None = None

    model_config = {"populate_by_name": True, "serialize_by_alias": True}


class StatsResponse(BaseModel):
    entries: int = Field(description="live entries in the served memory")
    datastore_entries: int = Field(description="entries on disk, forgotten ones included")
    tokens_seen: int
    tokens_stored: int
    entries_forgotten: int
    memrate: float = Field(description="tokens stored / tokens seen, cumulative")
    per_day: list[DayStatOut]
    documents: dict[str, int]
    bytes_on_disk: int | None
    bytes_in_ram: int | None
    index: IndexOut
    policy: PolicyOut
    calibrator: CalibratorOut | None = None
    interpolation: InterpolationOut | None = Field(
        None, description="what answers /predict and /score and decides what MoNIM stores"
    )


class PolicyIn(Strict):
    policy: str = Field(examples=["monim"])
    delta: float | None = Field(
        None, examples=[-1.5], description="threshold; null takes the policy's default"
    )
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("policy")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in POLICIES:
            raise ValueError(f"unknown policy {v!r}; choose one of {', '.join(POLICIES)}")
        return v


class PolicyOut(BaseModel):
    policy: str
    delta: float | None
    params: dict[str, Any]
    updated_at: dt.datetime | None = None


class RebuildRequest(Strict):
    key: str | None = Field(
        None,
        max_length=100,
        description="idempotency key: the same key twice builds once; "
        "without one the request joins a queued or running build",
    )


class BuildOut(BaseModel):
    id: int
    request_key: str
    requested_by: str
    status: str
    version: str | None
    entries: int | None
    seconds: float | None
    requested_at: dt.datetime | None
    started_at: dt.datetime | None = None
    finished_at: dt.datetime | None
    error: str | None
    params: dict[str, Any] | None = Field(
        None, description="the index's parameters (kind, lists, code size, nprobe, ...)"
    )
    calibrator: dict[str, Any] | None = Field(
        None, description="what training the calibrator for this version did"
    )
    interpolation: dict[str, Any] | None = Field(
        None,
        description="the interpolation this version serves: the constant k, temperature and "
        "lambda chosen on the held-out tokens, and whether the calibrator beat it "
        "(lambda_source)",
    )


class ForgetResponse(BaseModel):
    id: int
    status: DocumentStatus
    entries_forgotten: int


class Health(BaseModel):
    status: str
    model: str | None = None
    index_version: str | None = None
    calibrator_version: str | None = None


StatsResponse.model_rebuild()
PredictResponse.model_rebuild()
ScoreResponse.model_rebuild()
