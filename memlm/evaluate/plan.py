"""The plan of a streaming evaluation: which documents each day ingests, tunes on and tests on."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from memlm.corpus import Document, by_day

EPOCH = dt.date(1970, 1, 1)


def day_number(d: dt.date) -> int:
    return (d - EPOCH).days


@dataclass
class DayPlan:
    day: dt.date
    train: list[Document]
    dev: list[Document]
    test: list[Document]


def plan_stream(
    docs: Sequence[Document],
    *,
    days: int | None = None,
    start: dt.date | None = None,
    max_docs_per_day: int | None = None,
    max_eval_docs_per_day: int | None = 2,
    dev_share: float = 0.02,
    test_share: float = 0.02,
    seed: int = 0,
    min_docs_per_day: int = 3,
) -> list[DayPlan]:
    """Split every day (seeded) into dev / test / train; slice with the limits given.

    Dev and test take ``share`` of the day's documents, at least one each; days with fewer
    than ``min_docs_per_day`` documents (stray dates in the bundled news) are ingested only.
    The split is made on the full day before slicing, so a slice's dev and test documents
    are the same as the full run's.
    """
    plans: list[DayPlan] = []
    for day, batch in by_day(docs):
        if start is not None and day < start:
            continue
        rng = np.random.default_rng([seed, day_number(day)])
        order = [batch[i] for i in rng.permutation(len(batch))]
        if len(batch) >= min_docs_per_day:
            n_dev = max(1, round(dev_share * len(batch)))
            n_test = max(1, round(test_share * len(batch)))
        else:
            n_dev = n_test = 0
        dev, test, train = order[:n_dev], order[n_dev : n_dev + n_test], order[n_dev + n_test :]
        train.sort(key=lambda d: d.id)
        if max_docs_per_day is not None:
            train = train[:max_docs_per_day]
        if max_eval_docs_per_day is not None:
            dev, test = dev[:max_eval_docs_per_day], test[:max_eval_docs_per_day]
        plans.append(DayPlan(day, train, dev, test))
        if days is not None and len(plans) >= days:
            break
    return plans


class SplitError(ValueError):
    """A split file names a document twice, one outside the corpus, or unknown keys."""


def plan_from_split(
    docs: Sequence[Document],
    split: dict[str, list[str]],
    *,
    days: int | None = None,
    start: dt.date | None = None,
) -> list[DayPlan]:
    """The plan a split file gives: which document ids go to memory, dev and test.

    ``split``: {"memory": [...], "dev": [...], "test": [...]} of ``Document.id``; within a
    day each list keeps the file's order (memory: the ingest order).  Days holding none of
    them are left out; ``days`` and ``start`` slice the rest.  An id named twice or not in
    the corpus is an error.
    """
    roles: dict[str, str] = {}
    for role in ("memory", "dev", "test"):
        for doc_id in split.get(role, []):
            if doc_id in roles:
                raise SplitError(f"document {doc_id!r} is in both {roles[doc_id]} and {role}")
            roles[doc_id] = role
    extra = set(split) - {"memory", "dev", "test"}
    if extra:
        raise SplitError(f"unknown split keys {sorted(extra)}; use memory, dev and test")
    unknown = set(roles) - {d.id for d in docs}
    if unknown:
        raise SplitError(
            f"{len(unknown)} ids of the split are not in the corpus: {sorted(unknown)[:5]}"
        )
    order = {
        doc_id: i
        for role in ("memory", "dev", "test")
        for i, doc_id in enumerate(split.get(role, []))
    }
    plans: list[DayPlan] = []
    for day, batch in by_day(docs):
        if start is not None and day < start:
            continue
        parts = {
            role: sorted((d for d in batch if roles.get(d.id) == role), key=lambda d: order[d.id])
            for role in ("memory", "dev", "test")
        }
        if not any(parts.values()):
            continue
        plans.append(DayPlan(day, parts["memory"], parts["dev"], parts["test"]))
        if days is not None and len(plans) >= days:
            break
    return plans


def split_of(plans: Sequence[DayPlan]) -> dict[str, list[str]]:
    """The split file of a plan (what ``--split`` reads back into the same plan)."""
    return {
        "memory": [d.id for p in plans for d in p.train],
        "dev": [d.id for p in plans for d in p.dev],
        "test": [d.id for p in plans for d in p.test],
    }
