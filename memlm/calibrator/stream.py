"""Training as the stream goes (App. A.3), and the calibrated evaluation of one policy.

:class:`StreamCalibrator` trains as the stream goes: each day adds that day's held-out
tokens, retrains the previous version (5 epochs at first, fewer as the set grows), keeps
the best epoch on its own validation split, and saves each version.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from memlm.calibrator.features import gold_knn_logprob, split_features
from memlm.calibrator.model import (
    CALIBRATOR_DIR,
    Calibrator,
    CalibratorConfig,
    TrainingSet,
    with_prior,
)
from memlm.knnlm import KnnParams, has_neighbours, interpolate


def with_neighbour(split: dict[str, np.ndarray]) -> np.ndarray:
    """(m,) bool: the tokens with at least one neighbour in their search results."""
    return has_neighbours(np.where(split["values"] >= 0, 0, -1))


def validation_mask(n: int, cfg: CalibratorConfig, salt: int) -> np.ndarray:
    """(n,) bool: seeded blocks of cfg.val_block tokens held out for validation."""
    blocks = -(-n // cfg.val_block) if n else 0
    rng = np.random.default_rng([cfg.seed, salt])
    held = rng.random(blocks) < cfg.val_share
    if blocks >= 2 and cfg.val_share > 0 and not held.any():
        held[rng.integers(blocks)] = True
    if blocks and held.all():  # a day without tokens (none had a neighbour) holds none out
        held[rng.integers(blocks)] = False
    return np.repeat(held, cfg.val_block)[:n]


def epochs_for(cfg: CalibratorConfig, first_size: int, size: int) -> int:
    """App. A.3: max_epochs on the first day, fewer as the set grows, at least min_epochs."""
    if size <= 0:
        return 0
    return max(cfg.min_epochs, min(cfg.max_epochs, round(cfg.max_epochs * first_size / size)))


@dataclass
class StreamCalibrator:
    """A calibrator retrained each day on all held-out tokens seen so far."""

    cfg: CalibratorConfig
    model: Calibrator | None = None
    train_parts: list[TrainingSet] = field(default_factory=list)
    val_parts: list[TrainingSet] = field(default_factory=list)
    first_size: int = 0
    versions: int = 0
    reports: list[dict[str, Any]] = field(default_factory=list)

    def add_history(self, data: TrainingSet, day: int) -> None:
        """Add one day's tokens (split into train / validation) without retraining."""
        held = validation_mask(len(data), self.cfg, salt=day)
        if len(data):
            self.train_parts.append(data.take(np.flatnonzero(~held)))
            self.val_parts.append(data.take(np.flatnonzero(held)))

    def add_day(self, data: TrainingSet, day: int) -> dict[str, Any]:
        """Add one day's tokens (split into train / validation) and retrain."""
        self.add_history(data, day)
        return self.fit(day)

    def fit(self, day: int) -> dict[str, Any]:
        """Retrain on every token added so far (``day``: the newest, for the seed and report)."""
        if not self.train_parts:
            return {"day": day, "trained": False}
        train = TrainingSet.concat(self.train_parts)
        val = TrainingSet.concat(self.val_parts)
        if self.model is None:
            self.model = Calibrator(self.cfg, {n: v.shape[1] for n, v in train.feats.items()})
            self.first_size = len(train)
        self.model.fit_standardisation(train.feats)
        epochs = epochs_for(self.cfg, self.first_size, len(train))
        rep = self.model.train_epochs(train, val, epochs, seed=self.cfg.seed * 1000 + day)
        self.versions += 1
        rep.update(
            {"day": day, "trained": True, "train_tokens": len(train), "val_tokens": len(val)}
        )
        self.model.meta = {"version": self.versions, "first_size": self.first_size, **rep}
        self.reports.append(rep)
        return rep

    def predict(self, feats: dict[str, np.ndarray]) -> np.ndarray:
        """lambda for each token; the untrained calibrator answers cfg.init_lambda."""
        if self.model is None:
            return np.full(len(next(iter(feats.values()))), self.cfg.init_lambda)
        return self.model.predict(feats)


# --- the calibrated evaluation of one policy ----------------------------------------------


