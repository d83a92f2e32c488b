"""What an index build does with the held-out tokens merged so far.

:func:`retrain` trains the calibrator and the gate for a new index version (warm start
from the newest earlier one) and saves them beside it; :func:`compare` and :func:`choose`
decide whether that version serves the calibrator or the constant tuned on the same
tokens.  Each function takes the training rows (``HeldoutSet.rows()``) and the index root;
:class:`memlm.calibrator.ServedCalibration` calls them with its own.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from memlm.calibrator import evidence as evidence_files
from memlm.calibrator.combined import decide
from memlm.calibrator.model import (
    CALIBRATOR_DIR,
    Calibrator,
    CalibratorConfig,
    gate_config,
    with_prior,
)
from memlm.calibrator.stream import StreamCalibrator, token_rows, training_set, validation_rows
from memlm.knnlm import KnnParams, interpolate

if TYPE_CHECKING:
    from memlm.calibrator.constant import ConstantChoice, TuneGrid

GATE_DIR = "gate"  # beside each index version: v000042/gate/


def saved_versions(root: Path, name: str) -> list[int]:
    """The index versions under ``root`` that hold a saved model ``name``, ascending."""
    return sorted(
        int(p.parent.parent.name[1:]) for p in Path(root).glob(f"v*/{name}/calibrator.json")
    )


def previous(root: Path, name: str, version: int) -> tuple[int, Calibrator] | None:
    """The newest model ``name`` saved below ``version`` and its version, None if none."""
    earlier = [v for v in saved_versions(root, name) if v < version]
    if not earlier:
        return None
    return earlier[-1], Calibrator.load(Path(root) / f"v{earlier[-1]:06d}" / name)


def carry_forward(root: Path, version: int) -> int | None:
    """Copy the newest earlier calibrator and gate beside ``version``; their version."""
    carried = None
    for name in (CALIBRATOR_DIR, GATE_DIR):
        prev = previous(root, name, version)
        target = Path(root) / f"v{version:06d}" / name
        if prev is None or (target / "calibrator.json").exists():
            continue
        prev[1].meta["carried_from"] = prev[0]
        prev[1].save(target)
        carried = prev[0] if name == CALIBRATOR_DIR else carried
    return carried


def compare(
    rows: dict[str, np.ndarray], params: KnnParams, index_root: Path, version: int
) -> dict[str, Any] | None:
    """The calibrator served for ``version`` against the constant ``params`` on the
    calibrator's validation tokens (mean NLL of each); None when there is none.

    k and T of p_kNN are the constant's for both: only lambda differs.
    """
    root = Path(index_root)
    found = previous(root, CALIBRATOR_DIR, version + 1)  # the newest at or below version
    if found is None:
        return None
    cal_v, cal = found
    out: dict[str, Any] = {"calibrator_version": cal_v, "val_tokens": 0}
    none = {**out, "val_nll": None, "constant_val_nll": None, "beats_constant": False}
    if not rows:
        return none
    val = training_set(token_rows(rows, validation_rows(rows, cal.cfg)), params, cal.cfg.features)
    if not len(val):
        return none
    cal_nll = cal.nll(val)
    lam = np.full(len(val), params.lmbda)
    const = -interpolate(
        val.lm_lp.astype(np.float64),
        val.knn_lp.astype(np.float64),
        lam,
        np.ones(len(val), bool),
    )
    const_nll = float(const.mean())
    return {
        **out,
        "val_tokens": len(val),
        "val_nll": _finite(cal_nll),
        "constant_val_nll": const_nll,
        "beats_constant": bool(cal_nll < const_nll),  # strictly: a tie keeps the constant
    }


def choose(
    rows: dict[str, np.ndarray],
    choice: ConstantChoice,
    grid: TuneGrid,
    index_root: Path,
    version: int,
    *,
    evidence: bool = False,
    fitted: tuple[Any, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Record what ``version`` serves (``interpolation.json`` beside it) and return it:
    the constant chosen, and the calibrator instead if it beat it on validation tokens;
    with ``evidence``, the evidence model, and the combination with the calibrator
    (memlm.calibrator.combined) where it beat the evidence alone in both views.  ``fitted``:
    the evidence already fitted on these rows (:func:`fit_evidence`)."""
    from memlm.calibrator.constant import save_choice

    compared = compare(rows, choice.params, index_root, version)
    source = "calibrator" if compared is not None and compared["beats_constant"] else "constant"
    ev_record = None
    if evidence:
        model, ev_record = fit_evidence(rows, choice, grid) if fitted is None else fitted
        ev_record = dict(ev_record)
        evidence_files.save(index_root, version, model, ev_record)
        # the calibrator joins (lambda = max of the two) only where the combination beats
        # the evidence alone in both views of the same validation tokens
        found = previous(Path(index_root), CALIBRATOR_DIR, version + 1)
        val = validation_rows(rows, CalibratorConfig()) if rows else np.zeros(0, bool)
        ev_record["combined"] = decide(
            rows,
            val,
            model,
            None if found is None else found[1],
            int(ev_record["k"]),
            float(ev_record["temperature"]),
            choice.params.temperature,  # the calibrator was trained at the constant's T
        )
        source = "combined" if ev_record["combined"]["serve"] else "evidence"
    record = {
        "index_version": version,
        **choice.to_json(),
        "grid": {
            "ks": list(grid.ks),
            "temperatures": list(grid.temperatures),
            "lambdas": list(grid.lambdas),
        },
        "lambda_source": source,
        "calibrator": compared,
        "evidence": None
        if ev_record is None
        else {k: v for k, v in ev_record.items() if k != "tried"},
    }
    save_choice(index_root, version, record)
    return record


