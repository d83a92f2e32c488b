"""Lambda from retrieval evidence: trust the memory where it holds the context, per token.

One constant lambda cannot serve both text the memory holds and text it does not: tuned on
held-out tokens (which the memory has, by construction, not seen) it learns "do not trust
the memory" and switches it off for the text a user just ingested too.  Following
Drozdov et al. 2022 (lambda by retrieval quality) and He et al. 2021 (retrieve where it
helps), lambda here follows the evidence of each query:

    s     = sqrt(d_1 / |q|^2)        relative L2 distance to the nearest neighbour
    agree = p_kNN(value of the nearest neighbour)   (at the served k and T)
    short = 1 - min(log(context tokens) / log(64), 1)   (1 for one token, 0 from 64 on)
    lambda = lambda_max * sigmoid(bias + w_dist * s + w_agree * log(agree) + w_short * short)

``s`` is on the scale of the query itself, so the same prior reads any model's keys
(the kNN key is the input of the last MLP, right after a norm layer: |q|^2 varies by
+-10% for SmolLM2-135M, 80-112 over news, held-out and unrelated text).  Three numbers
and a cap, with a prior measured on SmolLM2-135M (docs/calibrator.md, "Lambda from
retrieval evidence"): an exact copy of the context (s ~ 0) whose neighbours agree gets
lambda ~ 0.99; a paraphrase's name tokens (s ~ 0.2-0.35) 0.1-0.9; unrelated text (s >=
0.5) below 0.002.  Every build refits the three numbers (MAP, the prior as a Gaussian
around them) on the held-out tokens the worker recorded, each seen twice: as held out
(searched before its document joined the memory) and as seen (the same search with the
document's own stored entries in memory: the case of a user asking about what they just
ingested, which held-out tokens never show).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from memlm.knnlm import neighbour_log_weights

EVIDENCE_FILE = "evidence.json"  # beside each index version: v000042/evidence.json
# lambda never reaches 1: an exact copy of a context that went on differently (two
# articles with the same lead) then costs at most log(100) on that token, not all of it
LAMBDA_MAX = 0.99
# agreement floor inside the log (one neighbour value among 1,000 equal ones)
AGREE_MIN = 1e-3
# contexts of this many tokens or more count as long (the shortness feature is 0)
SHORT_TOKENS = 64
# relative distances beyond this are all "far" (keeps the logit bounded for odd keys)
S_MAX = 2.0


@dataclass(frozen=True)
class EvidenceModel:
    """lambda = lambda_max * sigmoid(bias + w_dist * s + w_agree * log(agree) + w_short * short)."""

    # Prior: from 42 ingested articles (8.8k entries) of the bundled news, SmolLM2-135M,
    # T 2 (docs/calibrator.md): the best lambda was 0.999 on exact copies, 0.3-0.9 for
    # paraphrases at s 0.17-0.32, 0.005-0.1 for held-out news at s 0.3-0.45, and 0 for
    # unrelated text (s >= 0.5); logit lambda is close to linear in s over that range.
    # Agreement weighs little (2): held-out news at s 0.3-0.4 wants lambda ~0.1 whatever
    # the agreement (benchmarks/evidence_prior.py); 6 cost 0.3-0.6% on the news slice.
    bias: float = 6.0
    w_dist: float = -25.0
    w_agree: float = 2.0
    # A context of a few tokens ("The", "A new") is shared by many documents that go on
    # differently: its near match is no evidence.  -6 at one token, -3 at eight, 0 at 64.
    w_short: float = -6.0
    lambda_max: float = LAMBDA_MAX
    source: str = "prior"  # "prior" | "fitted"
    fitted_tokens: int = 0  # held-out rows (each counted once) behind a fit

    @property
    def theta(self) -> np.ndarray:
        return np.array([self.bias, self.w_dist, self.w_agree, self.w_short], np.float64)

    def lambdas(
        self,
        distances: np.ndarray,
        values: np.ndarray,
        qnorm: np.ndarray,
        temperature: float,
        context: np.ndarray | None = None,
    ) -> np.ndarray:
        """(n,) lambda of each query; 0 where it has no neighbour.

        distances, values: (n, k) squared L2 and next tokens, values -1 for padding;
        qnorm: (n,) squared L2 norm of each query key; context: (n,) tokens of context
        before the predicted token (None: long contexts).
        """
        if not len(values):
            return np.zeros(0)
        s, agree = features(distances, values, qnorm, temperature)
        lam = self.from_features(s, agree, shortness(context, len(values)))
        return lam * (values[:, 0] >= 0)

    def from_features(
        self, s: np.ndarray, agree: np.ndarray, short: np.ndarray | float = 0.0
    ) -> np.ndarray:
        z = (
            self.bias
            + self.w_dist * s
            + self.w_agree * np.log(np.maximum(agree, AGREE_MIN))
            + self.w_short * short
        )
        return self.lambda_max / (1.0 + np.exp(-z))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> EvidenceModel:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in names})


PRIOR = EvidenceModel()
# Standard deviations of the Gaussian prior around PRIOR's (bias, w_dist, w_agree), and
# its weight in held-out tokens: 512 tokens of data move a parameter by about one sd.
PRIOR_SD = np.array([2.0, 8.0, 4.0, 3.0])
PRIOR_TOKENS = 512
# starting points of the fit's agreement weight (None: the prior's own)
START_AGREE: tuple[float | None, ...] = (None, 6.0, 0.5)


def shortness(context: np.ndarray | None, n: int) -> np.ndarray:
    """(n,) 1 - min(log(context) / log(64), 1): 1 for a context of one token, 0 from 64
    tokens on (and where the context length is unknown: records from before it was kept)."""
    if context is None:
        return np.zeros(n)
    c = np.asarray(context, np.float64)
    out = 1.0 - np.minimum(np.log(np.maximum(c, 1.0)) / math.log(SHORT_TOKENS), 1.0)
    return np.where(np.isfinite(c), out, 0.0)


def features(
    distances: np.ndarray, values: np.ndarray, qnorm: np.ndarray, temperature: float
) -> tuple[np.ndarray, np.ndarray]:
    """(s, agree) of each query: relative distance to the nearest, and the kNN share of
    the nearest neighbour's value (neighbours sorted by distance, -1 values pad)."""
    n = len(values)
    if n == 0:
        return np.zeros(0), np.zeros(0)
    valid = values >= 0
    d1 = np.where(valid[:, 0], np.maximum(distances[:, 0].astype(np.float64), 0.0), np.inf)
    q = np.maximum(np.asarray(qnorm, np.float64), 1e-12)
    s = np.minimum(np.sqrt(d1 / q), S_MAX)
    w = np.exp(neighbour_log_weights(distances, np.where(valid, 0, -1), temperature))
    agree = (w * (values == values[:, :1])).sum(axis=1)
    return s, np.where(valid[:, 0], agree, 0.0)


