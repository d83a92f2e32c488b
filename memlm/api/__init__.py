"""The HTTP API's bodies (pydantic), below both the service and the Python client.

The service validates requests and writes answers with them; :mod:`memlm.client`
parses the answers into the same classes, so client and server cannot disagree
about a field. Pydantic only: importing this package loads no model, index or
database code.

One module per part of the API: :mod:`~memlm.api.common` (strict bodies, JSON
integers, storable text, the error body), :mod:`~memlm.api.documents` (ingest,
documents, forget), :mod:`~memlm.api.inference` (``/predict``, ``/score``),
:mod:`~memlm.api.generate` (``/generate``), :mod:`~memlm.api.admin` (stats, policy,
rebuild, builds, health), :mod:`~memlm.api.dashboard` (the dashboard's time series) and
:mod:`~memlm.api.openai` (the OpenAI-compatible ``/v1/`` and the tokenizer endpoints);
the last two are not re-exported here.
"""

from memlm.api.admin import (
    BuildOut,
    CalibratorOut,
    DayStatOut,
    ForgetResponse,
    FullMemIn,
    Health,
    IndexOut,
    InterpolationOut,
    MonimIn,
    NoParams,
    PolicyIn,
    PolicyOut,
    RandMemIn,
    RandMemParams,
    RebuildRequest,
    StatsResponse,
    policy_params,
)
from memlm.api.common import (
    NO_NUL,
    SPACE,
    TEXT_PATTERN,
    DocumentStatus,
    ErrorOut,
    JsonInt,
    StoredJson,
    StoredObject,
    StoredStr,
    Strict,
    check_storable,
    no_nul,
    whole_number,
)
from memlm.api.documents import (
    AcceptedDocument,
    DocumentIn,
    DocumentOut,
    IngestRequest,
    IngestResponse,
    PublishedAt,
)
from memlm.api.generate import (
    FinishReason,
    GenerateDone,
    GeneratedTokenOut,
    GenerateRequest,
    GenerateResponse,
)
from memlm.api.inference import (
    MemoryOptionsIn,
    MemoryOut,
    NeighbourOut,
    PredictRequest,
    PredictResponse,
    ScoreRequest,
    ScoreResponse,
    Suggestion,
    WordSuggestionOut,
)

__all__ = [
    "AcceptedDocument",
    "BuildOut",
    "CalibratorOut",
    "DayStatOut",
    "DocumentIn",
    "DocumentOut",
    "DocumentStatus",
    "ErrorOut",
    "FinishReason",
    "ForgetResponse",
    "FullMemIn",
    "GenerateDone",
    "GenerateRequest",
    "GenerateResponse",
    "GeneratedTokenOut",
    "Health",
    "IndexOut",
    "IngestRequest",
    "IngestResponse",
    "InterpolationOut",
    "JsonInt",
    "MemoryOptionsIn",
    "MemoryOut",
    "MonimIn",
    "NO_NUL",
    "NeighbourOut",
    "NoParams",
    "PolicyIn",
    "PolicyOut",
    "PredictRequest",
    "PredictResponse",
    "PublishedAt",
    "RandMemIn",
    "RandMemParams",
    "RebuildRequest",
    "SPACE",
    "ScoreRequest",
    "ScoreResponse",
    "StatsResponse",
    "StoredJson",
    "StoredObject",
    "StoredStr",
    "Strict",
    "Suggestion",
    "TEXT_PATTERN",
    "WordSuggestionOut",
    "check_storable",
    "no_nul",
    "policy_params",
    "whole_number",
]
