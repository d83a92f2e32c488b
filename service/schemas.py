"""Request and response bodies of the HTTP API (pydantic), with OpenAPI examples."""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from typing_extensions import TypeAliasType

from memlm.policy import DELTA_RANGE

DocumentStatus = Literal["pending", "processing", "done", "failed", "forgetting", "forgotten"]


class Strict(BaseModel):
    """A request body: unknown fields refused, and no lax coercion (``0`` is not
    ``false``, ``"5"`` is not ``5``): what the OpenAPI says is what the server takes."""

    model_config = ConfigDict(extra="forbid", strict=True)


def whole_number(v: Any) -> Any:
    # JSON Schema counts 5.0 as an integer and clients may send one; strict mode would
    # refuse it, so a float without a fractional part becomes an int first.
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


# An integer as JSON Schema means it: 5 and 5.0, never "5" or true.
JsonInt = Annotated[int, BeforeValidator(whole_number)]

# What PostgreSQL can store in text (check_storable): no NUL. Lone surrogates are refused
# too, but a schema string is Unicode text, which has none. Only the schema carries the
# pattern: the validators below say in words what is wrong.
NO_NUL = r"^[^\x00]*$"
# The characters str.isspace() (hence str.strip()) treats as white space, spelt out:
# the \s of ECMA-262 regexes (OpenAPI's dialect) is not the same set as Python's.
SPACE = r"\t-\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
# A document's text: no NUL, and at least one character that is not white space.
TEXT_PATTERN = rf"^[^\x00]*[^\x00{SPACE}][^\x00]*$"
StoredStr = Annotated[str, WithJsonSchema({"type": "string", "pattern": NO_NUL})]


def no_nul(*names: str) -> Callable[[dict[str, Any]], None]:
    """A model's ``json_schema_extra``: these string properties (or their string branch,
    when nullable) get the NO_NUL pattern."""

    def extra(schema: dict[str, Any]) -> None:
        for name in names:
            prop = schema["properties"][name]
            for branch in prop.get("anyOf", [prop]):
                if branch.get("type") == "string":
                    branch["pattern"] = NO_NUL

    return extra


# Any JSON value that can be stored as-is (metadata): strings and keys without NUL.
StoredObject = Annotated[
    dict[str, "StoredJson"], Field(json_schema_extra={"propertyNames": {"pattern": NO_NUL}})
]
StoredJson = TypeAliasType(
    "StoredJson", "StoredObject | list[StoredJson] | StoredStr | int | float | bool | None"
)


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


# RFC 3339 full-date, or date-time (JSON Schema's "date" and "date-time" formats).
_RFC3339 = re.compile(
    r"([0-9]{4}-[0-9]{2}-[0-9]{2})"
    r"(?:[Tt]([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.[0-9]+)?(?:[Zz]|[+-]([0-9]{2}):([0-9]{2})))?"
)


def _published_day(v: Any) -> Any:
    """The date of an RFC 3339 date or date-time string (as written, whatever the offset)."""
    if isinstance(v, dt.datetime):  # Python callers (memlm.client)
        return v.date()
    if not isinstance(v, str):
        return v  # a date passes; anything else is refused by the strict date
    m = _RFC3339.fullmatch(v)
    try:
        if m is None:
            raise ValueError
        day = dt.date.fromisoformat(m[1])
        hour, minute, second, off_h, off_m = (int(x or 0) for x in m.groups()[1:])
        if hour > 23 or minute > 59 or second > 59 or off_h > 23 or off_m > 59:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"published_at {v!r} is not an ISO date (2017-02-07) or date-time "
            "(2017-02-07T10:00:00Z, with its offset)"
        ) from None
    return day


PublishedAt = Annotated[
    dt.date,
    BeforeValidator(_published_day),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "format": "date"},
                {"type": "string", "format": "date-time"},
            ],
            "description": "the day (a date-time counts as the date written in it)",
        }
    ),
]


class DocumentIn(Strict):
    model_config = ConfigDict(json_schema_extra=no_nul("source", "external_id", "title"))

    text: str = Field(
        min_length=1,
        examples=["The central bank raised its key rate on Tuesday."],
        json_schema_extra={"pattern": TEXT_PATTERN},
    )
    published_at: PublishedAt = Field(examples=["2017-02-07"])
    source: str = Field(min_length=1, max_length=200, examples=["www.bbc.com"])
    external_id: str | None = Field(None, min_length=1, max_length=200, examples=["bbc-123"])
    title: str = Field("", max_length=1000, examples=["Rates rise again"])
    metadata: StoredObject = Field(default_factory=dict)

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
        description="evidence (lambda per token from the neighbours' relative distance and "
        "agreement; the default), calibrator (when it beat the evidence on the same validation "
        "tokens) or constant (MEMLM_KNN_LAMBDA set)"
    )
    evidence: dict[str, Any] | None = Field(
        default=None,
        description="the evidence model served: bias, w_dist, w_agree, lambda_max, source "
        "(prior, or fitted at a build) and fitted_tokens (docs/calibrator.md)",
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


class NoParams(Strict):
    """The params of a policy that takes none: an empty object."""


class RandMemParams(Strict):
    """RandMem's params (POLICY_PARAMS["randmem"]); an absent one takes make_policy's default."""

    rate: float = Field(
        0.5, ge=0.0, le=1.0, allow_inf_nan=False, description="the fraction of tokens stored"
    )
    seed: JsonInt = Field(0, ge=0, le=2**63 - 1, description="seeds the random streams")


_DELTA = "log-probability threshold; null takes the policy's default"


class FullMemIn(Strict):
    policy: Literal["fullmem"]
    delta: None = Field(None, description="fullmem takes no delta")
    params: NoParams = Field(default_factory=NoParams)


class RandMemIn(Strict):
    policy: Literal["randmem"]
    delta: None = Field(None, description="randmem takes no delta")
    params: RandMemParams = Field(default_factory=lambda: RandMemParams.model_validate({}))


class MonimIn(Strict):
    policy: Literal["monim", "monim-amt", "monim-kl"] = Field(examples=["monim"])
    delta: float | None = Field(
        None,
        ge=DELTA_RANGE[0],
        le=DELTA_RANGE[1],
        allow_inf_nan=False,
        examples=[-1.5],
        description=_DELTA,
    )
    params: NoParams = Field(default_factory=NoParams)


# One model per policy, told apart by `policy`: the schema states what check_policy
# (memlm.policy) enforces, which delta and which params each policy takes.
PolicyIn = Annotated[FullMemIn | RandMemIn | MonimIn, Field(discriminator="policy")]


def policy_params(body: FullMemIn | RandMemIn | MonimIn) -> dict[str, Any]:
    """The params as stored: only those the request gave."""
    return body.params.model_dump(exclude_unset=True)


class PolicyOut(BaseModel):
    policy: str
    delta: float | None
    params: dict[str, Any]
    updated_at: dt.datetime | None = None


class RebuildRequest(Strict):
    model_config = ConfigDict(json_schema_extra=no_nul("key"))

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