@dataclass
class CalibratedResult:
    """Test-token log-probabilities with per-token lambda (and the gate's decisions)."""

    logprobs: np.ndarray  # (m,) augmented log p(gold)
    lambdas: np.ndarray  # (m,) lambda used (0 where skipped or no neighbour)
    searched: np.ndarray  # (m,) bool: the gate let the search happen
    reports: list[dict[str, Any]]
    gate_reports: list[dict[str, Any]]

    @property
    def skipped_share(self) -> float:
        return float(1 - self.searched.mean()) if self.searched.size else 0.0


def training_set(
    split: dict[str, np.ndarray], params: KnnParams, features: Sequence[str]
) -> TrainingSet:
    """The tokens of ``split`` with at least one neighbour, as a calibrator training set."""
    feats = split_features(split)
    valid = with_neighbour(split)
    keep = np.flatnonzero(valid)
    return TrainingSet.build(
        {n: feats[n][keep] for n in features},
        split["target_lm_logprob"][keep],
        gold_knn_logprob(split, params)[keep],
    )


def token_rows(split: dict[str, np.ndarray], mask: np.ndarray) -> dict[str, np.ndarray]:
    """The rows of every per-token array (arrays of another length, e.g. unused ones, go)."""
    return {k: v[mask] for k, v in split.items() if len(v) == len(mask)}


def calibrate_stream(
    dev: dict[str, np.ndarray],
    test: dict[str, np.ndarray],
    params: KnnParams,
    cfg: CalibratorConfig | None = None,
    *,
    gate: CalibratorConfig | None = None,
    theta: float = 0.0,
    save_dir: Path | None = None,
) -> CalibratedResult:
    """Train day by day on dev tokens (days <= d) and score the test tokens of day d.

    Equivalent to training inside the stream: every feature of a day's held-out tokens
    (distances against that evening's index, lexical statistics up to that day) was
    recorded at that time.  ``params`` gives k and T of p_kNN (tuned on dev); with
    ``gate`` and theta > 0 a gate model trained the same way skips the search of tokens
    whose gate lambda is below theta.  ``save_dir``: each version is saved as
    ``save_dir/day-<n>/{calibrator,gate}``.
    """
    cfg = with_prior(cfg or CalibratorConfig(), params)
    stream = StreamCalibrator(cfg)
    gate_stream = StreamCalibrator(with_prior(gate, params)) if gate is not None else None
    test_feats = split_features(test)
    knn_test = gold_knn_logprob(test, params)
    valid_test = with_neighbour(test)
    lam = np.zeros(len(knn_test))
    searched = np.ones(len(knn_test), bool)
    days = sorted(set(dev["day"].tolist()) | set(test["day"].tolist()))
    for day in days:
        on_day = dev["day"] == day
        if on_day.any():
            part = token_rows(dev, on_day)
            stream.add_day(training_set(part, params, cfg.features), day)
            if gate_stream is not None:
                gate_stream.add_day(training_set(part, params, gate_stream.cfg.features), day)
            if save_dir is not None and stream.model is not None:
                stream.model.save(save_dir / f"day-{day}" / CALIBRATOR_DIR)
                if gate_stream is not None and gate_stream.model is not None:
                    gate_stream.model.save(save_dir / f"day-{day}" / "gate")
        rows = np.flatnonzero(test["day"] == day)
        if not len(rows):
            continue
        f = {n: v[rows] for n, v in test_feats.items()}
        lam[rows] = stream.predict({n: f[n] for n in cfg.features})
        if gate_stream is not None and theta > 0:
            g = gate_stream.predict({n: f[n] for n in gate_stream.cfg.features})
            searched[rows] = g >= theta
    use = valid_test & searched
    lam = np.where(use, lam, 0.0)
    lp = interpolate(test["target_lm_logprob"], knn_test, lam, use)
    return CalibratedResult(
        lp, lam, searched, stream.reports, gate_stream.reports if gate_stream else []
    )


def validation_rows(rows: dict[str, np.ndarray], cfg: CalibratorConfig) -> np.ndarray:
    """(n,) bool: the rows a calibrator trained on ``rows`` with ``cfg`` validated on.

    The same split as :meth:`ServedCalibration.retrain` makes: per day, the rows with a
    neighbour, in order, cut by :func:`validation_mask` salted with the day.
    """
    n = len(rows["day"]) if rows else 0
    out = np.zeros(n, bool)
    if not n:
        return out
    valid = with_neighbour(rows)
    for day in sorted(set(rows["day"].tolist())):
        idx = np.flatnonzero((rows["day"] == day) & valid)
        out[idx[validation_mask(len(idx), cfg, salt=int(day))]] = True
    return out
