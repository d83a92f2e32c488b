"""Choosing the constant interpolation: k, T and lambda tuned on held-out tokens.

One interpolation answers ``/predict`` and ``/score`` and decides what MoNIM stores: the
constant (k, T, lambda) chosen at the index build, or the NN calibrator when it beat that
constant on the same validation tokens (``memlm.calibrator.ServedInterpolation``).

Before any held-out token exists the service serves :data:`SERVED_DEFAULT`, a constant
measured not to hurt the bare LM (docs/calibrator.md, "The served interpolation").  At
every build the constant is tuned on the held-out tokens the ingest worker recorded, over
:data:`SERVED_GRID` (lambda 0, the bare LM, included), once enough of them have a
neighbour.  ``memlm eval`` tunes the same way on its dev split (:func:`tune`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from memlm.knnlm import KnnParams, has_neighbours, interpolate, knn_logprob

INTERPOLATION_FILE = "interpolation.json"  # beside each index version: v000042/interpolation.json


@dataclass(frozen=True)
class TuneGrid:
    """The (k, T, lambda) candidates; the defaults are ``memlm eval``'s dev grid."""

    ks: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512, 1024)
    temperatures: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
    lambdas: tuple[float, ...] = (0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7)

    def __post_init__(self) -> None:
        if not self.ks or not self.temperatures or not self.lambdas:
            raise ValueError("every axis of the grid needs at least one value")
        KnnParams(k=min(self.ks), temperature=min(self.temperatures), lmbda=min(self.lambdas))
        KnnParams(k=max(self.ks), temperature=max(self.temperatures), lmbda=max(self.lambdas))

    def fixed(
        self, *, k: int | None = None, temperature: float | None = None, lmbda: float | None = None
    ) -> TuneGrid:
        """The grid with the given values fixed (their axis holds only that value)."""
        return replace(
            self,
            ks=self.ks if k is None else (k,),
            temperatures=self.temperatures if temperature is None else (temperature,),
            lambdas=self.lambdas if lmbda is None else (lmbda,),
        )

    @property
    def size(self) -> int:
        return len(self.ks) * len(self.temperatures) * len(self.lambdas)

    @property
    def k_max(self) -> int:
        return max(self.ks)


# The service's grid: small, so every build tunes it in well under a second on the
# held-out set's 131k tokens; k <= 64 keeps the records at 64 neighbours (as before) and
# the CPU search cheap; lambda 0 (the bare LM) wins where the memory does not help.
SERVED_GRID = TuneGrid(
    ks=(16, 32, 64),
    temperatures=(1.0, 2.0, 5.0, 10.0),
    lambdas=(0.0, 0.02, 0.05, 0.1, 0.15, 0.25),
)
# Served before the first build with enough held-out tokens.  p >= (1 - lambda) p_LM, so
# lambda 0.005 can never cost more than 0.5% perplexity, whatever the memory holds.
# Measured on SmolLM2-135M over the held-out news of the bundled stream, 2017-02-13 .. 02-22
# (5 days, 11,253 dev + test tokens, each against its evening's memory), 36 candidates
# (benchmarks/served_defaults.py, docs/calibrator.md): with 4 articles a day it is 0.6%
# better than the bare LM with FullMem and MoNIM alike, with 20 a day 1.8-1.9% better, and
# no day is worse; lambda 0.02 loses up to 0.6% on a day with 4 articles a day, and the
# earlier default (k 64, T 5, lambda 0.25) 5-17% overall.
SERVED_DEFAULT = KnnParams(k=64, temperature=2.0, lmbda=0.005)
# Fewer held-out tokens with a neighbour than this: keep the default (a few hundred
# tokens of one article would pick whatever suits that article).
MIN_TUNE_TOKENS = 1024


def token_logprobs(split: dict[str, np.ndarray], params: KnnParams) -> np.ndarray:
    """Augmented log p(gold) of each held-out token under ``params``."""
    k = min(params.k, split["values"].shape[1])
    vals = split["values"][:, :k]
    ids = np.where(vals >= 0, 0, -1)
    gold = split["gold"][:, None]
    knn = knn_logprob(split["distances"][:, :k], ids, vals, gold, params.temperature)[:, 0]
    return interpolate(split["target_lm_logprob"], knn, params.lmbda, has_neighbours(ids))


def ppl(logprobs: np.ndarray) -> float:
    return float(math.exp(-float(np.mean(logprobs)))) if logprobs.size else float("nan")


