"""LM-only against augmented perplexity of the held-out tokens, per stream day.

The worker records held-out tokens (``memlm.calibrator.heldout``): each one's log p_LM(gold) and
the neighbours found in the memory served when its document arrived, before the
document's own entries joined it. Those waiting for the next build are files under
``calibrator-pending/``; merged ones live in ``calibrator-train.npz`` (the newest
``MEMLM_CALIBRATOR_MAX_TOKENS`` of them). Both are read here; the augmented probability
mixes the recorded neighbours with the interpolation served now (its k, temperature and
lambda, or the calibrator's lambda per token when that is what is served).

The sums per day are additive, so each file's are computed once and cached by its
identity (a pending record never changes; the training set is replaced whole); a new
served interpolation empties the cache.
"""

from __future__ import annotations

import datetime as dt
import threading
from pathlib import Path
from typing import Any

import numpy as np

from memlm.api.dashboard import HeldOut, HeldOutDay
from memlm.calibrator import TOP_N, gold_knn_logprob, token_features
from memlm.calibrator.combined import combine, from_calibrator
from memlm.calibrator.heldout import FIELDS, OPTIONAL_FIELDS
from memlm.knnlm import has_neighbours, interpolate, knn_logprob

EPOCH = dt.date(1970, 1, 1)  # the engine's day numbers count from here (workers.engine)


def augmented_logprobs(rows: dict[str, np.ndarray], served: Any) -> np.ndarray:
    """(n,) log p(gold) of recorded tokens under the served interpolation."""
    params = served.params
    k = min(params.k, rows["values"].shape[1])
    valid = has_neighbours(np.where(rows["values"][:, :k] >= 0, 0, -1))
    knn = gold_knn_logprob(rows, params)
    lam: float | np.ndarray = params.lmbda
    if served.lambda_source in ("evidence", "combined"):
        # records from before the query norm was kept: the constant for those rows
        q = rows.get("qnorm", np.full(len(knn), np.nan))
        ev = served.evidence.lambdas(
            rows["distances"][:, :k],
            rows["values"][:, :k],
            np.nan_to_num(q, nan=1.0),
            params.temperature,
            rows.get("context"),
        )
        lam = np.where(np.isfinite(q), ev, params.lmbda)
    cal = served.calibrator if served.lambda_source in ("calibrator", "combined") else None
    gate = served.gate if served.theta > 0 else None
    if cal is not None or gate is not None:
        width = max(k, TOP_N)
        feats = token_features(
            rows["top_logprob"],
            rows["entropy"],
            rows["lexical"],
            rows["distances"][:, :width],
            rows["values"][:, :width],
        )
        if cal is not None:
            lam_cal = cal.predict({n: feats[n] for n in cal.cfg.features})
            if served.evidence is not None:
                # combined: the larger of the two, each source at its own T
                ev_lam = np.broadcast_to(lam, lam_cal.shape)
                t_cal = served.calibrator_temperature or params.temperature
                temps = np.where(from_calibrator(ev_lam, lam_cal), t_cal, params.temperature)
                knn = knn_logprob(
                    rows["distances"][:, :k],
                    np.where(rows["values"][:, :k] >= 0, 0, -1),
                    rows["values"][:, :k],
                    rows["gold"][:, None],
                    temps,
                )[:, 0]
                lam = combine(ev_lam, lam_cal)
            else:
                lam = lam_cal
        if gate is not None:
            searched = gate.predict({n: feats[n] for n in gate.cfg.features}) >= served.theta
            lam = np.where(searched, lam, 0.0)
            valid = valid & searched
    return interpolate(rows["target_lm_logprob"].astype(np.float64), knn, lam, valid)


def day_sums(rows: dict[str, np.ndarray], served: Any) -> dict[int, np.ndarray]:
    """Per day: [tokens, tokens with a neighbour, sum log p_LM, sum log p_augmented, and
    for the tokens recorded with a seen view (their document's own entries in memory):
    tokens, sum log p_LM, sum log p_augmented]."""
    if not rows or not len(rows["day"]):
        return {}
    keep = rows["doc"] >= 0  # stream documents only (not texts given to train_calibrator)
    rows = {k: v[keep] for k, v in rows.items() if k in FIELDS + OPTIONAL_FIELDS}
    if not len(rows["day"]):
        return {}
    aug = augmented_logprobs(rows, served)
    lm = rows["target_lm_logprob"].astype(np.float64)
    nb = has_neighbours(np.where(rows["values"] >= 0, 0, -1))
    seen = np.zeros(len(lm), bool)
    seen_aug = np.zeros(len(lm))
    if "seen_values" in rows and len(lm):
        seen = rows["seen_values"][:, 0] >= 0
        if seen.any():
            view = {
                **{k: v[seen] for k, v in rows.items()},
                "distances": rows["seen_distances"][seen],
                "values": rows["seen_values"][seen],
            }
            seen_aug[seen] = augmented_logprobs(view, served)
    out = {}
    for day in np.unique(rows["day"]).tolist():
        m = rows["day"] == day
        s = m & seen
        out[int(day)] = np.array(
            [
                m.sum(),
                (nb & m).sum(),
                lm[m].sum(),
                aug[m].sum(),
                s.sum(),
                lm[s].sum(),
                seen_aug[s].sum(),
            ]
        )
    return out


