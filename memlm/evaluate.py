"""Streaming evaluation: how well each memorisation policy learns a dated stream.

Each day of the stream: a seeded share of the day's documents is held out as dev and
test; the rest is ingested with the policy (every token scored against the memory served
at that moment: built index + fresh entries); at the end of the day the index is rebuilt
and that day's dev and test documents are searched against the memory of that evening.
Afterwards k, T and lambda are tuned on the dev tokens of all days and applied, unchanged,
to the test tokens.  The frozen LM's per-token outputs are cached on disk, so comparing
policies never re-encodes the stream.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from memlm.corpus import Document, by_day
from memlm.datastore import Datastore
from memlm.encoder import Encoder, TokenOutputs, WindowConfig, cache_dir
from memlm.index import IndexParams, MemoryIndex, build_index
from memlm.interpolation import (
    MIN_TUNE_TOKENS,
    SERVED_DEFAULT,
    SERVED_GRID,
    TuneGrid,
    choose_constant,
    ppl,
    token_logprobs,
    tune,
)
from memlm.knnlm import KnnParams, has_neighbours
from memlm.lexical import LexicalStats
from memlm.policy import (
    DEFAULT_DELTA,
    DEFAULT_KL_DELTA,
    Policy,
    TokenScores,
    make_policy,
    token_scores,
)

log = logging.getLogger(__name__)

EPOCH = dt.date(1970, 1, 1)


def day_number(d: dt.date) -> int:
    return (d - EPOCH).days


# --- the plan: which documents are ingested, tuned on and tested on ----------------------


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


# --- cached LM outputs ------------------------------------------------------------------------


class TokenCache:
    """Per-document encoder outputs on disk, keyed by model, window and token ids.

    Keys are kept in float32, as the encoder returns them: held-out tokens query the
    memory with the same float32 keys the service queries with (the datastore stores
    float16 keys either way).  Caches written before that held float16 keys; the
    ``-k32`` directory suffix keeps the two from ever mixing.
    """

    def __init__(self, encoder: Encoder, window: WindowConfig, root: Path | None = None):
        self.encoder, self.window = encoder, window
        slug = encoder.name.replace("/", "_")
        if encoder.precision != "float32":  # another key space: never share float32's cache
            slug += f"-{encoder.precision}"
        self.root = (
            root or cache_dir() / "encoded"
        ) / f"{slug}-c{window.context}-s{window.stride}-k32"
        self.root.mkdir(parents=True, exist_ok=True)
        self.encoded_tokens = 0  # tokens encoded by this process (not found in the cache)
        self.encode_seconds = 0.0

    def _path(self, ids: Sequence[int]) -> Path:
        h = hashlib.sha1(np.asarray(ids, dtype=np.int32).tobytes()).hexdigest()[:20]
        return self.root / f"{h}.npz"

    def get_many(self, texts: Sequence[str], progress: bool = False) -> list[TokenOutputs]:
        ids = [self.encoder.tokenize(t) for t in texts]
        out: dict[int, TokenOutputs] = {}
        missing = []
        for i, doc_ids in enumerate(ids):
            p = self._path(doc_ids)
            if p.exists():
                with np.load(p) as z:
                    arrays = {f.name: z[f.name] for f in fields(TokenOutputs) if f.name in z}
                if arrays["keys"].dtype != np.float32:  # not written by this version
                    missing.append(i)
                    continue
                pos = arrays["positions"]
                arrays["prev_tokens"] = np.asarray(doc_ids, np.int64)[pos - 1]
                out[i] = TokenOutputs(**arrays)
            else:
                missing.append(i)
        if missing:
            t0 = time.perf_counter()
            enc = self.encoder.encode_many(
                [ids[i] for i in missing], self.window, progress=progress
            )
            self.encode_seconds += time.perf_counter() - t0
            for i, o in zip(missing, enc, strict=True):
                self.encoded_tokens += len(o)
                p = self._path(ids[i])
                tmp = p.with_suffix(".tmp.npz")
                arrays = {f.name: getattr(o, f.name) for f in fields(TokenOutputs)}
                del arrays["prev_tokens"]  # derived from the token ids on load
                arrays["keys"] = o.keys.astype(np.float32)  # queries in float32, as served
                np.savez(tmp, **arrays)
                tmp.replace(p)
                o.keys = arrays["keys"]  # same values as a reload
                out[i] = o
        return [out[i] for i in range(len(texts))]


# --- one policy over the stream -------------------------------------------------------------


@dataclass
class EvalTokens:
    """Search results of held-out tokens, kept for tuning; rows are tokens."""

    target_lm_logprob: list[np.ndarray] = field(default_factory=list)
    distances: list[np.ndarray] = field(default_factory=list)  # (n, k_max) float32
    values: list[np.ndarray] = field(default_factory=list)  # (n, k_max) int32, -1 padding
    day: list[np.ndarray] = field(default_factory=list)  # (n,) int32 day number
    doc: list[np.ndarray] = field(default_factory=list)  # (n,) int32 index of the doc in the plan
    gold: list[np.ndarray] = field(default_factory=list)  # (n,) int64 gold token
    # calibrator features known before the search
    top_logprob: list[np.ndarray] = field(default_factory=list)  # (n,) max log p_LM
    entropy: list[np.ndarray] = field(default_factory=list)  # (n,) entropy of p_LM
    lexical: list[np.ndarray] = field(default_factory=list)  # (n, 2) LexicalStats.features
    # TRIME Eq. 6 log p(gold) with local/long-term memory, one column per tau (optional)
    trime: list[np.ndarray] = field(default_factory=list)  # (n, len(taus)) float64

    def add(
        self,
        o: TokenOutputs,
        dist: np.ndarray,
        vals: np.ndarray,
        day: int,
        doc: int,
        lexical: np.ndarray,
        trime: np.ndarray | None = None,
    ) -> None:
        self.target_lm_logprob.append(o.target_logprob.astype(np.float64))
        self.distances.append(dist)
        self.values.append(vals)
        self.day.append(np.full(len(o), day, np.int32))
        self.doc.append(np.full(len(o), doc, np.int32))
        self.gold.append(o.targets)
        self.top_logprob.append(o.top_logprob)
        self.entropy.append(o.entropy)
        self.lexical.append(lexical)
        if trime is not None:
            self.trime.append(trime)

    def arrays(self, k_max: int) -> dict[str, np.ndarray]:
        if not self.target_lm_logprob:
            return {
                "target_lm_logprob": np.zeros(0),
                "distances": np.zeros((0, k_max), np.float32),
                "values": np.zeros((0, k_max), np.int32),
                "day": np.zeros(0, np.int32),
                "doc": np.zeros(0, np.int32),
                "gold": np.zeros(0, np.int64),
                "top_logprob": np.zeros(0, np.float32),
                "entropy": np.zeros(0, np.float32),
                "lexical": np.zeros((0, 2), np.float32),
                "trime": np.zeros((0, 0)),
            }
        out = {
            f.name: np.concatenate(getattr(self, f.name)) for f in fields(self) if f.name != "trime"
        }
        out["trime"] = np.concatenate(self.trime) if self.trime else np.zeros((0, 0))
        return out


@dataclass
class DayStats:
    day: str
    tokens_seen: int
    tokens_stored: int
    entries: int
    seconds: float
    ingest: dict[str, Any] = field(default_factory=dict)  # the interpolation MoNIM asked


@dataclass
class PolicyRun:
    name: str
    days: list[DayStats]
    dev: dict[str, np.ndarray]
    test: dict[str, np.ndarray]
    entries: int
    tokens_seen: int
    tokens_stored: int

    @property
    def memrate(self) -> float:
        return self.tokens_stored / self.tokens_seen if self.tokens_seen else 0.0


@dataclass(frozen=True)
class TrimeSpec:
    """TRIME local (and long-term) memory inside the LM's softmax (TRIME Eq. 5/6)."""

    long_segments: int = 0  # earlier windows of the same document; 0: local memory only
    # SmolLM2 key similarities are ~2-3.5 against logit log-sum-exps of 12-31, so the
    # grid reaches small tau (docs/trime.md)
    taus: tuple[float, ...] = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 4.0, 8.0)

    def columns(self, o: TokenOutputs, window: WindowConfig) -> np.ndarray:
        from memlm.trime_memory import cached_doc_logprobs

        if len(o) == 0:
            return np.zeros((0, len(self.taus)))
        return cached_doc_logprobs(
            o.keys,
            o.targets,
            o.target_logprob,
            o.lse,
            o.positions,
            window.windows(int(o.positions[-1]) + 1),
            long_tokens=self.long_segments * window.context,
            taus=self.taus,
        )


