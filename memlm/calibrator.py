"""The NN calibrator (lambda per token, MoNIM §3.2 / App. A.3) and the retrieval gate (C.6).

Features of one token, in the paper's three categories (App. A.3):

- distribution of the LM: ``conf`` = max_y p_LM(y), ``entropy`` of p_LM, optionally the
  ``query`` key itself;
- lexical statistics of the stream so far (:class:`memlm.lexical.LexicalStats`):
  ``log_freq`` and ``log_succ`` of the last context token (log(1 + count));
- density of the memory: ``knn_dist`` = L2 distances to the top-10 neighbours (the
  square root of the index's squared L2) and ``knn_distinct`` = log of the number of
  distinct values among the top-i neighbours, i = 1..10.

Each feature goes through its own Linear(width, 128) + LeakyReLU layer (the paper feeds
"each feature" to a 1-layer LeakyReLU network); the outputs are concatenated and a
4-layer MLP with dropout 0.2 gives lambda in (0, 1).  Training minimises the negative
log-likelihood of the gold token under (1 - lambda) p_LM + lambda p_kNN with Adam
(lr 3e-4).  The retrieval gate is the same kind of model, smaller, over the features
known before the search (distribution + lexical): when its lambda is below theta the
search is skipped and the LM answer stands.

:class:`StreamCalibrator` trains as the stream goes: each day adds that day's held-out
tokens, retrains the previous version (5 epochs at first, fewer as the set grows), keeps
the best epoch on its own validation split, and saves each version.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from memlm.knnlm import KnnParams, has_neighbours, interpolate, knn_logprob

if TYPE_CHECKING:
    from memlm.interpolation import ConstantChoice, TuneGrid
    from memlm.lexical import LexicalStats

TOP_N = 10  # neighbours described by the density features (App. A.3: i = 1..10)
GROUPS: dict[str, tuple[str, ...]] = {
    "distribution": ("conf", "entropy", "query"),
    "lexical": ("log_freq", "log_succ"),
    "density": ("knn_dist", "knn_distinct"),
}
PRE_SEARCH_GROUPS = ("distribution", "lexical")  # what the gate may use
# The query key is optional (App. A.3 lists it): the evaluation harness does not keep
# the held-out keys, and 576 more inputs learn little from a few thousand tokens.
DEFAULT_FEATURES = ("conf", "entropy", "log_freq", "log_succ", "knn_dist", "knn_distinct")
GATE_FEATURES = ("conf", "entropy", "log_freq", "log_succ")
# log p_kNN(gold) is -inf when no neighbour holds the gold token; exp(-60) is nothing
# next to any LM probability and keeps gradients finite.
_KNN_FLOOR = -60.0
CALIBRATOR_DIR = "calibrator"  # beside each index version: v000042/calibrator/
TRAIN_FILE = "calibrator-train.npz"  # the held-out tokens merged so far (data directory)


def features_of_groups(groups: Sequence[str], *, query: bool = False) -> tuple[str, ...]:
    """The feature names of the given groups (the query key only when asked for)."""
    names = [f for g in groups for f in GROUPS[g] if f != "query" or query]
    return tuple(names)


# --- features ---------------------------------------------------------------------------


def density_features(distances: np.ndarray, values: np.ndarray, n: int = TOP_N) -> np.ndarray:
    """(m, 2n) float32: L2 distance to the top-i neighbour, log #distinct values in top-i.

    distances: (m, k) squared L2, ascending; values: (m, k) int, -1 for padding.  Missing
    neighbours repeat the last valid distance (0 when the row has none) and add no value.
    """
    assert distances.shape == values.shape and distances.ndim == 2
    m, k = values.shape
    d = np.zeros((m, n), np.float64)
    v = np.full((m, n), -1, np.int64)
    c = min(k, n)
    d[:, :c] = distances[:, :c]
    v[:, :c] = values[:, :c]
    valid = v >= 0
    d = np.where(valid, np.sqrt(np.maximum(np.where(valid, d, 0.0), 0.0)), np.nan)
    # carry the last valid distance forward into the padding
    for i in range(1, n):
        d[:, i] = np.where(np.isnan(d[:, i]), d[:, i - 1], d[:, i])
    d = np.nan_to_num(d, nan=0.0)
    # a value counts at rank i if it is valid and differs from every value before it
    new = valid.copy()
    for i in range(1, n):
        seen_before = (v[:, :i] == v[:, i : i + 1]).any(axis=1)
        new[:, i] &= ~seen_before
    counts = np.cumsum(new, axis=1)
    distinct = np.log(np.maximum(counts, 1))
    return np.concatenate([d, distinct], axis=1).astype(np.float32)


def token_features(
    top_logprob: np.ndarray,
    entropy: np.ndarray,
    lexical: np.ndarray,
    distances: np.ndarray | None = None,
    values: np.ndarray | None = None,
    query: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Every feature of m tokens as {name: (m, width) float32}.

    top_logprob, entropy: (m,) from the encoder; lexical: (m, 2) from
    ``LexicalStats.features``; distances, values: (m, k) search results (None before the
    search); query: (m, d) keys, optional.
    """
    m = len(top_logprob)
    assert entropy.shape == (m,) and lexical.shape == (m, 2)
    out = {
        "conf": np.exp(top_logprob.astype(np.float64)).astype(np.float32)[:, None],
        "entropy": entropy.astype(np.float32)[:, None],
        "log_freq": lexical[:, :1].astype(np.float32),
        "log_succ": lexical[:, 1:2].astype(np.float32),
    }
    if distances is not None and values is not None:
        dens = density_features(distances, values)
        out["knn_dist"], out["knn_distinct"] = dens[:, :TOP_N], dens[:, TOP_N:]
    if query is not None:
        out["query"] = np.asarray(query, np.float32)
    return out


