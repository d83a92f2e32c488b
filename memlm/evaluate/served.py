"""``memlm eval --lambda served``: day by day, exactly what the service's nightly build serves.

Each evening d the dev tokens of the days <= d play the service's held-out training set
(each recorded against its evening's memory, as the ingest worker records them), and the
build's own functions run on them in a scratch index root, in the build's order:
:func:`retrain` trains the calibrator at the constant's k and T (warm start from the
evening before, nothing below ``min_tokens``), and :func:`choose` fits the evidence and
decides whether the combination (memlm.calibrator.combined) beats the evidence alone in
both views.  The test tokens of day
d are then scored by the :class:`ServedInterpolation` that :class:`ServedCalibration` loads
for that version, as ``/score`` would answer them.

The seen view of a dev token (its document's own entries in memory, which held-out dev
documents never are) is made from the document's cached keys with the ingest worker's own
:func:`memlm.engine.ingest.seen_view`, all of the document's tokens stored: the service's
MoNIM adds only the entries its policy keeps.  The constant (k, T, lambda) is chosen each
evening as a build chooses it, over the served grid (``SERVED_GRID``, k <= 64) with the
served default until 1,024 dev tokens have a neighbour, not over the dev grid of the other
modes (k up to 1,024).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from memlm.calibrator import ServedCalibration, ServedInterpolation
from memlm.calibrator.constant import MIN_TUNE_TOKENS, TuneGrid, choose_constant
from memlm.calibrator.features import TOP_N
from memlm.calibrator.retrain import choose, retrain
from memlm.engine.ingest import seen_view
from memlm.evaluate.cache import TokenCache
from memlm.evaluate.plan import DayPlan, day_number
from memlm.knnlm import KnnParams, interpolate, knn_logprob


def with_seen_view(
    dev: dict[str, np.ndarray], plans: Sequence[DayPlan], cache: TokenCache
) -> dict[str, np.ndarray]:
    """``dev`` with ``seen_distances`` / ``seen_values``: each token's search merged with
    its own document's (float16) keys, as the ingest worker records a held-out token."""
    seen_d = np.full(dev["distances"].shape, np.inf, np.float32)
    seen_v = np.full(dev["values"].shape, -1, np.int32)
    for plan in plans:
        dnum = day_number(plan.day)
        for i, o in enumerate(cache.get_many([d.text for d in plan.dev])):
            rows = np.flatnonzero((dev["day"] == dnum) & (dev["doc"] == i))
            assert len(rows) == len(o), "dev rows and the cached document disagree"
            if not len(rows):
                continue
            seen_d[rows], seen_v[rows] = seen_view(
                o.keys.astype(np.float32),
                dev["distances"][rows],
                dev["values"][rows],
                o.keys.astype(np.float16),
                o.targets,
            )
    return {**dev, "seen_distances": seen_d, "seen_values": seen_v}


class EveningBuilds:
    """The service's nightly choice of interpolation, evening after evening, in an index
    root of its own (``root``): what :func:`served_stream` scores the test tokens with, and
    what MoNIM decides with in a ``--lambda served`` run (the service's worker decides
    with what the service serves).  The files stay under ``root``, so a resumed run loads
    the version it had reached with :meth:`load`."""

    def __init__(
        self,
        root: Path,
        vocab_size: int,
        grid: TuneGrid,
        default: KnnParams,
        *,
        min_tokens: int,
    ) -> None:
        self.root = Path(root) / "index"
        self.grid, self.default, self.min_tokens = grid, default, min_tokens
        self.calibration = ServedCalibration(
            Path(root) / "data", vocab_size, default=default, evidence=True
        )
        self.version: int | None = None

    @property
    def served(self) -> ServedInterpolation:
        """What the last build serves (the default and the evidence's prior before one)."""
        return self.calibration.served

    def load(self, version: int) -> None:
        self.calibration.load_for(self.root, version)
        self.version = version

    def build(self, dev: dict[str, np.ndarray], version: int) -> dict[str, Any]:
        """As a build does it (memlm.engine.build) on the held-out rows ``dev`` (with their
        seen view, :func:`with_seen_view`): the constant, the calibrator at its k and T,
        the evidence and the decision; then serve ``version``.  Returns the record."""
        rows = {k: v for k, v in dev.items() if k != "trime"}
        rows["merged_for"] = rows["day"].astype(np.int64)  # each evening merges its own tokens
        choice = choose_constant(rows, self.grid, self.default, min_tokens=MIN_TUNE_TOKENS)
        trained = retrain(rows, choice.params, self.root, version, min_tokens=self.min_tokens)
        record = choose(rows, choice, self.grid, self.root, version, evidence=True)
        self.load(version)
        s = self.served
        return {
            "version": version,
            "lambda_source": s.lambda_source,
            "constant": choice.to_json(),
            "calibrator_trained": trained.get("trained"),
            "calibrator_reason": trained.get("reason"),
            "k": s.params.k,
            "temperature": s.params.temperature,
            "evidence_model": None if s.evidence is None else s.evidence.to_json(),
            "decision": (record.get("evidence") or {}).get("combined"),
        }


def served_stream(
    dev: dict[str, np.ndarray],
    test: dict[str, np.ndarray],
    grid: TuneGrid,
    default: KnnParams,
    vocab_size: int,
    *,
    min_tokens: int,
) -> tuple[np.ndarray, np.ndarray, list[dict[str, Any]]]:
    """Test log-probs and lambdas under each evening's served interpolation, and one record
    per day (what was served: the constant, source, evidence model, the decision's
    per-view NLLs).  ``grid``, ``default``: the service's (the harness passes
    ``SERVED_GRID`` and ``SERVED_DEFAULT`` with the values --k/--temperature fix).

    ``dev`` must carry the seen view (:func:`with_seen_view`); ``test`` rows of a day are
    scored with the build of that evening (dev days <= it)."""
    n = len(test["gold"])
    lp, lam = np.zeros(n), np.zeros(n)
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="memlm-served-") as tmp:
        evenings = EveningBuilds(Path(tmp), vocab_size, grid, default, min_tokens=min_tokens)
        for day in sorted(set(test["day"].tolist())):
            use = dev["day"] <= day
            if use.any() and evenings.version != int(dev["day"][use].max()):
                rows = {k: v[use] for k, v in dev.items() if len(v) == len(use)}
                record = evenings.build(rows, int(dev["day"][use].max()))
                records.append({"day": int(day), **record})
            s = evenings.served
            rows_t = np.flatnonzero(test["day"] == day)
            part = {k: v[rows_t] for k, v in test.items() if len(v) == n}
            got, temps = served_mix(s, part)
            has = part["values"][:, 0] >= 0
            d, v = part["distances"][:, : s.params.k], part["values"][:, : s.params.k]
            knn = knn_logprob(d, np.where(v >= 0, 0, -1), v, part["gold"][:, None], temps)[:, 0]
            lp[rows_t] = interpolate(part["target_lm_logprob"].astype(np.float64), knn, got, has)
            lam[rows_t] = np.where(has, got, 0.0)
    return lp, lam, records


def served_mix(
    s: ServedInterpolation, part: dict[str, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """(lambda, T) of each token of ``part`` (held-out rows: the LM's features, the lexical
    features and a search at least ``max(k, TOP_N)`` wide) under ``s``."""
    width = max(s.params.k, TOP_N)
    return s.mix_of(
        part["top_logprob"],
        part["entropy"],
        part["lexical"],
        part["distances"][:, :width],
        part["values"][:, :width],
        part["qnorm"],
        part.get("context"),
    )