def run_policy(
    policy: Policy | None,
    plans: Sequence[DayPlan],
    cache: TokenCache,
    workdir: Path,
    *,
    ingest_params: KnnParams | None,
    k_max: int,
    index_kind: str = "auto",
    on_day: Callable[[DayStats], None] | None = None,
    trime: TrimeSpec | None = None,
    served_grid: TuneGrid = SERVED_GRID,
    served_default: KnnParams = SERVED_DEFAULT,
    served_min_tokens: int = MIN_TUNE_TOKENS,
) -> PolicyRun:
    """Ingest the stream with ``policy`` (None: the bare LM) and search the held-out tokens.

    ``ingest_params``: the constant MoNIM scores with; None: the interpolation the service
    would serve, ``served_default`` until the dev tokens of the days so far (each searched
    against its evening's memory, as the service's held-out tokens are) choose one from
    ``served_grid`` after an evening's build, as the service does at its nightly build.
    """
    name = policy.name if policy is not None else "bare"
    shutil.rmtree(workdir, ignore_errors=True)
    ds = Datastore.open(workdir / "datastore", dim=cache.encoder.dim)
    index = MemoryIndex(ds, workdir / "index")
    dev, test = EvalTokens(), EvalTokens()
    lexical = LexicalStats(cache.encoder.vocab_size)
    days: list[DayStats] = []
    seen = stored = 0
    doc_no = 0
    served: dict[str, Any] = {
        "params": ingest_params or served_default,
        "source": "fixed" if ingest_params is not None else "default",
    }
    for plan in plans:
        t0 = time.perf_counter()
        dnum = day_number(plan.day)
        day_seen = day_stored = 0
        knn: KnnParams = served["params"]
        asked = {
            "k": knn.k,
            "temperature": knn.temperature,
            "lambda": knn.lmbda,
            "source": served["source"],
        }
        outs = cache.get_many([d.text for d in plan.train])
        for o in outs:
            doc_no += 1
            n = len(o)
            lexical.update(np.concatenate([o.prev_tokens[:1], o.targets]))
            day_seen += n
            if policy is None or n == 0:
                continue
            if policy.needs_augmented:
                dist, _, vals = index.search_values(o.keys, knn.k)
                scores = token_scores(cache.encoder, o, dist, vals, knn)
            else:
                nan = np.full(n, np.nan)
                scores = TokenScores(nan, nan, o.key_ce)
            mask = policy.decide(scores)
            if mask.any():
                ds.append(
                    o.keys[mask].astype(np.float16),
                    o.targets[mask].astype(np.int32),
                    np.full(int(mask.sum()), doc_no, np.int64),
                    o.positions[mask],
                    np.full(int(mask.sum()), dnum, np.int32),
                )
                index.refresh()
            day_stored += int(mask.sum())
        if policy is not None and len(ds) > 0:
            params = (
                IndexParams.exact()
                if index_kind == "flat"
                else IndexParams.for_size(ds.num_live, ds.dim)
            )
            build_index(ds, workdir / "index", params, progress=False)
            index.reload()
        for split, docs in (("dev", plan.dev), ("test", plan.test)):
            target = dev if split == "dev" else test
            for i, o in enumerate(cache.get_many([d.text for d in docs])):
                dist, _, vals = index.search_values(o.keys, k_max)
                cols = None if trime is None else trime.columns(o, cache.window)
                target.add(o, dist, vals, dnum, i, lexical.features(o.prev_tokens), cols)
        if ingest_params is None and policy is not None and policy.needs_augmented:
            choice = choose_constant(
                dev.arrays(k_max), served_grid, served_default, min_tokens=served_min_tokens
            )
            served = {"params": choice.params, "source": choice.source}
        seen += day_seen
        stored += day_stored
        stats = DayStats(
            plan.day.isoformat(),
            day_seen,
            day_stored,
            ds.num_live,
            time.perf_counter() - t0,
            asked if policy is not None and policy.needs_augmented else {},
        )
        days.append(stats)
        if on_day:
            on_day(stats)
    return PolicyRun(name, days, dev.arrays(k_max), test.arrays(k_max), ds.num_live, seen, stored)


