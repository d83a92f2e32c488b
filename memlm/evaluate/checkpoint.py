"""Resumable runs: what a policy's run checkpoints after each finished day.

``<workdir>/checkpoint.json`` names the days finished, the counters, the datastore's
length and the index version of that evening, and the interpolation MoNIM asks with
next; beside it ``lexical.npz`` (the stream's lexical statistics) and one file of dev
and test search results per day (``eval/day-NNNN.npz``).  Every file is written as temp
+ ``os.replace`` and the JSON last, so a crash leaves the previous day's checkpoint
whole.  Resuming cuts the datastore back to the checkpointed length (entries of the
unfinished day), serves the checkpointed index version and goes on with the next day.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from memlm.evaluate.records import DayStats, EvalTokens, eval_tokens_of, extend
from memlm.knnlm import KnnParams

CHECKPOINT = "checkpoint.json"


class SimulatedInterruption(RuntimeError):
    """Raised by ``crash_at`` after a day's checkpoint, so tests can resume a run."""


@dataclass
class RunState:
    """Everything a policy's run carries from one evening to the next morning."""

    days: list[DayStats] = field(default_factory=list)
    seen: int = 0
    stored: int = 0
    doc_no: int = 0
    served: dict[str, Any] = field(default_factory=dict)  # {"params": KnnParams, "source"}
    datastore_len: int = 0
    index_version: int | None = None
    finished: bool = False

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["served"] = {**self.served, "params": asdict(self.served["params"])}
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> RunState:
        obj = dict(obj)
        obj["days"] = [DayStats(**d) for d in obj["days"]]
        obj["served"] = {**obj["served"], "params": KnnParams(**obj["served"]["params"])}
        return cls(**obj)


def _atomic_savez(path: Path, arrays: dict[str, np.ndarray]) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_arrays(path: Path, arrays: dict[str, np.ndarray]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_savez(path, arrays)


def load_arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def save_day(workdir: Path, index: int, dev: EvalTokens, test: EvalTokens, k_max: int) -> None:
    """The search results of day ``index`` (before the checkpoint JSON names the day)."""
    d = workdir / "eval"
    d.mkdir(parents=True, exist_ok=True)
    arrays = {f"dev_{k}": v for k, v in dev.arrays(k_max).items()}
    arrays |= {f"test_{k}": v for k, v in test.arrays(k_max).items()}
    _atomic_savez(d / f"day-{index:04d}.npz", arrays)


def save(workdir: Path, state: RunState) -> None:
    tmp = workdir / f".tmp-{CHECKPOINT}"
    tmp.write_text(json.dumps(state.to_json(), indent=1))
    os.replace(tmp, workdir / CHECKPOINT)


def load(workdir: Path) -> RunState | None:
    p = workdir / CHECKPOINT
    return RunState.from_json(json.loads(p.read_text())) if p.exists() else None


def load_eval(workdir: Path, n_days: int) -> tuple[EvalTokens, EvalTokens]:
    """The dev and test search results of the first ``n_days`` days."""
    dev, test = EvalTokens(), EvalTokens()
    for i in range(n_days):
        with np.load(workdir / "eval" / f"day-{i:04d}.npz") as z:
            for prefix, into in (("dev_", dev), ("test_", test)):
                arrays = {k[len(prefix) :]: z[k] for k in z.files if k.startswith(prefix)}
                extend(into, eval_tokens_of(arrays))
    return dev, test
