"""Every system's scores on the same test tokens: paired comparisons, and their record.

The memory policies, the bare model and the fine-tuning baseline all score the plan's test
documents token for token in one order (day, then document, then position).  Keeping those
log-probabilities side by side lets any two systems be compared on the same document
resamples (``bootstrap.wins``), and ``test_documents.json`` keeps each document's sum
and token count, with its id, so that runs over the same ``split.json`` can be paired later.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from memlm.evaluate.bootstrap import (
    RESAMPLES,
    doc_sums,
    resampled_ppl,
    resampled_ppl_of_sums,
    wins,
)
from memlm.evaluate.plan import DayPlan, day_number


@dataclass
class PairedScores:
    """log p(gold) of every test token per system, and each token's document key."""

    doc_keys: np.ndarray
    logprobs: dict[str, np.ndarray] = field(default_factory=dict)

    def add(self, system: str, logprobs: np.ndarray) -> None:
        if logprobs.shape != self.doc_keys.shape:
            raise ValueError(
                f"{system} scored {logprobs.size} test tokens, the others {self.doc_keys.size}: "
                "the systems do not share one test set"
            )
        self.logprobs[system] = logprobs

    def win_shares(self, system: str, others: Iterable[str], *, resamples: int) -> dict[str, float]:
        """Share of paired document resamples in which ``system`` has the lower perplexity
        than each of ``others`` (those scored, other than itself)."""

        def draws(s: str) -> np.ndarray:  # one seed: every system draws the same documents
            return resampled_ppl(self.logprobs[s], self.doc_keys, resamples=resamples)

        mine = draws(system)
        return {o: wins(mine, draws(o)) for o in others if o in self.logprobs and o != system}


KEY_STRIDE = 100_000  # a test document's key: day number * KEY_STRIDE + its index that day


def write_test_documents(path: Path, scores: PairedScores, plans: Sequence[DayPlan]) -> None:
    """Per test document: id, day, tokens, and each system's sum of log-probabilities."""
    ids = {
        day_number(p.day) * KEY_STRIDE + j: (d.id, p.day.isoformat())
        for p in plans
        for j, d in enumerate(p.test)
    }
    _, first = np.unique(scores.doc_keys, return_index=True)
    order = scores.doc_keys[np.sort(first)]  # doc_sums' order: first appearance
    sums = {s: doc_sums(lp, scores.doc_keys) for s, lp in scores.logprobs.items()}
    tokens = next(iter(sums.values()))[1] if sums else np.zeros(len(order))
    what = {
        "what": "test documents in scoring order; logprob_sums[system][i] is the sum of "
        "log p(gold) over document i's scored tokens",
        "documents": [
            {"id": ids[int(k)][0], "day": ids[int(k)][1], "tokens": int(n)}
            for k, n in zip(order, tokens, strict=True)
        ],
        "logprob_sums": {s: [round(float(x), 6) for x in v[0]] for s, v in sums.items()},
    }
    path.write_text(json.dumps(what, indent=1))


class PairingError(ValueError):
    """Runs that cannot be paired: no test documents in common, or not the same tokens."""


def _read(path: Path) -> dict[str, Any]:
    file = path / "test_documents.json" if path.is_dir() else path
    if not file.exists():
        raise PairingError(f"{file}: no such file (runs made before test_documents.json lack it)")
    try:
        what = json.loads(file.read_text())
        docs, sums = what["documents"], what["logprob_sums"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise PairingError(f"{file}: not a test_documents.json ({exc})") from exc
    return {"file": file, "documents": docs, "logprob_sums": sums}


def compare_runs(
    runs: dict[str, Path], *, resamples: int = RESAMPLES, seed: int = 0, level: float = 0.95
) -> dict[str, Any]:
    """Pair every system of every run (``label/system``) on the test documents the runs
    share: each system's perplexity on them with a bootstrap interval, and for each pair the
    share of document resamples in which the first has the lower perplexity."""
    read = {label: _read(Path(p)) for label, p in runs.items()}
    common = set.intersection(*({d["id"] for d in r["documents"]} for r in read.values()))
    if not common:
        raise PairingError("the runs share no test document: were they made from one split?")
    ids = sorted(common)
    tokens: dict[str, int] = {}
    columns: dict[str, np.ndarray] = {}
    for label, r in read.items():
        where = {d["id"]: i for i, d in enumerate(r["documents"])}
        for i in ids:
            n = int(r["documents"][where[i]]["tokens"])
            if tokens.setdefault(i, n) != n:
                raise PairingError(
                    f"test document {i} has {tokens[i]} scored tokens in one run and {n} in "
                    f"{label}: the runs used other windows or tokenizers"
                )
        for system, sums in r["logprob_sums"].items():
            columns[f"{label}/{system}"] = np.array([sums[where[i]] for i in ids], np.float64)
    counts = np.array([tokens[i] for i in ids], np.float64)
    draws = {
        s: resampled_ppl_of_sums(v, counts, resamples=resamples, seed=seed)
        for s, v in columns.items()
    }
    a = (1 - level) / 2
    return {
        "documents": len(ids),
        "tokens": int(counts.sum()),
        "only_in_some_runs": sum(len(r["documents"]) for r in read.values()) - len(ids) * len(read),
        "bootstrap": f"{resamples} resamples of the shared test documents, seed {seed}",
        "systems": {
            s: {
                "ppl": float(np.exp(-v.sum() / counts.sum())),
                "ci": [float(np.quantile(draws[s], a)), float(np.quantile(draws[s], 1 - a))],
            }
            for s, v in columns.items()
        },
        "win_share": {s: {o: wins(draws[s], draws[o]) for o in columns if o != s} for s in columns},
    }