def fit(
    rows: dict[str, np.ndarray],
    k: int,
    temperature: float,
    *,
    prior: EvidenceModel = PRIOR,
    steps: int = 200,
) -> tuple[EvidenceModel, float]:
    """MAP fit of (bias, w_dist, w_agree) on held-out rows; returns the model and its mean
    NLL on them.  ``rows``: a :func:`views` result (target_lm_logprob, distances, values,
    gold, qnorm, and ``weight`` per row)."""
    import torch

    from memlm.knnlm import knn_logprob

    k = min(k, rows["values"].shape[1])
    d, v = rows["distances"][:, :k], rows["values"][:, :k]
    s, agree = features(d, v, rows["qnorm"], temperature)
    short = shortness(rows.get("context"), len(s))
    knn = knn_logprob(d, np.where(v >= 0, 0, -1), v, rows["gold"][:, None], temperature)[:, 0]
    has = v[:, 0] >= 0
    wt = rows["weight"] * has
    total = float(wt.sum())
    if total <= 0:
        return prior, float("nan")
    t = lambda a: torch.as_tensor(a, dtype=torch.float64)  # noqa: E731
    agree = np.log(np.maximum(agree, AGREE_MIN))
    sh_t = t(short[has])
    s_t, a_t, lm_t, knn_t, w_t = (
        t(s[has]),
        t(agree[has]),
        t(rows["target_lm_logprob"][has]),
        t(knn[has]),
        t(wt[has] / total),
    )
    theta0, sd = t(prior.theta), t(PRIOR_SD)
    log_max = math.log(prior.lambda_max)
    penalty = PRIOR_TOKENS / max(total, 1.0)

    def nll(theta: torch.Tensor) -> torch.Tensor:
        z = theta[0] + theta[1] * s_t + theta[2] * a_t + theta[3] * sh_t
        log_lam = log_max + torch.nn.functional.logsigmoid(z)
        log_1m = torch.log1p(-torch.exp(log_lam))
        mix = torch.logaddexp(log_1m + lm_t, log_lam + knn_t)
        return -(w_t * mix).sum()

    def objective(theta: torch.Tensor) -> torch.Tensor:
        return nll(theta) + 0.5 * penalty * (((theta - theta0) / sd) ** 2).sum()

    # The mixture NLL is not convex in theta: from the prior alone LBFGS stays in the
    # prior's basin (on the news slice w_agree stayed at 5.8 where 1.0 fits clearly
    # better), so it also starts from weaker agreement weights and keeps the best.
    best: tuple[float, torch.Tensor] | None = None
    for w_agree in START_AGREE:
        theta = theta0.clone()
        if w_agree is not None:
            theta[2] = w_agree
        theta.requires_grad_(True)
        opt = torch.optim.LBFGS([theta], lr=0.5, max_iter=steps, line_search_fn="strong_wolfe")

        def closure(theta: torch.Tensor = theta, opt: Any = opt) -> torch.Tensor:
            opt.zero_grad()
            loss = objective(theta)
            loss.backward()
            return loss

        opt.step(closure)
        with torch.no_grad():
            obj = float(objective(theta))
        if math.isfinite(obj) and (best is None or obj < best[0]):
            best = (obj, theta.detach().clone())
    if best is None:
        return prior, float("nan")
    with torch.no_grad():
        value = float(nll(best[1]))
    b, wd, wa, ws = (float(x) for x in best[1])
    if not all(math.isfinite(x) for x in (b, wd, wa, ws, value)):
        return prior, float("nan")
    fitted = replace(
        prior,
        bias=b,
        w_dist=wd,
        w_agree=wa,
        w_short=ws,
        source="fitted",
        fitted_tokens=int(has.sum()),
    )
    return fitted, value


