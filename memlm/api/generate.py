"""Bodies of ``POST /generate`` (and of its server-sent events)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from memlm.api.common import JsonInt, Strict, whole_number
from memlm.api.inference import NeighbourOut


class GenerateRequest(Strict):
    context: str = Field(min_length=1, examples=["The central bank said on Tuesday that"])
    max_tokens: JsonInt = Field(
        32, ge=1, description="tokens to generate at most (and at most MEMLM_MAX_GENERATE_TOKENS)"
    )
    temperature: float = Field(
        0.0,
        ge=0,
        le=10,
        allow_inf_nan=False,
        description="0: greedy (the most probable token of the augmented distribution); "
        "above 0: sample from it, sharpened (< 1) or flattened (> 1)",
    )
    top_p: float = Field(
        1.0,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="sampling only: draw from the smallest set of tokens holding this mass",
    )
    # the bounds before the validator: after it (as on `JsonInt | None`) pydantic writes
    # them as "ge"/"le", which JSON Schema ignores
    seed: Annotated[int, Field(ge=0, le=2**63 - 1), BeforeValidator(whole_number)] | None = Field(
        None,
        description="sampling only: the same seed, context and memory give the same text; "
        "null: the server draws one and returns it",
    )
    stop: list[Annotated[str, Field(min_length=1, max_length=100)]] = Field(
        default_factory=list,
        max_length=8,
        description="the text ends before the first of these strings (not returned)",
    )
    neighbour: bool = Field(
        False, description="return each token's nearest neighbour in the memory (provenance)"
    )
    stream: bool = Field(
        False,
        description="answer as server-sent events: one `token` event per token, then one "
        "`done` event (or `error`)",
    )


class GeneratedTokenOut(BaseModel):
    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    token: str = Field(description="the token decoded alone")
    token_id: int
    text: str = Field(
        description="what this token adds to the returned text: the texts of all tokens "
        "add up to `text` (held back while a stop string may be starting)"
    )
    prob: float = Field(description="under the augmented distribution the token was drawn from")
    lm_prob: float = Field(description="under the bare LM")
    knn_prob: float = Field(description="under the memory (kNN) alone")
    lambda_: float = Field(alias="lambda", description="the memory's weight at this step")
    neighbour: NeighbourOut | None = Field(
        None, description="the nearest entry of the memory (when asked for and found)"
    )


FinishReason = Literal["length", "stop", "eos"]


class GenerateDone(BaseModel):
    """The end of a continuation: the `done` event, and the body without its tokens."""

    text: str = Field(description="the continuation, without the stop string")
    finish_reason: FinishReason = Field(
        description="length (max_tokens reached), stop (a stop string), eos (end of text)"
    )
    stop: str | None = Field(None, description="the stop string that ended it")
    seed: int | None = Field(None, description="the seed of a sampled continuation")
    context_tokens: int
    generated_tokens: int
    index_version: str | None = Field(None, description="the built index version searched")


class GenerateResponse(GenerateDone):
    tokens: list[GeneratedTokenOut]
