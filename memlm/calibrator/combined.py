"""The served combination: lambda = max(lambda_evidence, lambda_calibrator), and who decides.

The evidence model (memlm.calibrator.evidence) carries the text the memory holds: a
near-exact match with agreeing neighbours gets lambda ~ 0.99, which a calibrator trained on
held-out tokens never learns.  The NN calibrator carries held-out text, where its lexical
and LM features know more than a distance: on the slice20 split it serves lambda ~ 0.05-0.1
at relative distances 0.35-0.45, where the evidence's logit has already fallen to ~0.005
(docs/results/slice20-evidence, "Why").  Per token the larger of the two serves, so each
keeps the tokens it knows and neither can switch the other off.

Who decides: at every build the combination is compared with the evidence alone on the
calibrator's own validation tokens (neither model was fitted on them), in both views of
:func:`memlm.calibrator.evidence.views` (held out, and as seen: the same search with the
document's own entries in memory).  It is served only when it gains in one view and loses
in neither, and never without a seen view: the seen view is what protects fresh recall, and
a mean over the two views would let a gain on one hide a loss on the other.  (A tie is
expected in the seen view: where the evidence gives an exact match 0.99 the max is the
evidence's, so the view changes only where the calibrator adds.)

"Loses" in the seen view allows :data:`SEEN_TOLERANCE`: the seen view's NLL is ~0.027 nats
a token (ppl 1.03), and on the 57-day stream the combination cost it 0.0000-0.0005 nats
(0.05% of that ppl, no change of rank for a token at p ~ 0.97) while it took 0.001-0.007 nats
off held-out text; a strict rule kept the evidence alone on 28 of 44 evenings for that
(docs/results/stream57-served).  A seen-view loss counts only when it exceeds the tolerance
or the held-out gain that pays for it; held-out text gets no tolerance.

Temperature: each source keeps the T it was fitted at.  The evidence is fitted (on both
views) at its own T, which the seen view pulls low (an exact own entry wants a sharp p_kNN;
T 1 on the news slice); the calibrator is trained on held-out tokens at the constant's T
(T 2 there), where held-out text wants a flatter p_kNN.  A token whose served lambda is the
evidence's mixes p_kNN at the evidence's T, one whose lambda is the calibrator's at the
calibrator's T: the pair (lambda, T) of the source that decides.  (Mixing one p_kNN at the
evidence's T, the calibrator trained there too, gained almost nothing on held-out news:
docs/results/slice20-served/NOTES.md.)  k is the evidence's for both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from memlm.calibrator.features import TOP_N, token_features
from memlm.knnlm import interpolate, knn_logprob

if TYPE_CHECKING:
    from memlm.calibrator.evidence import EvidenceModel
    from memlm.calibrator.model import Calibrator

VIEWS = ("held-out", "seen")

# nats per token the combination may cost the seen view (text the memory holds: seen ppl at
# most 0.1% higher) when the held-out view gains more than that
SEEN_TOLERANCE = 1e-3


def combine(evidence: np.ndarray, calibrator: np.ndarray) -> np.ndarray:
    """(m,) lambda per token: the larger of the evidence's and the calibrator's."""
    assert evidence.shape == calibrator.shape
    return np.maximum(evidence, calibrator)


def from_calibrator(evidence: np.ndarray, calibrator: np.ndarray) -> np.ndarray:
    """(m,) bool: the tokens whose served lambda is the calibrator's (strictly larger)."""
    return calibrator > evidence


def calibrator_lambdas(
    calibrator: Calibrator,
    top_logprob: np.ndarray,
    entropy: np.ndarray,
    lexical: np.ndarray,
    distances: np.ndarray,
    values: np.ndarray,
) -> np.ndarray:
    """(m,) the calibrator's lambda; distances, values (m, >= 10) sorted search results,
    lexical (m, 2) the statistics' features of each token."""
    feats = token_features(top_logprob, entropy, lexical, distances, values)
    return calibrator.predict({n: feats[n] for n in calibrator.cfg.features})


def view(rows: dict[str, np.ndarray], name: str) -> dict[str, np.ndarray]:
    """The rows of one view: ``held-out`` as recorded, ``seen`` with the seen search (only
    the rows that have one)."""
    if name == "held-out":
        return rows
    if "seen_values" not in rows:
        return {k: v[:0] for k, v in rows.items()}
    has = rows["seen_values"][:, 0] >= 0
    out = {k: v[has] for k, v in rows.items() if len(v) == len(has)}
    out["distances"], out["values"] = out["seen_distances"], out["seen_values"]
    return out