def views(rows: dict[str, np.ndarray], *, seen_share: float = 0.5) -> dict[str, np.ndarray]:
    """Held-out rows as the fit reads them: each token once as held out and, where its
    record has one, once as seen (its document's own entries in memory).

    The two views share ``seen_share`` of the weight so that neither regime (known text,
    unseen text) is decided by how many tokens of each happen to be recorded.  Rows
    without a query norm (recorded before it was kept) are left out.
    """
    rows = {**rows, "qnorm": rows.get("qnorm", np.full(len(rows["gold"]), np.nan))}
    ok = np.isfinite(rows["qnorm"])
    rows.setdefault("context", np.full(len(rows["gold"]), np.nan))
    base = {
        k: rows[k][ok]
        for k in ("target_lm_logprob", "distances", "values", "gold", "qnorm", "context")
    }
    n = int(ok.sum())
    seen_ok = (
        rows["seen_values"][ok][:, 0] >= 0 if "seen_values" in rows and n else np.zeros(n, bool)
    )
    m = int(seen_ok.sum())
    if m == 0:
        return {**base, "weight": np.ones(n)}
    width = min(base["values"].shape[1], rows["seen_values"].shape[1])
    seen = {
        "target_lm_logprob": base["target_lm_logprob"][seen_ok],
        "distances": rows["seen_distances"][ok][seen_ok][:, :width],
        "values": rows["seen_values"][ok][seen_ok][:, :width],
        "gold": base["gold"][seen_ok],
        "qnorm": base["qnorm"][seen_ok],
        "context": base["context"][seen_ok],
    }
    out = {
        k: np.concatenate([base[k][:, :width] if base[k].ndim == 2 else base[k], seen[k]])
        for k in base
    }
    out["weight"] = np.concatenate(
        [np.full(n, (1 - seen_share) / n), np.full(m, seen_share / m)]
    ) * (n + m)
    out["seen"] = np.concatenate([np.zeros(n, bool), np.ones(m, bool)])
    return out


