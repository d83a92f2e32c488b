"""Request and response bodies of the HTTP API (pydantic), with OpenAPI examples."""

from __future__ import annotations

import datetime as dt
import math
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from memlm.policy import DELTA_RANGE, POLICY_NAMES, check_policy

DocumentStatus = Literal["pending", "processing", "done", "failed", "forgetting", "forgotten"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorOut(BaseModel):
    """The body of every error answer, whatever its status."""

    model_config = ConfigDict(extra="forbid")

    error: str = Field(
        description="a stable code: bad_request (400), unauthorized (401), not_found (404), "
        "method_not_allowed (405), conflict (409), payload_too_large (413), "
        "validation_error or invalid_input (422), overloaded (429), internal_error (500), "
        "unavailable (503)",
        examples=["validation_error"],
    )
    detail: str = Field(
        description="a message for people; for validation_error, one `location: problem` "
        "clause per problem, joined by '; ' (locations are dotted paths into the body, "
        "e.g. documents.0.text, or the name of a path parameter)",
        examples=["documents.0.text: String should have at least 1 character"],
    )


def check_storable(value: Any, where: str) -> None:
    """Raise ValueError when ``value`` (a JSON value) cannot be stored as-is in both
    databases: PostgreSQL refuses NUL in text and jsonb, a lone surrogate ("\\ud800") is
    not UTF-8, and JSON columns have no NaN or Infinity."""
    if isinstance(value, str):
        if "\x00" in value:
            raise ValueError(f"{where} contains a NUL character (U+0000), which cannot be stored")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                f"{where} contains a lone surrogate; it is not valid Unicode"
            ) from None
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} is {value}; only finite numbers can be stored")
    elif isinstance(value, dict):
        for k, v in value.items():
            check_storable(k, f"{where} key")
            check_storable(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_storable(v, f"{where}.{i}")


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

    @field_validator("text", "source", "external_id", "title", "metadata")
    @classmethod
    def _storable(cls, v: Any, info: ValidationInfo) -> Any:
        check_storable(v, str(info.field_name))
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
    attempts: int = Field(0, description="failed tries so far (a passing error is retried)")
    retry_at: dt.datetime | None = Field(
        None, description="a pending document retried after a failure waits until then"
    )


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
    neighbours: int = Field(
        0, ge=0, description="how many neighbours to return (at most MEMLM_MAX_NEIGHBOURS)"
    )
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
    backend: str = Field(
        "faiss",
        description="the memory that serves: faiss (the embedded files) or milvus "
        "(MEMLM_MEMORY_URL); entries is what it holds",
    )
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
    bytes_reclaimed: int | None = Field(
        None,
        description="datastore bytes that compactions removed (forgotten documents' rows), "
        "cumulative over the data directory's life",
    )
    index: IndexOut
    policy: PolicyOut
    calibrator: CalibratorOut | None = None
    interpolation: InterpolationOut | None = Field(
        None, description="what answers /predict and /score and decides what MoNIM stores"
    )
    device: str | None = Field(None, description="where the encoder runs (MEMLM_DEVICE)")
    precision: str | None = Field(
        None, description="what the encoder's transformer runs in (MEMLM_PRECISION)"
    )


class PolicyIn(Strict):
    policy: str = Field(examples=["monim"], json_schema_extra={"enum": list(POLICY_NAMES)})
    delta: float | None = Field(
        None,
        ge=DELTA_RANGE[0],
        le=DELTA_RANGE[1],
        allow_inf_nan=False,
        examples=[-1.5],
        description="log-probability threshold of monim, monim-amt and monim-kl (the others "
        "take none); null takes the policy's default",
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="randmem: rate (0 to 1) and seed (integer >= 0); the others take none",
    )

    @model_validator(mode="after")
    def _meaningful(self) -> PolicyIn:
        # Unknown params used to stop every ingest (make_policy raised in the worker) and a
        # NaN delta stored nothing at all: refuse both here, before they reach the database.
        check_storable(self.params, "params")
        check_policy(self.policy, self.delta, self.params)
        return self


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
    retrain: bool = Field(
        False,
        description="train the index from scratch; otherwise the build adds the new "
        "entries to the served version and retrains only when the memory grew 4x",
    )

    @field_validator("key")
    @classmethod
    def _storable(cls, v: str | None) -> str | None:
        check_storable(v, "key")
        return v


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
    sizes: dict[str, int] | None = Field(
        None,
        description="bytes_on_disk and bytes_in_ram of the memory right after the build "
        "(the dashboard's memory size over time)",
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
    device: str | None = None  # where the encoder runs
    precision: str | None = None  # what its transformer runs in (auto's choice, if auto)


StatsResponse.model_rebuild()
PredictResponse.model_rebuild()
ScoreResponse.model_rebuild()