def _stat(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


class HeldOutCurves:
    """Per-file sums cached across polls (one instance per app; thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._served: Any = None
        self._sums: dict[Any, tuple[dict[int, np.ndarray], frozenset[int]]] = {}

    def _file_sums(
        self, key: Any, load: Any, served: Any
    ) -> tuple[dict[int, np.ndarray], frozenset[int]] | None:
        """A file's sums per day and its documents (computed once per file identity)."""
        if key not in self._sums:
            try:
                rows = load()
            except FileNotFoundError:  # merged and deleted by a build meanwhile
                return None
            docs = frozenset(np.unique(rows["doc"]).tolist()) if rows else frozenset()
            self._sums[key] = (day_sums(rows, served), docs)
        return self._sums[key]

    def compute(self, engine: Any, recording: bool) -> HeldOut:
        """``recording``: the service records held-out tokens (the setting; an API process
        beside a separate worker opens its engine read-only, which records nothing itself
        but reads the worker's records from the shared data directory)."""
        calibration = getattr(engine, "calibration", None)
        recorder = getattr(engine, "heldout", None)
        served = getattr(engine, "served", None)
        if calibration is None or recorder is None or served is None:
            return HeldOut(
                tokens=0,
                recording=recording,
                note="this engine keeps no held-out tokens",
                days=[],
            )
        with self._lock:
            if served is not self._served:
                self._served, self._sums = served, {}
            parts: list[dict[int, np.ndarray]] = []
            used: set[Any] = set()
            # (ServedCalibration.training_index is the worker's cache: not called here)
            trained_docs: frozenset[int] = frozenset()
            train_key = ("train", _stat(calibration.train_path))
            if train_key[1] is not None:
                got = self._file_sums(train_key, calibration.training_rows, served)
                if got is not None:
                    parts.append(got[0])
                    trained_docs = got[1]
                    used.add(train_key)
            pending = recorder.pending()
            for path in pending.paths:
                doc = int(path.name.split("-doc")[1].split("-n")[0])
                if doc in trained_docs:  # merged already (a crash before its file went)
                    continue
                key = ("pending", path.name, _stat(path))
                got = self._file_sums(key, lambda p=path: recorder.load([p]), served)
                if got is not None:
                    parts.append(got[0])
                    used.add(key)
            self._sums = {k: v for k, v in self._sums.items() if k in used}
        total: dict[int, np.ndarray] = {}
        for part in parts:
            for day, sums in part.items():
                total[day] = total.get(day, 0) + sums
        p = served.params
        interp = {
            "k": p.k,
            "temperature": p.temperature,
            "lambda": p.lmbda,
            "lambda_source": served.lambda_source,
            "index_version": served.version,
        }
        days = [
            HeldOutDay(
                day=EPOCH + dt.timedelta(days=d),
                tokens=int(s[0]),
                tokens_with_neighbours=int(s[1]),
                lm_ppl=float(np.exp(-s[2] / s[0])),
                augmented_ppl=float(np.exp(-s[3] / s[0])),
                seen_tokens=int(s[4]),
                seen_lm_ppl=float(np.exp(-s[5] / s[4])) if s[4] else None,
                seen_augmented_ppl=float(np.exp(-s[6] / s[4])) if s[4] else None,
            )
            for d, s in sorted(total.items())
            if s[0] > 0
        ]
        note = None
        if not days:
            note = (
                "no held-out tokens recorded yet: the worker records some of each day's "
                "documents as they are ingested"
                if recording
                else "held-out recording is off (MEMLM_CALIBRATOR_TRAINING=false)"
            )
        return HeldOut(
            tokens=sum(d.tokens for d in days),
            recording=recording,
            interpolation=interp,
            note=note,
            days=days,
        )
