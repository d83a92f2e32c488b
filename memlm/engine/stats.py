"""What the engine reports about itself (``/admin/stats``, ``/metrics``)."""

from __future__ import annotations

from typing import Any

from memlm.engine.core import EngineCore
from memlm.memory.consolidation import read_last


class StatsMixin(EngineCore):
    """``stats``: memory, index, served interpolation and calibrator."""

    def stats(self) -> dict[str, Any]:
        """The memory's own figures (``MemoryBackend.stats``) and what the engine serves."""
        return {
            **self.memory.stats(),
            "index_version": self.served_version,
            "model": self.encoder.name,
            "device": str(self.encoder.device),
            "precision": self.encoder.precision,  # of the transformer (MEMLM_PRECISION)
            "policy": self.policy.name,
            "knn": {"k": self.knn.k, "temperature": self.knn.temperature, "lambda": self.knn.lmbda},
            "interpolation": self.served.to_json(),
            "calibrator": self._calibrator_stats(),
            "consolidation": self._consolidation_stats(),
        }

    def _consolidation_stats(self) -> dict[str, Any]:
        """The memory budget, what the last build's consolidation retired and why, and the
        usage counts so far (``/admin/stats`` and the dashboard)."""
        cfg = self.consolidation
        return {
            "sample": cfg.sample,
            "budget": cfg.budget,
            "criterion": cfg.criterion,
            "recent": cfg.spread_recent,
            "last": read_last(self.memory.root),
            "usage": self.usage.totals(),
            "entry_lm": {"entries": len(self.entry_lm), "bytes": self.entry_lm.nbytes()},
        }

    def _calibrator_stats(self) -> dict[str, Any]:
        """The calibrator beside the served version (the index version it lives beside), its
        training, and whether it sets lambda (``active``: it beat the constant)."""
        served = self.served
        cal = served.calibrator
        meta = cal.meta if cal is not None else {}
        return {
            "active": served.uses_calibrator,
            "index_version": served.calibrator_version,
            "trained_for": meta.get("index_version"),
            "train_tokens": meta.get("train_tokens"),
            "val_tokens": meta.get("val_tokens"),
            "gate": served.gate is not None,
            "gate_theta": served.theta,
            "training": self.heldout.cfg.enabled,
            "pending_tokens": self.heldout.pending().tokens,
        }
