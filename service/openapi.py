"""The OpenAPI document: the request bodies exactly as pydantic validates them, with the
limits this server's settings set.

FastAPI passes every schema through its ``OpenAPI`` model, whose bounds are floats: the
seed's maximum 2**63 - 1 became 9.223372036854776e18, i.e. 2**63, which the server
refuses. The request models (memlm/api/) cannot know MEMLM_MAX_GENERATE_TOKENS
and its kin either; the routes enforce them. Both are written in here, so a request the
schema allows is never refused for a rule the schema hid.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from memlm.api import (
    FullMemIn,
    GenerateRequest,
    IngestRequest,
    MonimIn,
    PredictRequest,
    RandMemIn,
    RebuildRequest,
    ScoreRequest,
)
from memlm.api.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from memlm.settings import Settings

# Every request body (with the models they hold, which come along).
REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    IngestRequest,
    PredictRequest,
    ScoreRequest,
    GenerateRequest,
    RebuildRequest,
    FullMemIn,
    RandMemIn,
    MonimIn,
    CompletionRequest,
    ChatCompletionRequest,
    TokenizeRequest,
    DetokenizeRequest,
)


def settings_limits(settings: Settings) -> dict[tuple[str, str], dict[str, Any]]:
    """(model, property) -> the JSON Schema keywords the settings add to it."""
    chars = settings.max_context_chars
    return {
        ("IngestRequest", "documents"): {"maxItems": settings.max_documents_per_request},
        ("DocumentIn", "text"): {"maxLength": settings.max_text_chars},
        ("PredictRequest", "context"): {"maxLength": chars},
        ("PredictRequest", "neighbours"): {"maximum": settings.max_neighbours},
        ("ScoreRequest", "text"): {"maxLength": chars},
        ("GenerateRequest", "context"): {"maxLength": chars},
        ("GenerateRequest", "max_tokens"): {"maximum": settings.max_generate_tokens},
        # the OpenAI-compatible API: the one model served, the generation limit (a string
        # prompt's length applies to the string branch: maxLength ignores the others)
        ("CompletionRequest", "model"): {"enum": [settings.model]},
        ("CompletionRequest", "max_tokens"): {"maximum": settings.max_generate_tokens},
        ("CompletionRequest", "prompt"): {"maxLength": chars},
        ("ChatCompletionRequest", "model"): {"enum": [settings.model]},
        ("TokenizeRequest", "prompt"): {"maxLength": chars},
        ("TokenizeRequest", "model"): {"enum": [settings.model, None]},
        ("DetokenizeRequest", "model"): {"enum": [settings.model, None]},
        ("ChatCompletionRequest", "max_tokens"): {"maximum": settings.max_generate_tokens},
        ("ChatCompletionRequest", "max_completion_tokens"): {
            "maximum": settings.max_generate_tokens
        },
    }


def request_schemas(settings: Settings) -> dict[str, Any]:
    """The components of the request bodies, as pydantic writes them, with the limits."""
    _, top = models_json_schema(
        [(model, "validation") for model in REQUEST_MODELS],
        ref_template="#/components/schemas/{model}",
    )
    defs: dict[str, Any] = top["$defs"]
    for (model, prop), keywords in settings_limits(settings).items():
        defs[model]["properties"][prop].update(keywords)
    return defs


def install_openapi(app: FastAPI, settings: Settings) -> None:
    """Serve FastAPI's OpenAPI with the request components of ``request_schemas``."""
    generate: Callable[[], dict[str, Any]] = app.openapi
    exact = request_schemas(settings)

    def openapi() -> dict[str, Any]:
        spec = generate()  # cached by FastAPI after the first call; the edit is idempotent
        components = spec["components"]["schemas"]
        missing = sorted(set(exact) - set(components))
        assert not missing, f"request models FastAPI does not serve: {missing}"
        components.update(exact)
        return spec

    app.openapi = openapi  # type: ignore[method-assign]
