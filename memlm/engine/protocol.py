"""The engine as the service and the workers see it: exactly the calls they make, with
the real result types (``memlm.engine.results``).

``EngineLike`` lets tests pass the exact fake in ``tests/fakes.py`` and the real
:class:`memlm.engine.Engine` alike; mypy checks both against it (``facade.py`` and
``tests/fakes.py`` assign one to the other), so the fake cannot drift from the engine.
It is generic over the prepared document only: the real one carries the encoder's
outputs, the fake's its words; the workers just hand it back to ``store_document``.
Light: typing only, no model code.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    import numpy as np

    from memlm.engine.generation import FinishReason, GenerateConfig, GeneratedToken
    from memlm.engine.results import ContextFit, IngestResult, Prediction, ScoreResult
    from memlm.knnlm import MemoryOptions
    from memlm.knnlm.policy import Policy
    from memlm.memory import BuildInfo, Committed, Recovered


class PreparedLike(Protocol):
    """What the workers read of a prepared document."""

    @property
    def doc_id(self) -> int: ...

    @property
    def char_spans(self) -> np.ndarray | None:
        """(tokens, 2) character spans, stored with the document (None: unknown)."""
        ...


PreparedT = TypeVar("PreparedT", bound=PreparedLike)


class GenerationLike(Protocol):
    """One continuation in progress (``memlm.engine.generation.Generation``)."""

    index_version: int | None
    context_tokens: int
    seed: int | None
    finish_reason: FinishReason | None

    @property
    def done(self) -> bool: ...

    @property
    def text(self) -> str: ...

    @property
    def stop_matched(self) -> str | None: ...

    def step(self, n: int) -> list[GeneratedToken]: ...


class EngineLike(Protocol[PreparedT]):
    # --- ingest (the worker) -------------------------------------------------------------
    def process_document(
        self,
        doc_id: int,
        text: str,
        day: int,
        *,
        policy: Policy | str | None = None,
        crash_at: str | None = None,
    ) -> IngestResult: ...

    def prepare_document(
        self,
        doc_id: int,
        text: str,
        day: int,
        *,
        policy: Policy | str | None = None,
        next_text: str | None = None,
    ) -> PreparedT: ...

    def store_document(self, prep: PreparedT, *, crash_at: str | None = None) -> IngestResult: ...

    def exclusive(self) -> AbstractContextManager[None]: ...

    def building(self, timeout: float | None = None) -> AbstractContextManager[None]: ...

    def rollback(self, committed: Committed, document: int | None = None) -> int: ...

    def recover(self, committed: Committed) -> Recovered: ...

    def memory_unavailable(self) -> str | None: ...

    def forget_document(
        self, doc_id: int, text: str | None = None, *, entries: range | None = None
    ) -> int: ...

    def hide_documents(self, doc_ids: list[int]) -> int: ...

    # --- builds ---------------------------------------------------------------------------
    def rebuild(self, *, crash_at: str | None = None, retrain: bool = False) -> BuildInfo: ...

    def reload_index(self) -> bool: ...

    def reconcile_index(self, recorded: Collection[int], *, delete: bool = False) -> list[int]: ...

    def sync(self) -> int: ...

    # --- reads (the API) ------------------------------------------------------------------
    def predict(
        self,
        context: str,
        *,
        top_n: int = 10,
        neighbours: int = 0,
        words: int = 0,
        memory: MemoryOptions | None = None,
    ) -> Prediction: ...

    def score(
        self, text: str, *, policy: Policy | str | None = None, memory: MemoryOptions | None = None
    ) -> ScoreResult: ...

    def fit_context(self, context: str, *, long_segments: int = 0) -> ContextFit: ...

    def count_tokens(self, text: str) -> int: ...

    def char_spans(self, text: str) -> np.ndarray: ...

    def stats(self) -> dict[str, Any]: ...

    @property
    def served_version(self) -> int | None: ...

    @property
    def generation_positions(self) -> int: ...

    def start_generation(self, context: str, cfg: GenerateConfig) -> GenerationLike: ...

    # --- token ids (the OpenAI-compatible API) ---------------------------------------------
    @property
    def vocab_size(self) -> int: ...

    def tokenize(self, text: str, *, special: bool = False) -> list[int]: ...

    def detokenize(self, ids: Sequence[int]) -> str: ...

    def token_strings(self, ids: Sequence[int]) -> list[str]: ...

    def tokenizer_info(self) -> dict[str, Any]: ...

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]: ...

    def score_ids(
        self,
        ids: Sequence[int],
        *,
        policy: Policy | str | None = None,
        memory: MemoryOptions | None = None,
        top: int = 0,
        nearest: bool = False,
    ) -> ScoreResult: ...

    def start_generation_ids(self, ids: Sequence[int], cfg: GenerateConfig) -> GenerationLike: ...


__all__ = ["EngineLike", "GenerationLike", "PreparedLike", "PreparedT"]