def tune(split: dict[str, np.ndarray], grid: TuneGrid) -> tuple[KnnParams, float]:
    """The (k, T, lambda) with the lowest perplexity on ``split``; ties keep the first.

    Grid order: k, then T, then lambda, each as listed.  Values of k beyond the split's
    neighbours are skipped; a split without any neighbour gives lambda 0.
    """
    best: tuple[float, KnnParams] | None = None
    if split["values"].size == 0 or (split["values"] < 0).all():
        return KnnParams(lmbda=0.0), ppl(split["target_lm_logprob"])
    k_max = split["values"].shape[1]
    for k in grid.ks:
        if k > k_max:
            continue
        vals = split["values"][:, :k]
        ids = np.where(vals >= 0, 0, -1)
        valid = has_neighbours(ids)
        for t in grid.temperatures:
            knn = knn_logprob(split["distances"][:, :k], ids, vals, split["gold"][:, None], t)[:, 0]
            for lam in grid.lambdas:
                p = ppl(interpolate(split["target_lm_logprob"], knn, lam, valid))
                if best is None or p < best[0]:
                    best = (p, KnnParams(k=k, temperature=t, lmbda=lam))
    if best is None:
        raise ValueError(f"every k of the grid exceeds the {k_max} neighbours held")
    return best[1], best[0]


@dataclass(frozen=True)
class ConstantChoice:
    """The constant chosen at a build and the held-out tokens behind the choice."""

    params: KnnParams
    source: str  # "tuned" | "default" (too few held-out tokens) | "fixed" (one grid point)
    tokens: int  # held-out tokens considered
    tokens_with_neighbours: int
    ppl: float | None  # of the held-out tokens under ``params`` (None without tokens)
    bare_ppl: float | None  # of the same tokens under the bare LM

    def to_json(self) -> dict[str, Any]:
        return {
            "k": self.params.k,
            "temperature": self.params.temperature,
            "lambda": self.params.lmbda,
            "source": self.source,
            "tokens": self.tokens,
            "tokens_with_neighbours": self.tokens_with_neighbours,
            "ppl": self.ppl,
            "bare_ppl": self.bare_ppl,
        }


def choose_constant(
    rows: dict[str, np.ndarray],
    grid: TuneGrid,
    default: KnnParams,
    *,
    min_tokens: int = MIN_TUNE_TOKENS,
) -> ConstantChoice:
    """Tune (k, T, lambda) on held-out rows; the default while fewer than ``min_tokens``
    of them have a neighbour.  A grid of one point is served as it is ("fixed")."""
    n = len(rows["gold"]) if rows else 0
    with_nb = int(has_neighbours(np.where(rows["values"] >= 0, 0, -1)).sum()) if n else 0

    def figures(p: KnnParams) -> tuple[float | None, float | None]:
        if not n:
            return None, None
        return ppl(token_logprobs(rows, p)), ppl(rows["target_lm_logprob"])

    if grid.size == 1:
        p = KnnParams(k=grid.ks[0], temperature=grid.temperatures[0], lmbda=grid.lambdas[0])
        return ConstantChoice(p, "fixed", n, with_nb, *figures(p))
    if with_nb < min_tokens or rows["values"].shape[1] < min(grid.ks):
        return ConstantChoice(default, "default", n, with_nb, *figures(default))
    params, _ = tune(rows, grid)
    return ConstantChoice(params, "tuned", n, with_nb, *figures(params))


def save_choice(index_root: Path, version: int, record: dict[str, Any]) -> Path:
    """Write a version's ``interpolation.json`` atomically (temp + ``os.replace``)."""
    return save_version_json(index_root, version, INTERPOLATION_FILE, record)


def load_choice(index_root: Path, version: int | None) -> tuple[int, dict[str, Any]] | None:
    """The newest ``interpolation.json`` at or below ``version``, with its version."""
    return load_version_json(index_root, version, INTERPOLATION_FILE)


def save_version_json(index_root: Path, version: int, name: str, record: dict[str, Any]) -> Path:
    """Write ``index/v000042/<name>`` atomically (temp + fsync + ``os.replace``)."""
    path = Path(index_root) / f"v{version:06d}" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_version_json(
    index_root: Path, version: int | None, name: str
) -> tuple[int, dict[str, Any]] | None:
    """The newest ``index/v*/<name>`` at or below ``version``, with its version."""
    if version is None:
        return None
    root = Path(index_root)
    usable = sorted(
        int(p.parent.name[1:])
        for p in root.glob(f"v*/{name}")
        if p.parent.name[1:].isdigit() and int(p.parent.name[1:]) <= version
    )
    if not usable:
        return None
    return usable[-1], json.loads((root / f"v{usable[-1]:06d}" / name).read_text())