def split_features(split: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Features of the held-out tokens kept by the evaluation harness (EvalTokens.arrays)."""
    return token_features(
        split["top_logprob"],
        split["entropy"],
        split["lexical"],
        split["distances"],
        split["values"],
    )


def gold_knn_logprob(split: dict[str, np.ndarray], params: KnnParams) -> np.ndarray:
    """(m,) log p_kNN(gold) with the first params.k neighbours at params.temperature."""
    k = min(params.k, split["values"].shape[1])
    vals = split["values"][:, :k]
    ids = np.where(vals >= 0, 0, -1)
    return knn_logprob(
        split["distances"][:, :k], ids, vals, split["gold"][:, None], params.temperature
    )[:, 0]


# --- the model --------------------------------------------------------------------------


@dataclass(frozen=True)
class CalibratorConfig:
    """Model and training settings; the defaults are the paper's Table 11."""

    features: tuple[str, ...] = DEFAULT_FEATURES
    hidden: int = 128  # width of every per-feature layer and of the MLP (Table 11)
    layers: int = 4  # MLP layers after the concatenation (Table 11)
    dropout: float = 0.2  # Table 11
    lr: float = 3e-4  # Adam (Table 11)
    batch_size: int = 32  # small: a day of held-out news is only ~1-2k tokens
    max_epochs: int = 5  # App. A.3: from 5 epochs on the first day ...
    min_epochs: int = 1  # ... down to 1 as the training set grows
    val_share: float = 0.2  # held-out blocks of the calibrator's own validation split
    val_block: int = 64  # tokens per validation block (neighbouring tokens are alike)
    init_lambda: float = 0.25  # where the untrained model starts (every token) ...
    init_from_constant: bool = True  # ... unless it starts at the constant lambda tuned on dev
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = set(self.features) - {f for g in GROUPS.values() for f in g}
        if unknown or not self.features:
            raise ValueError(f"bad calibrator features: {sorted(unknown) or 'none'}")
        if self.layers < 1 or self.hidden < 1 or not 0 <= self.dropout < 1:
            raise ValueError("layers, hidden >= 1 and dropout in [0, 1) are required")
        if not 0 < self.init_lambda < 1 or not 0 <= self.val_share < 1:
            raise ValueError("init_lambda in (0, 1) and val_share in [0, 1) are required")
        if not 1 <= self.min_epochs <= self.max_epochs:
            raise ValueError("1 <= min_epochs <= max_epochs is required")


def with_prior(cfg: CalibratorConfig, params: KnnParams) -> CalibratorConfig:
    """Start at the tuned constant lambda: the calibrator learns where to deviate from it."""
    if not cfg.init_from_constant:
        return cfg
    return replace(cfg, init_lambda=min(max(params.lmbda, 0.01), 0.99))


def gate_config(**overrides: Any) -> CalibratorConfig:
    """The retrieval gate: pre-search features only, a quarter of the width, 2 layers."""
    base: dict[str, Any] = {"features": GATE_FEATURES, "hidden": 32, "layers": 2}
    base.update(overrides)
    return CalibratorConfig(**base)


class CalibratorNet(nn.Module):
    """Per-feature LeakyReLU layers, concatenated, then an MLP to the logit of lambda."""

    def __init__(self, widths: dict[str, int], cfg: CalibratorConfig):
        super().__init__()
        self.names = tuple(widths)
        self.blocks = nn.ModuleDict(
            {n: nn.Sequential(nn.Linear(w, cfg.hidden), nn.LeakyReLU()) for n, w in widths.items()}
        )
        mlp: list[nn.Module] = []
        width = cfg.hidden * len(widths)
        for _ in range(cfg.layers - 1):
            mlp += [nn.Linear(width, cfg.hidden), nn.ReLU(), nn.Dropout(cfg.dropout)]
            width = cfg.hidden
        last = nn.Linear(width, 1)
        nn.init.zeros_(last.weight)  # start at exactly init_lambda for every token
        nn.init.constant_(last.bias, math.log(cfg.init_lambda / (1 - cfg.init_lambda)))
        mlp.append(last)
        self.mlp = nn.Sequential(*mlp)

    def forward(self, feats: dict[str, torch.Tensor]) -> torch.Tensor:
        """{name: (B, width)} standardised features -> (B,) logit of lambda."""
        h = torch.cat([self.blocks[n](feats[n]) for n in self.names], dim=1)  # (B, F*hidden)
        out: torch.Tensor = self.mlp(h).squeeze(1)
        return out


def mixture_nll(logit: torch.Tensor, lm_lp: torch.Tensor, knn_lp: torch.Tensor) -> torch.Tensor:
    """Mean -log((1 - lambda) p_LM(gold) + lambda p_kNN(gold)), lambda = sigmoid(logit)."""
    # log(1 - sigmoid(z)) = logsigmoid(-z): exact and stable at both ends
    mix = torch.logaddexp(
        nn.functional.logsigmoid(-logit) + lm_lp, nn.functional.logsigmoid(logit) + knn_lp
    )
    return -mix.mean()


@dataclass
class TrainingSet:
    """Tokens a calibrator learns from: features, log p_LM(gold), log p_kNN(gold)."""

    feats: dict[str, np.ndarray]
    lm_lp: np.ndarray  # (m,)
    knn_lp: np.ndarray  # (m,) clipped at _KNN_FLOOR

    def __len__(self) -> int:
        return len(self.lm_lp)

    @classmethod
    def build(
        cls, feats: dict[str, np.ndarray], lm_lp: np.ndarray, knn_lp: np.ndarray
    ) -> TrainingSet:
        """Keep the tokens that have a finite kNN log-probability input (any neighbour)."""
        return cls(
            {k: v.astype(np.float32) for k, v in feats.items()},
            lm_lp.astype(np.float32),
            np.maximum(np.nan_to_num(knn_lp, nan=_KNN_FLOOR, neginf=_KNN_FLOOR), _KNN_FLOOR).astype(
                np.float32
            ),
        )

    def take(self, idx: np.ndarray) -> TrainingSet:
        return TrainingSet(
            {k: v[idx] for k, v in self.feats.items()}, self.lm_lp[idx], self.knn_lp[idx]
        )

    @classmethod
    def concat(cls, parts: Sequence[TrainingSet]) -> TrainingSet:
        names = parts[0].feats.keys()
        return cls(
            {n: np.concatenate([p.feats[n] for p in parts]) for n in names},
            np.concatenate([p.lm_lp for p in parts]),
            np.concatenate([p.knn_lp for p in parts]),
        )


class Calibrator:
    """A trained (or untrained) model with its feature standardisation."""

    def __init__(self, cfg: CalibratorConfig, widths: dict[str, int]):
        self.cfg = cfg
        self.widths = {n: widths[n] for n in cfg.features}
        torch.manual_seed(cfg.seed)
        self.net = CalibratorNet(self.widths, cfg)
        self.mean = {n: np.zeros(w, np.float32) for n, w in self.widths.items()}
        self.std = {n: np.ones(w, np.float32) for n, w in self.widths.items()}
        self.meta: dict[str, Any] = {}

    def _tensors(self, feats: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        return {
            n: torch.from_numpy(((feats[n] - self.mean[n]) / self.std[n]).astype(np.float32))
            for n in self.widths
        }

    def fit_standardisation(self, feats: dict[str, np.ndarray]) -> None:
        for n in self.widths:
            self.mean[n] = feats[n].mean(axis=0).astype(np.float32)
            self.std[n] = np.maximum(feats[n].std(axis=0), 1e-3).astype(np.float32)

    @torch.inference_mode()
    def predict(self, feats: dict[str, np.ndarray]) -> np.ndarray:
        """(m,) lambda in (0, 1) for the tokens whose features are given."""
        self.net.eval()
        x = self._tensors(feats)
        return torch.sigmoid(self.net(x)).double().numpy()

    @torch.inference_mode()
    def nll(self, data: TrainingSet) -> float:
        """Mean augmented NLL of ``data`` under this model's lambdas."""
        if len(data) == 0:
            return float("nan")
        self.net.eval()
        logit = self.net(self._tensors(data.feats))
        return float(
            mixture_nll(logit, torch.from_numpy(data.lm_lp), torch.from_numpy(data.knn_lp))
        )

    def train_epochs(
        self, train: TrainingSet, val: TrainingSet | None, epochs: int, seed: int
    ) -> dict[str, Any]:
        """Adam over ``train`` for ``epochs``; keep the epoch (0 = as before) best on ``val``."""
        opt = torch.optim.Adam(self.net.parameters(), lr=self.cfg.lr)
        gen = torch.Generator().manual_seed(seed)
        x = self._tensors(train.feats)
        lm, knn = torch.from_numpy(train.lm_lp), torch.from_numpy(train.knn_lp)
        score = self.nll(val) if val is not None and len(val) else float("nan")
        best = (score, 0, {k: v.clone() for k, v in self.net.state_dict().items()})
        history = [score]
        for epoch in range(1, epochs + 1):
            self.net.train()
            order = torch.randperm(len(train), generator=gen)
            for s in range(0, len(train), self.cfg.batch_size):
                b = order[s : s + self.cfg.batch_size]
                loss = mixture_nll(self.net({n: t[b] for n, t in x.items()}), lm[b], knn[b])
                opt.zero_grad()
                loss.backward()
                opt.step()
            if val is not None and len(val):
                score = self.nll(val)
                history.append(score)
                if not score >= best[0]:  # also replaces a NaN start
                    best = (score, epoch, {k: v.clone() for k, v in self.net.state_dict().items()})
            else:
                best = (
                    float("nan"),
                    epoch,
                    {k: v.clone() for k, v in self.net.state_dict().items()},
                )
        self.net.load_state_dict(best[2])
        return {"epochs": epochs, "best_epoch": best[1], "val_nll": best[0], "val_history": history}

    # -- persistence --

    def save(self, path: Path) -> None:
        """Write the model into the directory ``path`` atomically (temp dir + os.replace)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
        try:
            torch.save(self.net.state_dict(), tmp / "model.pt")
            arrays: dict[str, Any] = {f"mean_{n}": self.mean[n] for n in self.widths}
            arrays.update({f"std_{n}": self.std[n] for n in self.widths})
            np.savez(tmp / "standardisation.npz", **arrays)
            cfg = asdict(self.cfg)
            (tmp / "calibrator.json").write_text(
                json.dumps({"config": cfg, "widths": self.widths, "meta": self.meta}, indent=2)
            )
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    @classmethod
    def load(cls, path: Path) -> Calibrator:
        path = Path(path)
        spec = json.loads((path / "calibrator.json").read_text())
        raw = spec["config"]
        raw["features"] = tuple(raw["features"])
        cal = cls(CalibratorConfig(**raw), {n: int(w) for n, w in spec["widths"].items()})
        cal.net.load_state_dict(torch.load(path / "model.pt", weights_only=True))
        with np.load(path / "standardisation.npz") as z:
            for n in cal.widths:
                cal.mean[n], cal.std[n] = z[f"mean_{n}"], z[f"std_{n}"]
        cal.meta = spec.get("meta", {})
        return cal


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
    valid = has_neighbours(np.where(split["values"] >= 0, 0, -1))
    keep = np.flatnonzero(valid)
    return TrainingSet.build(
        {n: feats[n][keep] for n in features},
        split["target_lm_logprob"][keep],
        gold_knn_logprob(split, params)[keep],
    )


def _rows(split: dict[str, np.ndarray], mask: np.ndarray) -> dict[str, np.ndarray]:
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
    valid_test = has_neighbours(np.where(test["values"] >= 0, 0, -1))
    lam = np.zeros(len(knn_test))
    searched = np.ones(len(knn_test), bool)
    days = sorted(set(dev["day"].tolist()) | set(test["day"].tolist()))
    for day in days:
        on_day = dev["day"] == day
        if on_day.any():
            part = _rows(dev, on_day)
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


# --- serving: the calibrator that matches the active index version ------------------------


def _stat(path: Path) -> tuple[int, int, int] | None:
    """(inode, mtime, size) of a file, None when missing: whether someone replaced it."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


@dataclass(frozen=True)
class ServedInterpolation:
    """The interpolation one served index version answers and decides with.

    ``params``: the constant chosen at that version's build (k and T of p_kNN, and lambda
    unless the calibrator is used); ``calibrator``: lambda per token, used only when it beat
    the constant on the same validation tokens (``use_calibrator``); ``gate``: skips the
    search where its lambda is below ``theta``.  The engine reads it once per call and the
    loader replaces it whole, so a call never mixes two versions' parameters.
    """

    params: KnnParams
    version: int | None = None  # the index version it was loaded for
    record: dict[str, Any] = field(default_factory=dict)  # interpolation.json ({}: none yet)
    calibrator: Calibrator | None = None  # the newest calibrator at or below ``version``
    calibrator_version: int | None = None  # the version directory it was loaded from
    use_calibrator: bool = False
    gate: Calibrator | None = None
    theta: float = 0.0
    lexical: LexicalStats | None = None  # what the calibrator's lexical features read

    @property
    def lambda_source(self) -> str:
        return "calibrator" if self.use_calibrator and self.calibrator is not None else "constant"

    def gate_mask(
        self, top_logprob: np.ndarray, entropy: np.ndarray, prev_tokens: np.ndarray
    ) -> np.ndarray:
        """(m,) bool: search these tokens (all of them without a gate or with theta 0)."""
        if self.gate is None or self.theta <= 0 or self.lexical is None:
            return np.ones(len(top_logprob), bool)
        pre = token_features(top_logprob, entropy, self.lexical.features(prev_tokens))
        return self.gate.predict({n: pre[n] for n in self.gate.cfg.features}) >= self.theta

    def calibrated(
        self,
        top_logprob: np.ndarray,
        entropy: np.ndarray,
        prev_tokens: np.ndarray,
        distances: np.ndarray,
        values: np.ndarray,
    ) -> np.ndarray | None:
        """(m,) lambda from the served calibrator, None when the constant is served."""
        if self.lambda_source != "calibrator" or self.lexical is None:
            return None
        assert self.calibrator is not None
        lex = self.lexical.features(prev_tokens)
        feats = token_features(top_logprob, entropy, lex, distances, values)
        return self.calibrator.predict({n: feats[n] for n in self.calibrator.cfg.features})

    def lambdas(
        self,
        top_logprob: np.ndarray,
        entropy: np.ndarray,
        prev_tokens: np.ndarray,
        distances: np.ndarray,
        values: np.ndarray,
    ) -> np.ndarray:
        """(m,) lambda of each token: the calibrator's or the constant, 0 where the gate
        skips the search.  distances, values: (m, >= params.k) search results."""
        cal = self.calibrated(top_logprob, entropy, prev_tokens, distances, values)
        lam = np.full(len(top_logprob), self.params.lmbda) if cal is None else cal
        return np.where(self.gate_mask(top_logprob, entropy, prev_tokens), lam, 0.0)

    def to_json(self) -> dict[str, Any]:
        """What /admin/stats shows: the served constant, where it came from, lambda's source."""
        rec = self.record
        return {
            "index_version": self.version,
            "chosen_for": rec.get("index_version"),
            "k": self.params.k,
            "temperature": self.params.temperature,
            "lambda": self.params.lmbda,
            "source": rec.get("source", "default"),
            "lambda_source": self.lambda_source,
            "heldout_tokens": rec.get("tokens", 0),
            "heldout_ppl": rec.get("ppl"),
            "heldout_bare_ppl": rec.get("bare_ppl"),
            "calibrator_val_ppl": _exp((rec.get("calibrator") or {}).get("val_nll")),
            "constant_val_ppl": _exp((rec.get("calibrator") or {}).get("constant_val_nll")),
        }


def _exp(nll: float | None) -> float | None:
    return None if nll is None else float(math.exp(nll))


def validation_rows(rows: dict[str, np.ndarray], cfg: CalibratorConfig) -> np.ndarray:
    """(n,) bool: the rows a calibrator trained on ``rows`` with ``cfg`` validated on.

    The same split as :meth:`ServedCalibration.retrain` makes: per day, the rows with a
    neighbour, in order, cut by :func:`validation_mask` salted with the day.
    """
    n = len(rows["day"]) if rows else 0
    out = np.zeros(n, bool)
    if not n:
        return out
    valid = has_neighbours(np.where(rows["values"] >= 0, 0, -1))
    for day in sorted(set(rows["day"].tolist())):
        idx = np.flatnonzero((rows["day"] == day) & valid)
        out[idx[validation_mask(len(idx), cfg, salt=int(day))]] = True
    return out


class ServedCalibration:
    """Lexical statistics, the held-out training set and the per-version interpolation.

    Files (``data_dir`` of an engine): ``lexical.npz`` (updated after every ingested
    document), ``calibrator-train.npz`` (every held-out token merged so far, with the index
    version it was merged for), and, beside each index build ``index/v000042/``:
    ``lexical.npz`` (the statistics the build saw), ``calibrator/`` and ``gate/`` (trained
    for that version) and ``interpolation.json`` (the constant chosen at that build and
    whether the calibrator beat it).  A process that serves version v loads v's files, or
    the newest older ones when v has none yet, as one :class:`ServedInterpolation`
    (``served``); before any build chose one it serves ``default``.
    """

    def __init__(
        self,
        data_dir: Path,
        vocab_size: int,
        *,
        theta: float = 0.0,
        shared: bool = False,
        default: KnnParams | None = None,
    ):
        from memlm.interpolation import SERVED_DEFAULT
        from memlm.lexical import LexicalStats

        self.data_dir = Path(data_dir)
        # shared: other writer processes update lexical.npz and the training set too, so
        # both are re-read when their file changed (lexical updates run under the
        # datastore's write lock, training-set writes under the build lock)
        self.shared = shared
        self._lexical_stat = _stat(self.lexical_path)
        self.lexical = LexicalStats.load(self.lexical_path, vocab_size)
        self.vocab_size = vocab_size
        self.default = default or SERVED_DEFAULT
        self.served = ServedInterpolation(self.default, theta=theta, lexical=self.lexical)
        # what ``served`` was loaded from: (version, calibrator stamp, interpolation stamp)
        self._loaded: tuple[Any, ...] | None = None
        # documents in the training set and its tokens per day, and the file it was read from
        self._index: tuple[set[int], dict[int, int]] | None = None
        self._index_stat: tuple[int, int, int] | None = None

    # The served version's parts, read from ``served`` (one consistent snapshot).
    @property
    def calibrator(self) -> Calibrator | None:
        """The calibrator that sets lambda now (None: the constant is served)."""
        s = self.served
        return s.calibrator if s.lambda_source == "calibrator" else None

    @property
    def gate(self) -> Calibrator | None:
        return self.served.gate

    @property
    def theta(self) -> float:
        return self.served.theta

    @theta.setter
    def theta(self, value: float) -> None:
        self.served = replace(self.served, theta=value)

    @property
    def version(self) -> int | None:
        return self.served.version

    @property
    def loaded_version(self) -> int | None:
        """The version directory the served calibrator came from (None: constant)."""
        return self.served.calibrator_version if self.calibrator is not None else None

    @property
    def served_lexical(self) -> LexicalStats:
        return self.served.lexical or self.lexical

    @property
    def train_path(self) -> Path:
        return self.data_dir / TRAIN_FILE

    @property
    def lexical_path(self) -> Path:
        return self.data_dir / "lexical.npz"

    def refresh_lexical(self) -> bool:
        """Shared writers: re-read the lexical statistics if another process saved them."""
        from memlm.lexical import LexicalStats

        stat = _stat(self.lexical_path)
        if not self.shared or stat == self._lexical_stat:
            return False
        fresh = LexicalStats.load(self.lexical_path, self.vocab_size)
        if self.served.lexical is self.lexical:
            self.served = replace(self.served, lexical=fresh)
        self.lexical, self._lexical_stat = fresh, stat
        return True

    def observe(self, token_ids: Sequence[int], doc_id: int | None = None) -> bool:
        """Count one ingested document's tokens once and persist; False if counted before."""
        ids = np.asarray(token_ids, np.int64)
        return self._change_lexical(lambda lex: lex.update(ids, doc_id))

    def forget(self, token_ids: Sequence[int], doc_id: int) -> bool:
        """Take a forgotten document's tokens out of the statistics; False if not counted."""
        ids = np.asarray(token_ids, np.int64)
        return self._change_lexical(lambda lex: lex.remove(ids, doc_id))

    def _change_lexical(self, change: Callable[[LexicalStats], bool]) -> bool:
        """Apply ``change`` to the newest saved statistics; save them if it changed them."""
        self.refresh_lexical()
        if not change(self.lexical):
            return False
        self.lexical.save(self.lexical_path)
        self._lexical_stat = _stat(self.lexical_path)
        return True

    def snapshot(self, index_root: Path, version: int) -> None:
        """Save the lexical statistics beside a new index build."""
        self.refresh_lexical()
        self.lexical.save(Path(index_root) / f"v{version:06d}" / "lexical.npz")

    def load_for(self, index_root: Path, version: int | None) -> bool:
        """Serve the interpolation of ``version``; True if a calibrator sets lambda.

        Builds a new :class:`ServedInterpolation` and replaces ``served`` in one assignment
        (only when a file changed: ``reload_index`` calls this often).
        """
        from memlm.interpolation import INTERPOLATION_FILE, load_choice
        from memlm.lexical import LexicalStats

        root = Path(index_root)
        found = [
            int(p.parent.parent.name[1:]) for p in root.glob(f"v*/{CALIBRATOR_DIR}/calibrator.json")
        ]
        usable = [v for v in found if version is not None and v <= version]
        cal_v = max(usable) if usable else None
        vdir = None if cal_v is None else root / f"v{cal_v:06d}"
        choice = load_choice(root, version)
        cal_stamp = (
            None
            if vdir is None
            else (str(vdir), (vdir / CALIBRATOR_DIR / "calibrator.json").stat().st_mtime_ns)
        )
        choice_stamp = (
            None
            if choice is None
            else (choice[0], (root / f"v{choice[0]:06d}" / INTERPOLATION_FILE).stat().st_mtime_ns)
        )
        stamp = (version, cal_stamp, choice_stamp, self.default)
        if stamp == self._loaded:
            return self.calibrator is not None
        old = self.served
        cal = gate = None
        lexical = self.lexical
        if vdir is not None:
            if self._loaded is not None and self._loaded[1] == cal_stamp:
                cal, gate, lexical = old.calibrator, old.gate, old.lexical or self.lexical
            else:
                cal = Calibrator.load(vdir / CALIBRATOR_DIR)
                gate_dir = vdir / "gate"
                gate = (
                    Calibrator.load(gate_dir) if (gate_dir / "calibrator.json").exists() else None
                )
                lex = vdir / "lexical.npz"
                lexical = LexicalStats.load(lex, self.vocab_size) if lex.exists() else self.lexical
        record: dict[str, Any] = {} if choice is None else choice[1]
        if record:
            params = KnnParams(
                k=int(record["k"]),
                temperature=float(record["temperature"]),
                lmbda=float(record["lambda"]),
            )
            # the calibrator beat the constant: only the very one it was compared with
            compared = (record.get("calibrator") or {}).get("calibrator_version")
            use = bool(record.get("lambda_source") == "calibrator" and compared == cal_v)
        else:  # a data directory from before the choice was recorded: as it served then
            params, use = self.default, cal is not None
        self.served = ServedInterpolation(
            params=params,
            version=version,
            record=record,
            calibrator=cal,
            calibrator_version=cal_v,
            use_calibrator=use,
            gate=gate,
            theta=old.theta,
            lexical=lexical,
        )
        self._loaded = stamp
        return self.calibrator is not None

    # --- the served interpolation of a build ---------------------------------------------

    def choose_constant(self, grid: TuneGrid, *, min_tokens: int | None = None) -> ConstantChoice:
        """Tune the constant (k, T, lambda) on every held-out token merged so far."""
        from memlm.interpolation import MIN_TUNE_TOKENS, choose_constant

        return choose_constant(
            self.training_rows(),
            grid,
            self.default,
            min_tokens=MIN_TUNE_TOKENS if min_tokens is None else min_tokens,
        )

    def compare(self, params: KnnParams, index_root: Path, version: int) -> dict[str, Any] | None:
        """The calibrator served for ``version`` against the constant ``params`` on the
        calibrator's validation tokens (mean NLL of each); None when there is none.

        k and T of p_kNN are the constant's for both: only lambda differs.
        """
        root = Path(index_root)
        found = sorted(
            int(p.parent.parent.name[1:]) for p in root.glob(f"v*/{CALIBRATOR_DIR}/calibrator.json")
        )
        usable = [v for v in found if v <= version]
        if not usable:
            return None
        cal_v = usable[-1]
        cal = Calibrator.load(root / f"v{cal_v:06d}" / CALIBRATOR_DIR)
        rows = self.training_rows()
        out: dict[str, Any] = {"calibrator_version": cal_v, "val_tokens": 0}
        if not rows:
            return {**out, "val_nll": None, "constant_val_nll": None, "beats_constant": False}
        val = training_set(_rows(rows, validation_rows(rows, cal.cfg)), params, cal.cfg.features)
        if not len(val):
            return {**out, "val_nll": None, "constant_val_nll": None, "beats_constant": False}
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
        self, choice: ConstantChoice, grid: TuneGrid, index_root: Path, version: int
    ) -> dict[str, Any]:
        """Record what ``version`` serves (``interpolation.json`` beside it) and return it:
        the constant chosen, and the calibrator instead if it beat it on validation tokens."""
        from memlm.interpolation import save_choice

        compared = self.compare(choice.params, index_root, version)
        record = {
            "index_version": version,
            **choice.to_json(),
            "grid": {
                "ks": list(grid.ks),
                "temperatures": list(grid.temperatures),
                "lambdas": list(grid.lambdas),
            },
            "lambda_source": (
                "calibrator" if compared is not None and compared["beats_constant"] else "constant"
            ),
            "calibrator": compared,
        }
        save_choice(index_root, version, record)
        return record

    # --- the training set ----------------------------------------------------------------

    def training_rows(self) -> dict[str, np.ndarray]:
        """Every held-out token merged so far (empty dict when none)."""
        if not self.train_path.exists():
            return {}
        with np.load(self.train_path) as z:
            rows = {k: z[k] for k in z.files}
        if "merged_for" not in rows:  # written before the column existed: all of it is old
            rows["merged_for"] = np.full(len(rows["day"]), -1, np.int32)
        return rows

    def training_index(self) -> tuple[set[int], dict[int, int]]:
        """The stream documents in the training set and its tokens per day."""
        stat = _stat(self.train_path)
        index = self._index  # one read: the builder thread may reset it meanwhile
        if index is None or stat != self._index_stat:
            self._index_stat = stat
            docs: set[int] = set()
            days: dict[int, int] = {}
            if self.train_path.exists():
                with np.load(self.train_path) as z:
                    doc, day = z["doc"], z["day"]
                docs = set(np.unique(doc[doc >= 0]).tolist())
                u, c = np.unique(day, return_counts=True)
                days = dict(zip(u.tolist(), c.tolist(), strict=True))
            index = self._index = (docs, days)
        return index

    def _write_training_set(self, rows: dict[str, np.ndarray]) -> None:
        tmp = self.train_path.with_suffix(".tmp.npz")
        arrays: dict[str, Any] = rows
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.train_path)
        self._index = None

    def add_heldout(
        self, split: dict[str, np.ndarray], version: int, *, max_tokens: int | None = None
    ) -> int:
        """Merge held-out tokens into the training set for ``version``; returns rows added.

        ``doc`` >= 0 names a stream document: rows of a document already in the set are
        dropped, so merging the same record twice (a crash before its file was deleted)
        adds it once.  Negative ``doc`` values are texts given to ``Engine.train_calibrator``.
        With ``max_tokens`` the set keeps its newest that many rows (by stream day, then
        merge order): the oldest days leave first, so the set and each retrain stay bounded
        however long the stream runs.
        """
        from memlm.heldout import stack

        new = {k: np.asarray(v) for k, v in split.items()}
        if not new or not len(new["day"]):
            return 0
        docs, _ = self.training_index()
        keep = (new["doc"] < 0) | ~np.isin(new["doc"], np.fromiter(docs, np.int64, len(docs)))
        new = {k: v[keep] for k, v in new.items()}
        if not len(new["day"]):
            return 0
        new["merged_for"] = np.full(len(new["day"]), version, np.int32)
        old = self.training_rows()
        rows = stack([old, new]) if old else new
        if max_tokens is not None and len(rows["day"]) > max_tokens:
            newest = np.sort(np.argsort(rows["day"], kind="stable")[-max_tokens:])
            rows = {k: v[newest] for k, v in rows.items()}
        self._write_training_set(rows)
        return len(new["day"])

    def drop_document(self, doc_id: int) -> int:
        """Remove a forgotten document's rows from the training set; returns how many."""
        if doc_id not in self.training_index()[0]:
            return 0
        rows = self.training_rows()
        keep = rows["doc"] != doc_id
        self._write_training_set({k: v[keep] for k, v in rows.items()})
        return int((~keep).sum())

    # --- training --------------------------------------------------------------------------

    def train(
        self,
        split: dict[str, np.ndarray],
        params: KnnParams,
        index_root: Path,
        version: int,
        cfg: CalibratorConfig | None = None,
        gate: CalibratorConfig | None = None,
    ) -> dict[str, Any]:
        """Add held-out tokens (EvalTokens-like arrays), retrain both models, save for version."""
        self.add_heldout(split, version)
        return self.retrain(params, index_root, version, cfg=cfg, gate=gate)

    def retrain(
        self,
        params: KnnParams,
        index_root: Path,
        version: int,
        *,
        min_tokens: int = 1,
        cfg: CalibratorConfig | None = None,
        gate: CalibratorConfig | None = None,
    ) -> dict[str, Any]:
        """Train the calibrator and the gate for ``version`` on the tokens merged so far.

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
        rows = self.training_rows()
        total = len(rows["day"]) if rows else 0
        prev = self._previous(root, CALIBRATOR_DIR, version)
        since = -2 if prev is None else int(prev[1].meta.get("index_version", prev[0]))
        fresh = rows["merged_for"] > since if rows else np.zeros(0, bool)
        report: dict[str, Any] = {"training_tokens": total, "new_tokens": int(fresh.sum())}
        reason = None
        if not fresh.any():
            reason = "no new held-out tokens"
        elif total < min_tokens:
            reason = f"{total} held-out tokens, fewer than the {min_tokens} training needs"
        if reason is not None:
            carried = self._carry_forward(root, version)
            return {**report, "trained": False, "reason": reason, "carried_from": carried}
        new_days = set(rows["day"][fresh].tolist())
        vdir = root / f"v{version:06d}"
        for name, c in ((CALIBRATOR_DIR, cfg), ("gate", gate)):
            stream = StreamCalibrator(c)
            earlier = self._previous(root, name, version)
            days = sorted(set(rows["day"].tolist()))
            parts = {
                d: training_set(_rows(rows, rows["day"] == d), params, c.features) for d in days
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
            report["carried_from"] = self._carry_forward(root, version)
        return report

    @staticmethod
    def _previous(root: Path, name: str, version: int) -> tuple[int, Calibrator] | None:
        found = sorted(
            int(p.parent.parent.name[1:]) for p in root.glob(f"v*/{name}/calibrator.json")
        )
        earlier = [v for v in found if v < version]
        if not earlier:
            return None
        return earlier[-1], Calibrator.load(root / f"v{earlier[-1]:06d}" / name)

    def _carry_forward(self, root: Path, version: int) -> int | None:
        """Copy the newest earlier calibrator and gate beside ``version``; their version."""
        carried = None
        for name in (CALIBRATOR_DIR, "gate"):
            prev = self._previous(root, name, version)
            target = root / f"v{version:06d}" / name
            if prev is None or (target / "calibrator.json").exists():
                continue
            prev[1].meta["carried_from"] = prev[0]
            prev[1].save(target)
            carried = prev[0] if name == CALIBRATOR_DIR else carried
        return carried


def _finite(x: float) -> float | None:
    """JSON has no NaN: an empty validation split reports None."""
    return float(x) if math.isfinite(x) else None