# --- the whole evaluation --------------------------------------------------------------------


@dataclass
class EvalConfig:
    corpus: str = "news"
    model: str = "smollm2-135m"
    window: WindowConfig = field(default_factory=WindowConfig)
    days: int | None = None
    start: dt.date | None = None
    max_docs_per_day: int | None = None
    max_eval_docs_per_day: int | None = 2
    dev_share: float = 0.02
    test_share: float = 0.02
    seed: int = 0
    policies: tuple[str, ...] = ("fullmem", "randmem", "monim", "monim-amt", "monim-kl")
    delta: float = DEFAULT_DELTA
    kl_delta: float = DEFAULT_KL_DELTA
    rand_rate: float | None = None  # None: MoNIM's measured rate (0.5 if MoNIM is not run)
    # MoNIM's ingest interpolation; None: the one the service would serve (run_policy)
    ingest: KnnParams | None = None
    # Fixed k, T, lambda (outside comparisons): not tuned, for test and ingest alike
    k: int | None = None
    temperature: float | None = None
    lmbda: float | None = None
    split: dict[str, list[str]] | None = None  # --split: document ids of memory, dev, test
    split_file: str | None = None
    k_max: int = 1024  # MoNIM searches 1K neighbours; tuning picks k <= k_max on dev
    index_kind: str = "auto"
    grid: TuneGrid = field(default_factory=TuneGrid)
    threads: int | None = None
    keep_stores: bool = False
    lambda_mode: str = "constant"  # or "calibrated": the NN calibrator (memlm.calibrator)
    gate_theta: float = 0.0  # calibrated only: skip the search when the gate's lambda < theta
    trime: TrimeSpec | None = None  # TRIME local/long-term memory (--local-memory/--long-memory)


