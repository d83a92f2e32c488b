"""The calibrator model: its config, network, loss, training set and persistence.

Each feature goes through its own Linear(width, 128) + LeakyReLU layer (the paper feeds
"each feature" to a 1-layer LeakyReLU network); the outputs are concatenated and a
4-layer MLP with dropout 0.2 gives lambda in (0, 1).  Training minimises the negative
log-likelihood of the gold token under (1 - lambda) p_LM + lambda p_kNN with Adam
(lr 3e-4).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from memlm.calibrator.features import DEFAULT_FEATURES, GATE_FEATURES, GROUPS
from memlm.knnlm import KnnParams

CALIBRATOR_DIR = "calibrator"  # beside each index version: v000042/calibrator/
# log p_kNN(gold) is -inf when no neighbour holds the gold token; exp(-60) is nothing
# next to any LM probability and keeps gradients finite.
_KNN_FLOOR = -60.0


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