def fit_evidence(
    rows: dict[str, np.ndarray], choice: ConstantChoice, grid: TuneGrid
) -> tuple[Any, dict[str, Any]]:
    """The evidence model of a build, fitted on the held-out tokens outside the
    calibrator's validation split (memlm.calibrator.evidence.choose), and its record."""
    from memlm.calibrator.evidence import PRIOR

    k = choice.params.k
    if not rows or not len(rows.get("gold", ())):
        rec = {"k": k, "temperature": choice.params.temperature, "source": "prior"}
        return PRIOR, {**rec, "reason": "no held-out tokens yet"}
    val = validation_rows(rows, CalibratorConfig())
    return evidence_files.choose(
        rows, k, grid.temperatures, val, default_temperature=choice.params.temperature
    )


def retrain(
    rows: dict[str, np.ndarray],
    params: KnnParams,
    index_root: Path,
    version: int,
    *,
    min_tokens: int = 1,
    cfg: CalibratorConfig | None = None,
    gate: CalibratorConfig | None = None,
) -> dict[str, Any]:
    """Train the calibrator and the gate for ``version`` on the tokens ``rows``.

    Warm start from the newest earlier version: rows merged after it was trained join
    the set and one retrain follows (App. A.3's shrinking epochs); without an earlier
    version each day retrains in turn, as in the evaluation.  Nothing new, or fewer
    than ``min_tokens`` tokens: no training, and the earlier version's models are
    copied beside ``version`` (so pruning old index versions never loses them).
    Returns a JSON-safe report (what the index build record keeps).
    """
    t0 = time.perf_counter()
    cfg = with_prior(cfg or CalibratorConfig(), params)
    gate = with_prior(gate or gate_config(), params)
    root = Path(index_root)
    total = len(rows["day"]) if rows else 0
    prev = previous(root, CALIBRATOR_DIR, version)
    since = -2 if prev is None else int(prev[1].meta.get("index_version", prev[0]))
    fresh = rows["merged_for"] > since if rows else np.zeros(0, bool)
    report: dict[str, Any] = {"training_tokens": total, "new_tokens": int(fresh.sum())}
    reason = None
    if not fresh.any():
        reason = "no new held-out tokens"
    elif total < min_tokens:
        reason = f"{total} held-out tokens, fewer than the {min_tokens} training needs"
    if reason is not None:
        carried = carry_forward(root, version)
        return {**report, "trained": False, "reason": reason, "carried_from": carried}
    new_days = set(rows["day"][fresh].tolist())
    vdir = root / f"v{version:06d}"
    for name, c in ((CALIBRATOR_DIR, cfg), (GATE_DIR, gate)):
        stream = StreamCalibrator(c)
        earlier = previous(root, name, version)
        days = sorted(set(rows["day"].tolist()))
        parts = {
            d: training_set(token_rows(rows, rows["day"] == d), params, c.features) for d in days
        }
        if earlier is None:
            for day in days:
                stream.add_day(parts[day], int(day))
        else:
            model = earlier[1]
            stream.model = model
            stream.first_size = int(model.meta.get("first_size", len(parts[days[0]])))
            stream.versions = int(model.meta.get("version", 0))
            for day in days:
                stream.add_history(parts[day], int(day))
            stream.fit(int(max(new_days)))
        if stream.model is None or not stream.reports:
            continue
        stream.model.meta["index_version"] = version
        stream.model.save(vdir / name)
        last = stream.reports[-1]
        report[name] = {
            "epochs": int(last["epochs"]),
            "best_epoch": int(last["best_epoch"]),
            "val_nll": _finite(last["val_nll"]),
            "train_tokens": int(last["train_tokens"]),
            "val_tokens": int(last["val_tokens"]),
            "warm_start": earlier is not None,
        }
    report.update(trained=CALIBRATOR_DIR in report, seconds=round(time.perf_counter() - t0, 3))
    if not report["trained"]:
        report.update(reason="no held-out token has a neighbour in the memory")
        report["carried_from"] = carry_forward(root, version)
    return report


def _finite(x: float) -> float | None:
    """JSON has no NaN: an empty validation split reports None."""
    return float(x) if math.isfinite(x) else None