def view_nlls(
    rows: dict[str, np.ndarray],
    evidence: EvidenceModel,
    calibrator: Calibrator,
    k: int,
    temperature: float,
    cal_temperature: float,
) -> dict[str, Any]:
    """Mean NLL of the evidence alone and of the combination on ``rows`` (one view), over
    the tokens with a query norm and a neighbour (the others keep the LM under both).
    ``temperature``: the evidence's T; ``cal_temperature``: the calibrator's, used where
    its lambda is the larger."""
    k = min(k, rows["values"].shape[1])
    q = rows.get("qnorm", np.full(len(rows["gold"]), np.nan))
    use = np.isfinite(q) & (rows["values"][:, 0] >= 0)
    n = int(use.sum())
    if not n:
        return {"tokens": 0, "evidence_nll": None, "combined_nll": None}
    d, v = rows["distances"][use], rows["values"][use]
    ctx = rows["context"][use] if "context" in rows else None
    knn = knn_logprob(
        d[:, :k], np.where(v[:, :k] >= 0, 0, -1), v[:, :k], rows["gold"][use, None], temperature
    )[:, 0]
    lam_ev = evidence.lambdas(d[:, :k], v[:, :k], q[use], temperature, ctx)
    width = max(k, TOP_N)
    lam_cal = calibrator_lambdas(
        calibrator,
        rows["top_logprob"][use],
        rows["entropy"][use],
        rows["lexical"][use],
        d[:, :width],
        v[:, :width],
    )
    lm = rows["target_lm_logprob"][use].astype(np.float64)
    has = np.ones(n, bool)
    ev = -interpolate(lm, knn, lam_ev, has)
    temps = np.where(from_calibrator(lam_ev, lam_cal), cal_temperature, temperature)
    knn_mix = knn_logprob(
        d[:, :k], np.where(v[:, :k] >= 0, 0, -1), v[:, :k], rows["gold"][use, None], temps
    )[:, 0]
    comb = -interpolate(lm, knn_mix, combine(lam_ev, lam_cal), has)
    return {"tokens": n, "evidence_nll": float(ev.mean()), "combined_nll": float(comb.mean())}


def decide(
    rows: dict[str, np.ndarray],
    val: np.ndarray,
    evidence: EvidenceModel,
    calibrator: Calibrator | None,
    k: int,
    temperature: float,
    cal_temperature: float,
) -> dict[str, Any]:
    """Whether the combination serves: its NLL is lower than the evidence's in one view of
    the validation rows ``val`` and no higher in any (the seen view's by at most
    :data:`SEEN_TOLERANCE` and the held-out gain; a seen view with tokens is required).
    ``temperature``: the evidence's T, ``cal_temperature``: the calibrator's.  Returns the
    record saved with the build's choice (``serve``, the two T, the tolerance and the
    per-view NLLs)."""
    if calibrator is None or not rows or not val.any():
        why = "no calibrator" if calibrator is None else "no validation tokens"
        return {"serve": False, "reason": why, "views": {}}
    part = {k_: v[val] for k_, v in rows.items() if len(v) == len(val)}
    per = {
        name: view_nlls(view(part, name), evidence, calibrator, k, temperature, cal_temperature)
        for name in VIEWS
    }
    # never worse in a view, better in at least one: a view where the evidence's lambda is
    # the max on every token (exact matches at 0.99) ties, and a tie alone decides nothing;
    # the seen view may lose SEEN_TOLERANCE where the held-out view gains more than it loses
    gain = {
        n: p["evidence_nll"] - p["combined_nll"] if p["tokens"] else 0.0 for n, p in per.items()
    }
    allowed = {"held-out": 0.0, "seen": min(SEEN_TOLERANCE, max(gain["held-out"], 0.0))}
    lost = [n for n, p in per.items() if p["tokens"] and -gain[n] > allowed[n]]
    won = [n for n, p in per.items() if p["tokens"] and gain[n] > 0]
    reason = None
    if not per["seen"]["tokens"]:
        reason = "no validation token has a seen view"
    elif lost:
        reason = "the evidence alone is better in the " + " and ".join(lost) + " view"
    elif not won:
        reason = "the combination ties the evidence alone in every view"
    return {
        "serve": reason is None,
        "reason": reason,
        "k": k,
        "temperature": temperature,
        "calibrator_temperature": cal_temperature,
        "seen_tolerance": SEEN_TOLERANCE,
        "views": per,
    }
