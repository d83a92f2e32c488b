"""What the engine reports about itself (``/admin/stats``, ``/metrics``)."""

from __future__ import annotations

from typing import Any

from memlm.engine.core import EngineCore


class StatsMixin(EngineCore):
    """``stats``: memory, index, served interpolation and calibrator."""

    def _index_ram_bytes(self, idx: dict[str, Any]) -> int:
        """Vectors the served index holds in RAM: float32 for exact parts, codes for PQ."""
        info = self.index._state.info
        fresh = int(idx["fresh_entries"]) * (4 * self.encoder.dim + 8)
        built = int(idx["built_entries"])
        if info is None or info.params.kind == "flat":
            return fresh + built * (4 * self.encoder.dim + 8)
        return fresh + built * (info.params.m + 8)

    def stats(self) -> dict[str, Any]:
        if self.on_milvus:
            return self._stats_milvus()
        ds = self.datastore.stats()
        idx = self.index.stats()
        index_bytes = (
            sum(f.stat().st_size for f in (self.data_dir / "index").rglob("*") if f.is_file())
            if (self.data_dir / "index").exists()
            else 0
        )
        return {
            "backend": "faiss",
            "entries": ds["live_entries"],
            "datastore_entries": ds["entries"],
            "datastore_rows": ds["rows"],
            "deleted_documents": ds["deleted_documents"],
            "bytes_reclaimed": ds["bytes_reclaimed"],
            "bytes_on_disk": ds["bytes_on_disk"] + index_bytes,
            "bytes_in_ram": self._index_ram_bytes(idx),
            "index_version": self.index.version,
            "index": idx,
            "model": self.encoder.name,
            "device": str(self.encoder.device),
            "precision": self.encoder.precision,  # of the transformer (MEMLM_PRECISION)
            "policy": self.policy.name,
            "knn": {"k": self.knn.k, "temperature": self.knn.temperature, "lambda": self.knn.lmbda},
            "interpolation": self.served.to_json(),
            "calibrator": self._calibrator_stats(),
        }

    def _stats_milvus(self) -> dict[str, Any]:
        """The collection's own count and index; no local files hold entries."""
        mem = self.memory.stats()
        return {
            "backend": "milvus",
            "entries": mem["entries"],
            "datastore_entries": mem["entries"],  # no local files: the collection's count
            "bytes_on_disk": None,
            "bytes_in_ram": None,
            "memory": mem,
            "index_version": None,
            "index": mem["index"],
            "model": self.encoder.name,
            "policy": self.policy.name,
            "knn": {"k": self.knn.k, "temperature": self.knn.temperature, "lambda": self.knn.lmbda},
            "interpolation": self.served.to_json(),
            "calibrator": self._calibrator_stats(),
        }

    def _calibrator_stats(self) -> dict[str, Any]:
        """The calibrator beside the served version (the index version it lives beside), its
        training, and whether it sets lambda (``active``: it beat the constant)."""
        served = self.served
        cal = served.calibrator
        meta = cal.meta if cal is not None else {}
        return {
            "active": served.lambda_source == "calibrator",
            "index_version": served.calibrator_version,
            "trained_for": meta.get("index_version"),
            "train_tokens": meta.get("train_tokens"),
            "val_tokens": meta.get("val_tokens"),
            "gate": served.gate is not None,
            "gate_theta": served.theta,
            "training": self.heldout.cfg.enabled,
            "pending_tokens": self.heldout.pending().tokens,
        }
