"""The engine facade: :class:`Engine`, the operations of its modules on one object."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from memlm.calibrator.constant import MIN_TUNE_TOKENS, SERVED_GRID, TuneGrid
from memlm.calibrator.heldout import HeldOutConfig
from memlm.encoder import BUNDLED_MODEL, Encoder, WindowConfig
from memlm.engine.build import BuildMixin
from memlm.engine.forget import ForgetMixin
from memlm.engine.generation import GenerateMixin
from memlm.engine.ingest import IngestMixin
from memlm.engine.predict import PredictMixin
from memlm.engine.score import ScoreMixin
from memlm.engine.stats import StatsMixin
from memlm.engine.tokens import TokensMixin
from memlm.knnlm import KnnParams
from memlm.knnlm.policy import Policy, make_policy
from memlm.locks import ProcessLock
from memlm.memory import stored_key_precision
from memlm.memory.consolidation import ConsolidationConfig
from memlm.memory.pointers import PointerConfig

if TYPE_CHECKING:
    from memlm.engine.protocol import EngineLike
    from memlm.engine.results import PreparedDocument

log = logging.getLogger(__name__)


class Engine(
    IngestMixin,
    GenerateMixin,
    PredictMixin,
    ScoreMixin,
    BuildMixin,
    ForgetMixin,
    StatsMixin,
    TokensMixin,
):
    """The encoder and the memory of one data directory, with every operation."""

    @classmethod
    def open(
        cls,
        data_dir: Path,
        *,
        model: str = BUNDLED_MODEL,
        knn: KnnParams | None = None,
        policy: str | Policy = "monim",
        delta: float | None = None,
        rate: float = 0.5,
        threads: int | None = None,
        encoder: Encoder | None = None,
        window: WindowConfig | None = None,
        gate_theta: float = 0.0,
        heldout: HeldOutConfig | None = None,
        readonly: bool = False,
        shared: bool = False,
        grid: TuneGrid | None = SERVED_GRID,
        tune_min_tokens: int = MIN_TUNE_TOKENS,
        precision: str = "float32",
        device: str = "cpu",
        memory_url: str | None = None,
        evidence: bool = False,
        consolidation: ConsolidationConfig | None = None,
        rerank_depth: int | None = None,
        ingest_rerank_depth: int | None = None,
        pointers: PointerConfig | None = None,
        build_lock: ProcessLock | None = None,
    ) -> Engine:
        """Load the model (or use ``encoder``) and open the memory under ``data_dir``.

        ``precision="auto"`` keeps the precision an existing datastore's keys were made
        with, and otherwise probes (memlm.encoder.precision); ``device="auto"`` takes CUDA
        when torch sees it.
        """
        if encoder is None and precision == "auto":
            stored = stored_key_precision(memory_url, Path(data_dir))
            if stored is not None:
                log.info("precision auto: %s, the precision of the memory's keys", stored)
                precision = stored
        enc = encoder or Encoder.load(model, threads=threads, precision=precision, device=device)
        pol = make_policy(policy, delta=delta, rate=rate) if isinstance(policy, str) else policy
        return cls(
            Path(data_dir),
            enc,
            knn=knn,
            policy=pol,
            window=window,
            gate_theta=gate_theta,
            heldout=heldout,
            readonly=readonly,
            shared=shared,
            grid=grid,
            tune_min_tokens=tune_min_tokens,
            memory_url=memory_url,
            evidence=evidence,
            consolidation=consolidation,
            rerank_depth=rerank_depth,
            ingest_rerank_depth=ingest_rerank_depth,
            pointers=pointers,
            build_lock=build_lock,
        )


if TYPE_CHECKING:  # mypy checks the engine against the contract the service and workers use

    def _contract(engine: Engine) -> EngineLike[PreparedDocument]:
        return engine
