"""Learning and forgetting: every month's test set re-scored at the end of every month.

At the last evening of each month of the plan, every test document of the plan (past,
present and future months) is searched against the memory as it stood that evening.
What is kept is exactly what the constant interpolation needs, whatever (k, T) the dev
tuning later picks: log p_kNN(gold) for every (k, T) of the tuning grid, and whether the
token had a neighbour.  These small arrays stand in for the month-end checkpoints of the
datastore, which at full scale would be gigabytes each; the perplexities they give are
the ones a kept checkpoint would give with the same constant.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memlm.calibrator.constant import TuneGrid, ppl
from memlm.knnlm import KnnParams, has_neighbours, interpolate, knn_logprob
from memlm.memory import MemoryBackend


@dataclass(frozen=True)
class Rescore:
    texts: tuple[str, ...]  # every test document of the plan, in the plan's order
    grid: TuneGrid

    def run(self, memory: MemoryBackend, cache: Any, path: Path, depth: int | None = None) -> None:
        """Search the test documents against ``memory`` now (``depth``: the re-rank depth);
        write ``path`` (npz)."""
        ks = list(self.grid.ks)
        k_max = max(ks)
        knn_parts = [np.zeros((0, len(ks), len(self.grid.temperatures)))]
        valid_parts = [np.zeros(0, bool)]
        for o in cache.get_many(list(self.texts)):
            dist, _, vals = memory.search(o.keys, k_max, depth=depth)
            ids = np.where(vals >= 0, 0, -1)
            gold = o.targets[:, None]
            cols = np.empty((len(o), len(ks), len(self.grid.temperatures)))
            for i, k in enumerate(ks):
                for j, t in enumerate(self.grid.temperatures):
                    cols[:, i, j] = knn_logprob(dist[:, :k], ids[:, :k], vals[:, :k], gold, t)[:, 0]
            knn_parts.append(cols)
            valid_parts.append(has_neighbours(ids))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".tmp-{path.name}")
        with open(tmp, "wb") as f:
            np.savez(f, knn=np.concatenate(knn_parts), valid=np.concatenate(valid_parts))
        tmp.replace(path)


def table(
    workdir: Path,
    grid: TuneGrid,
    params: KnnParams,
    lm_logprob: np.ndarray,
    test_months: np.ndarray,
) -> dict[str, dict[str, float]]:
    """{month-end: {test month: ppl}} with the tuned constant ``params``."""
    out: dict[str, dict[str, float]] = {}
    months = sorted(set(test_months.tolist()))
    for p in sorted((workdir / "rescore").glob("*.npz")):
        with np.load(p) as z:
            knn, valid = z["knn"], z["valid"]
        assert len(knn) == len(lm_logprob), (p, len(knn), len(lm_logprob))
        if params.lmbda == 0.0:  # the bare LM was best on dev
            out[p.stem] = {m: ppl(lm_logprob[test_months == m]) for m in months}
            continue
        i = grid.ks.index(min(params.k, max(grid.ks)))
        j = grid.temperatures.index(params.temperature)
        lp = interpolate(lm_logprob, knn[:, i, j], params.lmbda, valid)
        out[p.stem] = {m: ppl(lp[test_months == m]) for m in months}
    return out