def evaluate(
    cfg: EvalConfig,
    docs: Sequence[Document],
    out: Path,
    *,
    encoder: Encoder | None = None,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run every policy over the stream slice and write report.json, report.md and plots."""
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    encoder = encoder or Encoder.load(cfg.model, threads=cfg.threads)
    if "monim-kl" in cfg.policies:
        encoder.compute_key_ce = True
    if cfg.split is not None:
        plans = plan_from_split(docs, cfg.split, days=cfg.days, start=cfg.start)
    else:
        plans = plan_stream(
            docs,
            days=cfg.days,
            start=cfg.start,
            max_docs_per_day=cfg.max_docs_per_day,
            max_eval_docs_per_day=cfg.max_eval_docs_per_day,
            dev_share=cfg.dev_share,
            test_share=cfg.test_share,
            seed=cfg.seed,
        )
    (out / "split.json").write_text(json.dumps(split_of(plans), indent=1))
    cache = TokenCache(encoder, cfg.window, root=None)
    if encoder.compute_key_ce:
        cache.root = cache.root.with_name(cache.root.name + "-kce")
        cache.root.mkdir(parents=True, exist_ok=True)
    n_train = sum(len(p.train) for p in plans)
    echo(
        f"{len(plans)} days, {n_train} ingested documents, "
        f"{sum(len(p.dev) for p in plans)} dev / {sum(len(p.test) for p in plans)} test documents"
    )
    # Encode everything once (cached across runs), with a progress bar.
    all_texts = [d.text for p in plans for d in (*p.train, *p.dev, *p.test)]
    cache.get_many(all_texts, progress=True)
    echo(f"encoded {cache.encoded_tokens} new tokens in {cache.encode_seconds:.0f} s (rest cached)")

    order = [
        p for p in ("fullmem", "monim", "monim-amt", "monim-kl", "randmem") if p in cfg.policies
    ]
    unknown = set(cfg.policies) - set(order) - {"bare"}
    if unknown:
        raise ValueError(f"unknown policies: {sorted(unknown)}")
    runs: dict[str, PolicyRun] = {}
    workroot = out / "work"
    for name in ["bare", *order]:
        if name == "randmem":
            rate = cfg.rand_rate
            if rate is None:
                rate = runs["monim"].memrate if "monim" in runs else 0.5
            policy: Policy | None = make_policy("randmem", rate=rate, seed=cfg.seed)
        elif name == "bare":
            policy = None
        else:
            policy = make_policy(name, delta=cfg.kl_delta if name == "monim-kl" else cfg.delta)
        t0 = time.perf_counter()
        run = run_policy(
            policy,
            plans,
            cache,
            workroot / name,
            ingest_params=cfg.ingest,
            k_max=cfg.k_max,
            index_kind=cfg.index_kind,
            trime=cfg.trime,
            served_grid=_fixed(SERVED_GRID, cfg),
            served_default=KnnParams(
                k=cfg.k or SERVED_DEFAULT.k,
                temperature=cfg.temperature or SERVED_DEFAULT.temperature,
                lmbda=SERVED_DEFAULT.lmbda if cfg.lmbda is None else cfg.lmbda,
            ),
        )
        runs[name] = run
        echo(
            f"{name:10s} memrate {run.memrate:6.1%} entries {run.entries:8d} ({time.perf_counter() - t0:.0f} s)"
        )
        if not cfg.keep_stores:
            shutil.rmtree(workroot / name, ignore_errors=True)

    report = _report(cfg, plans, runs, time.perf_counter() - t_start, cache)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(render_markdown(report))
    _plots(report, out)
    return report


def _fixed(grid: TuneGrid, cfg: EvalConfig) -> TuneGrid:
    """``grid`` with the values ``--k``, ``--temperature``, ``--lambda-value`` fix."""
    return grid.fixed(k=cfg.k, temperature=cfg.temperature, lmbda=cfg.lmbda)


def _report(
    cfg: EvalConfig,
    plans: Sequence[DayPlan],
    runs: dict[str, PolicyRun],
    seconds: float,
    cache: TokenCache,
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    per_day: dict[str, list[dict[str, Any]]] = {}
    test_months = np.array([plans_day_month(d) for d in runs["bare"].test["day"]])
    for name, run in runs.items():
        tau = _apply_trime(run, cfg) if cfg.trime is not None else None
        if name == "bare":
            params, dev_ppl = KnnParams(lmbda=0.0), ppl(run.dev["target_lm_logprob"])
            test_lp = run.test["target_lm_logprob"]
        else:
            params, dev_ppl = tune(run.dev, _fixed(cfg.grid, cfg))
            test_lp = token_logprobs(run.test, params)
            if cfg.lambda_mode == "calibrated":
                test_lp, calibrated = _calibrated_test(run, params, cfg)
        results[name] = {
            **(calibrated if name != "bare" and cfg.lambda_mode == "calibrated" else {}),
            "test_ppl": ppl(test_lp),
            "dev_ppl": dev_ppl,
            "memrate": run.memrate,
            "entries": run.entries,
            "tokens_seen": run.tokens_seen,
            "lambda": params.lmbda,
            "temperature": params.temperature if name != "bare" else None,
            "k": params.k if name != "bare" else None,
            "tau": tau,
            "test_tokens": int(test_lp.size),
            "dev_tokens": int(run.dev["target_lm_logprob"].size),
            "test_ppl_per_month": {
                m: ppl(test_lp[test_months == m]) for m in sorted(set(test_months.tolist()))
            },
        }
        rows = []
        cum_seen = cum_stored = 0
        for ds_ in run.days:
            cum_seen += ds_.tokens_seen
            cum_stored += ds_.tokens_stored
            dnum = day_number(dt.date.fromisoformat(ds_.day))
            sofar = test_lp[run.test["day"] <= dnum]
            rows.append(
                {
                    "day": ds_.day,
                    "tokens_seen": ds_.tokens_seen,
                    "stored": ds_.tokens_stored,
                    "entries": ds_.entries,
                    "memrate_cumulative": cum_stored / cum_seen if cum_seen else 0.0,
                    "test_ppl_so_far": ppl(sofar),
                    "seconds": round(ds_.seconds, 2),
                    "ingest_knn": ds_.ingest or None,
                }
            )
        per_day[name] = rows
    return {
        "settings": {
            "model": cfg.model,
            "corpus": cfg.corpus,
            "slice": {
                "days": len(plans),
                "first_day": plans[0].day.isoformat() if plans else None,
                "last_day": plans[-1].day.isoformat() if plans else None,
                "max_docs_per_day": cfg.max_docs_per_day,
                "max_eval_docs_per_day": cfg.max_eval_docs_per_day,
                "train_documents": sum(len(p.train) for p in plans),
                "dev_documents": sum(len(p.dev) for p in plans),
                "test_documents": sum(len(p.test) for p in plans),
            },
            "window": asdict(cfg.window),
            "k_max": cfg.k_max,
            "ingest_knn": "served" if cfg.ingest is None else asdict(cfg.ingest),
            "fixed": {"k": cfg.k, "temperature": cfg.temperature, "lambda": cfg.lmbda},
            "split_file": cfg.split_file,
            # the cache keeps the encoder's float32 keys: held-out and ingest queries are
            # float32, as the service's; the datastore stores float16 keys
            "query_precision": "float32",
            "delta": cfg.delta,
            "kl_delta": cfg.kl_delta,
            "rand_rate": runs["randmem"].memrate if "randmem" in runs else None,
            "seeds": {"split": cfg.seed, "randmem": cfg.seed},
            "index_kind": cfg.index_kind,
            "tuning": "k, temperature, lambda: grid search on dev tokens (all days), applied to "
            "test; values fixed by --k/--temperature/--lambda-value are not tuned",
            "lambda_mode": cfg.lambda_mode,
            "trime": None if cfg.trime is None else asdict(cfg.trime),
            "gate_theta": cfg.gate_theta if cfg.lambda_mode == "calibrated" else None,
            "seconds": round(seconds, 1),
            "encoded_tokens_this_run": cache.encoded_tokens,
        },
        "results": results,
        "per_day": per_day,
    }


def _apply_trime(run: PolicyRun, cfg: EvalConfig) -> float:
    """Pick tau on dev and make its TRIME column the "LM" log-probability of both splits.

    The external memory is then interpolated with that distribution (TRIME App. A).
    """
    assert cfg.trime is not None
    best: tuple[float, int] | None = None
    for c in range(len(cfg.trime.taus)):
        dev = {**run.dev, "target_lm_logprob": run.dev["trime"][:, c]}
        p = tune(dev, cfg.grid)[1] if run.name != "bare" else ppl(dev["target_lm_logprob"])
        if best is None or p < best[0]:
            best = (p, c)
    assert best is not None
    c = best[1]
    run.dev["target_lm_logprob"] = run.dev["trime"][:, c]
    run.test["target_lm_logprob"] = run.test["trime"][:, c]
    return cfg.trime.taus[c]


def _calibrated_test(
    run: PolicyRun, params: KnnParams, cfg: EvalConfig
) -> tuple[np.ndarray, dict[str, Any]]:
    """Test log-probabilities with the calibrator trained day by day on dev (memlm.calibrator)."""
    from memlm.calibrator import calibrate_stream, gate_config

    gate = gate_config() if cfg.gate_theta > 0 else None
    res = calibrate_stream(run.dev, run.test, params, gate=gate, theta=cfg.gate_theta)
    valid = has_neighbours(np.where(run.test["values"] >= 0, 0, -1))
    return res.logprobs, {
        "constant_lambda_test_ppl": ppl(token_logprobs(run.test, params)),
        "mean_calibrated_lambda": float(res.lambdas[valid].mean()) if valid.any() else 0.0,
        "searches_skipped": res.skipped_share,
    }


def plans_day_month(day_num: int) -> str:
    d = EPOCH + dt.timedelta(days=int(day_num))
    return f"{d.year:04d}-{d.month:02d}"


def render_markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    sl = s["slice"]
    lines = [
        f"# memlm eval: {s['corpus']} with {s['model']}",
        "",
        f"{sl['days']} days ({sl['first_day']} .. {sl['last_day']}), {sl['train_documents']} ingested "
        f"documents, {sl['dev_documents']} dev / {sl['test_documents']} test documents; window "
        f"{s['window']['context']} tokens, stride {s['window']['stride']}; k, T, lambda tuned on dev; "
        f"lambda: {s.get('lambda_mode', 'constant')}"
        + (
            f" (NN calibrator, gate theta {s['gate_theta']:g})"
            if s.get("lambda_mode") == "calibrated"
            else ""
        )
        + ".",
        "",
        "| policy | test ppl | dev ppl | MemRate | entries | tokens seen | lambda | T | k |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in report["results"].items():
        lines.append(
            f"| {name} | {r['test_ppl']:.2f} | {r['dev_ppl']:.2f} | {r['memrate']:.1%} | {r['entries']} "
            f"| {r['tokens_seen']} | {r['lambda']:g} | {r['temperature'] or '-'} | {r['k'] or '-'} |"
        )
    if s.get("trime"):
        t = s["trime"]
        memory = "local" + (
            f" + {t['long_segments']} earlier windows" if t["long_segments"] else ""
        )
        taus = ", ".join(f"{n} {r['tau']:g}" for n, r in report["results"].items())
        lines += ["", f"TRIME memory in the LM's softmax: {memory}; tau tuned on dev: {taus}."]
    months = sorted({m for r in report["results"].values() for m in r["test_ppl_per_month"]})
    if months:
        lines += ["", "Test perplexity per month:", "", "| policy | " + " | ".join(months) + " |"]
        lines.append("|---|" + "---:|" * len(months))
        for name, r in report["results"].items():
            cells = [f"{r['test_ppl_per_month'].get(m, float('nan')):.2f}" for m in months]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"Total time {s['seconds']} s."]
    return "\n".join(lines) + "\n"


def _plots(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_day = report["per_day"]
    policies = [p for p in per_day if p != "bare"]
    specs = [
        ("memrate.png", "cumulative MemRate", lambda r: r["memrate_cumulative"], policies),
        ("memory_growth.png", "entries in memory", lambda r: r["entries"], policies),
        ("perplexity.png", "test perplexity so far", lambda r: r["test_ppl_so_far"], list(per_day)),
    ]
    for fname, ylabel, fn, names in specs:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name in names:
            rows = per_day[name]
            ax.plot(range(1, len(rows) + 1), [fn(r) for r in rows], marker="o", ms=3, label=name)
        days = [r["day"][5:] for r in per_day[names[0]]] if names else []
        ax.set_xticks(range(1, len(days) + 1), days, rotation=45, fontsize=8)
        ax.set_xlabel("stream day (MM-DD)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
