"""Continuations: ``start_generation`` (the loop itself is :mod:`memlm.generate`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from memlm.calibrator import ServedInterpolation
from memlm.engine.errors import EngineInputError
from memlm.engine.predict import PredictMixin
from memlm.engine.results import Neighbour, _NextToken

if TYPE_CHECKING:
    from memlm.generate import GenerateConfig, Generation


class GenerateMixin(PredictMixin):
    """What :class:`memlm.generate.Generation` uses of the engine, by public names."""

    @property
    def generation_positions(self) -> int:
        """Context plus generated tokens that a continuation may hold (the model's positions)."""
        return self.encoder.max_positions

    def start_generation(self, context: str, cfg: GenerateConfig) -> Generation:
        """Read ``context`` and return the continuation to step (``memlm.generate``)."""
        from memlm.generate import Generation

        ids = self.encoder.tokenize(context)
        if not ids:
            raise EngineInputError("the context is empty after tokenisation")
        if len(ids) + cfg.max_tokens > self.generation_positions:
            raise EngineInputError(
                f"the context has {len(ids)} tokens; with max_tokens {cfg.max_tokens} that "
                f"exceeds the model's {self.generation_positions} positions"
            )
        return Generation.start(self, ids, cfg)

    def next_token(
        self,
        keys: torch.Tensor,
        hidden: torch.Tensor,
        prev: np.ndarray,
        served: ServedInterpolation,
        *,
        lookup: bool = False,
        context: np.ndarray | None = None,
    ) -> _NextToken:
        """The augmented next-token distributions of R rows: keys (R, d), head inputs
        (R, h), their last tokens (R,), tokens of context before each (R,); the same
        computation as ``predict``."""
        return self._next_token(
            keys, hidden, prev, k=served.params.k, lookup=lookup, served=served, context=context
        )

    def nearest(self, nxt: _NextToken, row: int = 0) -> Neighbour | None:
        """The nearest neighbour of a row's search, with its provenance (None if none)."""
        found = self._neighbours(nxt.eids[row], nxt.vals[row], nxt.dist[row], 1)
        return found[0] if found else None