def save(index_root: Path, version: int, model: EvidenceModel, record: dict[str, Any]) -> Path:
    """Write a version's ``evidence.json`` atomically (temp + ``os.replace``)."""
    from memlm.calibrator.constant import save_version_json

    return save_version_json(
        index_root, version, EVIDENCE_FILE, {"model": model.to_json(), **record}
    )


def load(index_root: Path, version: int | None) -> tuple[int, EvidenceModel, dict[str, Any]] | None:
    """The newest ``evidence.json`` at or below ``version``: (its version, model, record)."""
    from memlm.calibrator.constant import load_version_json

    found = load_version_json(index_root, version, EVIDENCE_FILE)
    if found is None:
        return None
    v, rec = found
    return v, EvidenceModel.from_json(rec.pop("model")), rec


def nll(rows: dict[str, np.ndarray], model: EvidenceModel, k: int, temperature: float) -> float:
    """Weighted mean NLL of the gold tokens of :func:`views` rows under ``model`` (rows
    without a neighbour keep the LM)."""
    from memlm.knnlm import interpolate, knn_logprob

    if not len(rows["gold"]):
        return float("nan")
    k = min(k, rows["values"].shape[1])
    d, v = rows["distances"][:, :k], rows["values"][:, :k]
    knn = knn_logprob(d, np.where(v >= 0, 0, -1), v, rows["gold"][:, None], temperature)[:, 0]
    lam = model.lambdas(d, v, rows["qnorm"], temperature, rows.get("context"))
    lp = interpolate(rows["target_lm_logprob"].astype(np.float64), knn, lam, v[:, 0] >= 0)
    return float(-(rows["weight"] * lp).sum() / rows["weight"].sum())


def subset(rows: dict[str, np.ndarray], mask: np.ndarray) -> dict[str, np.ndarray]:
    """The rows of a held-out set (one entry per token) where ``mask`` holds."""
    return {k: v[mask] for k, v in rows.items() if len(v) == len(mask)}


