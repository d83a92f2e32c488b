"""Maintenance: building an index version, compaction, choosing the served
interpolation (constant or calibrator), and which recorded version is served."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection
from dataclasses import fields
from typing import Any

import numpy as np

from memlm.calibrator import TOP_N
from memlm.encoder import TokenOutputs
from memlm.engine.core import EngineCore
from memlm.engine.errors import EngineInputError
from memlm.engine.results import RebuildInfo
from memlm.memory import Compaction, IndexParams
from memlm.memory.consolidation import CONSOLIDATE_CRASH_POINTS, consolidate

log = logging.getLogger(__name__)


class BuildMixin(EngineCore):
    """``rebuild``, ``compact``, ``train_calibrator``, ``reconcile_index``."""

    # --- maintenance ---------------------------------------------------------------------------

    def rebuild(
        self,
        *,
        crash_at: str | None = None,
        params: IndexParams | None = None,
        retrain: bool = False,
    ) -> RebuildInfo:
        """Build a new version of the memory (``MemoryBackend.build``), choose its
        interpolation on the held-out tokens (the constant and the evidence model tuned on
        them, or the calibrator trained on them if it beats them on the same validation
        tokens), serve both. The same on every backend: the interpolation's files live
        beside the version's record.

        faiss: incremental (the served version plus the entries appended since, less the
        compacted ones) unless ``retrain`` or ``build_index``'s rules ask for training;
        Milvus: the collection flushed, compacted and, when the size or ``retrain`` asks,
        indexed again.

        First, when it is on, consolidation (``consolidate``): entries that would not be
        stored today retire, and the memory budget is kept; the compaction then removes
        their rows with the forgotten documents' and the build leaves them out.

        One build at a time per data directory, across processes (``build.lock``).
        ``crash_at``: a consolidation point (``CONSOLIDATE_CRASH_POINTS``) or one of the
        memory's ``build_crash_points``.
        """
        self._check_writer()
        root = self.memory.root
        with self.building():
            self.sync()
            consolidation = self.consolidate(
                crash_at=crash_at if crash_at in CONSOLIDATE_CRASH_POINTS else None
            )
            if crash_at in CONSOLIDATE_CRASH_POINTS:
                crash_at = None
            compaction = self.compact()
            info = self.memory.build(params, retrain=retrain, crash_at=crash_at)
            # ingest goes on during a build (workers.builder): the statistics are saved
            # between two documents, never half-way through one's update
            with self.exclusive(), self._write_lock:
                self.calibration.snapshot(root, info.version)
            report, interpolation = self._calibrate_for(info.version)
            # After the calibrator of the new version is saved (or carried forward): older
            # versions that hold a forgotten document's traces go now, whatever their age.
            if self.memory.deleted_documents:  # (a failed training carried none)
                self.calibration._carry_forward(root, info.version)
            self.memory.prune(keep=3)
        self.reload_index()
        return RebuildInfo(
            **{f.name: getattr(info, f.name) for f in fields(info)},
            calibrator=report,
            compaction=dataclasses.asdict(compaction),
            interpolation=interpolation,
            consolidation=consolidation,
        )

    def consolidate(self, *, crash_at: str | None = None) -> dict[str, Any] | None:
        """Re-test a window of stored entries against today's memory with the constant
        served now, retire those that fail, keep the memory budget
        (``memlm.memory.consolidation``); the usage counts are saved beside the build
        records. Returns the night's report (None when consolidation is off).

        The engine keeps log p_LM of each entry it stored (``self.entry_lm``): the test is
        then exact, as the harness's; where it is unknown (stored before this was kept, by
        another process, or since a crash after the last build) it takes p_LM as 0, a
        lower bound, and the spread budget keeps such an entry last within its day.
        """
        self._check_writer()
        cfg = self.consolidation
        with self.building():
            self.usage.save(self.memory.root)  # the counts so far survive a crash below
            self.entry_lm.save(self.memory.root)
            if not cfg.active:
                return None
            with self.exclusive(), self._write_lock:
                rep = consolidate(
                    self.memory,
                    cfg,
                    self.knn,
                    self.usage,
                    crash_at=crash_at,
                    lm_logprob=self.entry_lm.of,
                )
                if rep.retired["test"] or rep.retired["budget"]:  # their p_LM goes too
                    self.entry_lm.prune(self.memory.live_days()[0])
                    self.entry_lm.save(self.memory.root)
        retired = rep.retired
        if retired["test"] or retired["budget"]:
            log.info(
                "consolidation: %d of %d entries re-tested failed (%d retired), %d retired "
                "for the budget of %s; %d -> %d live",
                rep.failed,
                rep.examined,
                retired["test"],
                retired["budget"],
                cfg.budget,
                rep.live_before,
                rep.live_after,
            )
        return rep.to_json() | {"usage": self.usage.totals()}

    def compact(self, *, crash_at: str | None = None) -> Compaction:
        """Remove forgotten documents' rows from the memory's storage
        (``MemoryBackend.compact``; faiss: ``Datastore.compact``, Milvus: in ``build``).

        Runs under the build lock (the nightly build calls it first) and the memory's
        write lock; ids do not change, so the versions and the database stay valid.
        """
        self._check_writer()
        with self.building(), self.exclusive(), self._write_lock:
            done = self.memory.compact(crash_at=crash_at)
        if done.rows_removed:
            log.info(
                "compaction: %d rows of forgotten documents removed from %d segments, "
                "%d bytes reclaimed",
                done.rows_removed,
                done.segments,
                done.bytes_reclaimed,
            )
        return done

    def _calibrate_for(self, version: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Merge the pending held-out tokens, tune the constant on them, train the
        calibrator of ``version`` with its k and T, record which of the two it serves.

        Returns (calibrator report, interpolation record).  A failure leaves the version
        without ``interpolation.json``: it serves the newest older choice.
        """
        cfg = self.heldout.cfg
        index_root = self.memory.root
        report: dict[str, Any] = {"trained": False, "reason": "calibrator training is off"}
        try:
            if cfg.enabled:
                pending = self.heldout.pending()
                merged = self.calibration.add_heldout(
                    self.heldout.load(pending.paths), version, max_tokens=cfg.max_tokens
                )
                # Deleted only once the merge is durable; a crash in between merges them
                # again, and add_heldout drops the rows of documents it already holds.
                self.heldout.remove(pending.paths)
            choice = self.calibration.choose_constant(self.grid, min_tokens=self.tune_min_tokens)
            if cfg.enabled:
                report = self.calibration.retrain(
                    choice.params, index_root, version, min_tokens=cfg.min_tokens
                )
                report = {"merged_tokens": merged, **report}
            record = self.calibration.choose(choice, self.grid, index_root, version)
        except Exception:  # the index is built and good: serve it with the older choice
            log.exception("choosing the interpolation of index version %d failed", version)
            reason = "training failed (details in the worker log)"
            return {"trained": False, "reason": reason}, {"error": reason}
        log.info("calibrator for index version %d: %s", version, report)
        log.info("interpolation for index version %d: %s", version, record)
        return report, record

    def train_calibrator(self, texts: list[str], day: int) -> dict[str, Any]:
        """Add held-out documents of ``day`` to the calibrator's set, retrain, serve it.

        The calibrator and the gate are saved beside the served index version; processes
        serving that version pick them up on their next ``reload_index``.
        """
        self._check_writer()
        version = self.memory.served_version
        if version is None:
            raise EngineInputError("build an index before training the calibrator")
        outs = [self._encode(t)[1] for t in texts]
        o = TokenOutputs.concat(outs)
        dist, _, vals = self.memory.search(o.keys, max(self.knn.k, TOP_N), depth=self.rerank_depth)
        split: dict[str, np.ndarray] = {
            "target_lm_logprob": o.target_logprob.astype(np.float64),
            "distances": dist,
            "values": vals,
            "day": np.full(len(o), day, np.int32),
            # negative: not stream documents (those have ids >= 0 and are merged once)
            "doc": np.concatenate([np.full(len(x), -1 - i, np.int64) for i, x in enumerate(outs)]),
            "gold": o.targets,
            "top_logprob": o.top_logprob,
            "entropy": o.entropy,
            "lexical": self.calibration.lexical.features(o.prev_tokens),
            "qnorm": (o.keys.astype(np.float64) ** 2).sum(axis=1).astype(np.float32),
            "context": o.positions.astype(np.float32),
        }
        index_root = self.memory.root
        with self.building():  # the training set and the version's files have the build lock
            # k and T of the constant chosen now; the calibrator's lambda competes with it
            choice = self.calibration.choose_constant(self.grid, min_tokens=self.tune_min_tokens)
            report = self.calibration.train(split, choice.params, index_root, version)
            choice = self.calibration.choose_constant(self.grid, min_tokens=self.tune_min_tokens)
            record = self.calibration.choose(choice, self.grid, index_root, version)
        self.calibration.load_for(index_root, version)
        return {**report, "interpolation": record}

    def reconcile_index(self, recorded: Collection[int], *, delete: bool = False) -> list[int]:
        """Serve only index versions the database recorded: the newest of them on disk.

        A version directory no record names (a build killed before its record) is an
        orphan; ``delete`` (a writer, which takes the build lock) also removes orphans and
        points CURRENT back. Returns the orphan versions found, ascending.
        """
        if delete:
            self._check_writer()
            with self.building(timeout=0):
                orphans = self.memory.reconcile(recorded, delete=True)
        else:
            orphans = self.memory.reconcile(recorded, delete=False)
        self.calibration.load_for(self.memory.root, self.memory.served_version)
        return orphans
