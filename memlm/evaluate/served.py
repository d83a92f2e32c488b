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

from memlm.calibrator import ServedCalibration
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
    dev = {k: v for k, v in dev.items() if k != "trime"}
    dev["merged_for"] = dev["day"].astype(np.int64)  # each evening merges its own tokens
    n = len(test["gold"])
    lp, lam = np.zeros(n), np.zeros(n)
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="memlm-served-") as tmp:
        root = Path(tmp) / "index"
        served = ServedCalibration(Path(tmp) / "data", vocab_size, default=default, evidence=True)
        version: int | None = None
        for day in sorted(set(test["day"].tolist())):
            use = dev["day"] <= day
            if use.any() and version != int(dev["day"][use].max()):
                version = int(dev["day"][use].max())
                rows = {k: v[use] for k, v in dev.items()}
                # as a build does it (memlm.engine.build): the constant, the calibrator at
                # its k and T, the evidence and the decision
                choice = choose_constant(rows, grid, default, min_tokens=MIN_TUNE_TOKENS)
                trained = retrain(rows, choice.params, root, version, min_tokens=min_tokens)
                record = choose(rows, choice, grid, root, version, evidence=True)
                served.load_for(root, version)
                records.append(
                    {
                        "day": int(day),
                        "version": version,
                        "lambda_source": served.served.lambda_source,
                        "constant": choice.to_json(),
                        "calibrator_trained": trained.get("trained"),
                        "calibrator_reason": trained.get("reason"),
                        "k": served.served.params.k,
                        "temperature": served.served.params.temperature,
                        "evidence_model": None
                        if served.served.evidence is None
                        else served.served.evidence.to_json(),
                        "decision": (record.get("evidence") or {}).get("combined"),
                    }
                )
            s = served.served
            rows_t = np.flatnonzero(test["day"] == day)
            part = {k: v[rows_t] for k, v in test.items() if len(v) == n}
            width = max(s.params.k, TOP_N)
            got, temps = s.mix_of(
                part["top_logprob"],
                part["entropy"],
                part["lexical"],
                part["distances"][:, :width],
                part["values"][:, :width],
                part["qnorm"],
                part.get("context"),
            )
            has = part["values"][:, 0] >= 0
            d, v = part["distances"][:, : s.params.k], part["values"][:, : s.params.k]
            knn = knn_logprob(d, np.where(v >= 0, 0, -1), v, part["gold"][:, None], temps)[:, 0]
            lp[rows_t] = interpolate(part["target_lm_logprob"].astype(np.float64), knn, got, has)
            lam[rows_t] = np.where(has, got, 0.0)
    return lp, lam, records