def choose(
    rows: dict[str, np.ndarray],
    k: int,
    temperatures: tuple[float, ...],
    val: np.ndarray,
    *,
    default_temperature: float,
) -> tuple[EvidenceModel, dict[str, Any]]:
    """Fit the evidence on the rows outside ``val`` for each temperature; keep the one with
    the lowest validation NLL (both views), or the prior when it is as good or there is
    nothing to fit.  Returns the model and the record saved beside the version."""
    has_q = np.isfinite(rows["qnorm"]) if "qnorm" in rows else np.zeros(len(rows["gold"]), bool)
    train_rows, val_rows = views(subset(rows, has_q & ~val)), views(subset(rows, has_q & val))
    rec: dict[str, Any] = {
        "k": k,
        "temperature": default_temperature,
        "train_tokens": int((has_q & ~val).sum()),
        "val_tokens": int((has_q & val).sum()),
        "seen_tokens": int(train_rows.get("seen", np.zeros(0, bool)).sum()),
    }
    if not len(train_rows["gold"]) or not len(val_rows["gold"]):
        why = (
            "no held-out tokens with a query norm (recorded before they were kept)"
            if not has_q.any()
            else "no held-out token to fit on or to validate the fit on yet (the first "
            "documents are searched against an empty memory)"
        )
        return PRIOR, {**rec, "source": "prior", "reason": why}
    bare = replace(PRIOR, lambda_max=0.0)
    rec["bare_val_nll"] = nll(val_rows, bare, k, default_temperature)
    best = (nll(val_rows, PRIOR, k, default_temperature), PRIOR, default_temperature)
    rec["prior_val_nll"] = best[0]
    tried = []
    for t in temperatures:
        model, _ = fit(train_rows, k, t)
        v = nll(val_rows, model, k, t)
        tried.append({"temperature": t, "val_nll": v, **model.to_json()})
        if math.isfinite(v) and v < best[0]:
            best = (v, model, t)
    rec.update(
        temperature=best[2],
        val_nll=best[0],
        source=best[1].source,
        tried=tried,
    )
    return best[1], rec


def stream(
    dev: dict[str, np.ndarray],
    test: dict[str, np.ndarray],
    k: int,
    temperatures: tuple[float, ...],
) -> tuple[np.ndarray, np.ndarray, list[dict[str, Any]]]:
    """``memlm eval --lambda evidence``: each day, fit on the dev tokens of days <= d (for
    each temperature; the lowest NLL on them wins) and score that day's test tokens.

    Returns the test log-probs, each test token's lambda, and one record per day (the
    model and temperature used).  The prior serves the days before any dev token.
    """
    from memlm.knnlm import interpolate, knn_logprob

    n = len(test["gold"])
    out, lam_out = np.zeros(n), np.zeros(n)
    days = sorted(set(test["day"].tolist()))
    qd = dev.get("qnorm", np.full(len(dev["gold"]), np.nan))
    qt = test.get("qnorm", np.full(n, np.nan))
    if n and not np.isfinite(qt).all():
        raise ValueError(
            "the test tokens have no query norms: search them again (--resume not possible)"
        )
    model, temperature, seen_dev = PRIOR, temperatures[0], -1
    records = []
    for day in days:
        use = (dev["day"] <= day) & np.isfinite(qd)
        if int(use.sum()) != seen_dev and use.any():
            seen_dev = int(use.sum())
            model, temperature = fit_best(
                views({**subset(dev, use), "qnorm": qd[use]}), k, temperatures
            )
        rows_t = np.flatnonzero(test["day"] == day)
        d = test["distances"][rows_t, :k]
        v = test["values"][rows_t, :k]
        knn = knn_logprob(d, np.where(v >= 0, 0, -1), v, test["gold"][rows_t, None], temperature)
        ctx = test["context"][rows_t] if "context" in test else None
        lam = model.lambdas(d, v, qt[rows_t], temperature, ctx)
        lm = test["target_lm_logprob"][rows_t].astype(np.float64)
        out[rows_t] = interpolate(lm, knn[:, 0], lam, v[:, 0] >= 0)
        lam_out[rows_t] = lam
        records.append({"day": int(day), "temperature": temperature, **model.to_json()})
    return out, lam_out, records


def fit_best(
    rows: dict[str, np.ndarray], k: int, temperatures: tuple[float, ...]
) -> tuple[EvidenceModel, float]:
    """The fit (:func:`fit`) with the lowest NLL on ``rows`` over ``temperatures``, and its
    temperature; the prior at the first temperature when nothing can be fitted."""
    best: tuple[float, EvidenceModel, float] | None = None
    if len(rows["gold"]):
        for t in temperatures:
            m, v = fit(rows, k, t)
            if math.isfinite(v) and (best is None or v < best[0]):
                best = (v, m, t)
    return (PRIOR, temperatures[0]) if best is None else (best[1], best[2])
