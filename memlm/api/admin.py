"""Bodies of the admin API: stats, policy, rebuild, builds and health."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
)

from memlm.api.common import (
    DocumentStatus,
    JsonInt,
    Strict,
    check_storable,
    no_nul,
)
from memlm.knnlm.policy import DELTA_RANGE

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
        "agreement; the default), combined (the larger of the evidence's and the NN "
        "calibrator's lambda per token, where that beat the evidence alone in both views of "
        "the same validation tokens), constant (MEMLM_KNN_LAMBDA set) or calibrator "
        "(MEMLM_KNN_LAMBDA set and it beat the constant)"
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


class ConsolidationOut(BaseModel):
    """The memory budget and what the last build's consolidation retired, and why."""

    sample: int = Field(description="stored entries re-tested at each build (0: none)")
    budget: int | None = Field(description="live entries a build keeps at most (None: none)")
    criterion: str = Field(
        description="what the budget retires first: age, usage, redundancy, random, spread"
    )
    recent: float | None = Field(
        None,
        description="spread: the share of the budget kept for the newest entries, whole "
        "(the older days are thinned to the same size each); None for the other criteria",
    )
    last: dict[str, Any] | None = Field(
        None,
        description="the last night: examined, failed, retired per reason (test: would not "
        "be stored today; budget), cursor, live before and after, seconds",
    )
    usage: dict[str, int] = Field(
        description="retrievals and hits counted per block of entries while ingesting"
    )
    entry_lm: dict[str, int] = Field(
        default_factory=dict,
        description="the log p_LM kept per stored entry (entries, bytes in RAM): the spread "
        "budget's order within a day and the exact re-test",
    )


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
    consolidation: ConsolidationOut | None = Field(
        None, description="the memory budget and what consolidation retired (issue 35)"
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
# (memlm.knnlm.policy) enforces, which delta and which params each policy takes.
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
    consolidation: dict[str, Any] | None = Field(
        None,
        description="what the consolidation before this build retired, per reason (test, "
        "budget), the budget and the cursor",
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
