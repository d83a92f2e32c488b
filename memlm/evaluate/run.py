"""One policy over the stream: ingest each day, rebuild, search the held-out tokens."""

from __future__ import annotations

import datetime as dt
import functools
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from memlm.calibrator.constant import (
    MIN_TUNE_TOKENS,
    SERVED_DEFAULT,
    SERVED_GRID,
    TuneGrid,
    choose_constant,
)
from memlm.calibrator.evidence import PRIOR, EvidenceModel, fit_best, views
from memlm.calibrator.lexical import LexicalStats
from memlm.corpus import Document
from memlm.datastore import Datastore
from memlm.encoder import TokenOutputs, WindowConfig
from memlm.evaluate import checkpoint
from memlm.evaluate.cache import TokenCache
from memlm.evaluate.checkpoint import RunState, SimulatedInterruption
from memlm.evaluate.forgetting import Rescore
from memlm.evaluate.memories import FAISS, RunMemory, entry_logprobs, restore
from memlm.evaluate.plan import DayPlan, day_number
from memlm.evaluate.records import DayStats, EvalTokens, PolicyRun, extend
from memlm.evaluate.served import EveningBuilds, with_seen_view
from memlm.index import IndexParams, MemoryIndex
from memlm.knnlm import KnnParams
from memlm.knnlm.policy import Policy, TokenScores, token_scores
from memlm.memory import MemoryBackend
from memlm.memory.consolidation import ConsolidationConfig, consolidate
from memlm.memory.faiss_backend import FaissMemory
from memlm.memory.pointers import PointerConfig, PointerSearch
from memlm.memory.usage import Usage


@dataclass(frozen=True)
class TrimeSpec:
    """TRIME local (and long-term) memory inside the LM's softmax (TRIME Eq. 5/6)."""

    long_segments: int = 0  # earlier windows of the same document; 0: local memory only
    # SmolLM2 key similarities are ~2-3.5 against logit log-sum-exps of 12-31, so the
    # grid reaches small tau (docs/trime.md)
    taus: tuple[float, ...] = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 4.0, 8.0)

    def columns(self, o: TokenOutputs, window: WindowConfig) -> np.ndarray:
        from memlm.knnlm.trime import cached_doc_logprobs

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


def _month(d: dt.date) -> str:
    return f"{d.year:04d}-{d.month:02d}"


def _resume(workdir: Path, cache: TokenCache, state: RunState) -> tuple[Datastore, MemoryIndex]:
    """The faiss memory of ``workdir`` as the checkpoint left it, as its datastore and
    index (tests recompute a day's decisions from it)."""
    memory = FaissMemory.open(workdir, cache.encoder.dim)
    restore(memory, state)
    return memory.datastore, memory.index


def run_policy(
    policy: Policy | None,
    plans: Sequence[DayPlan],
    cache: TokenCache,
    workdir: Path,
    *,
    ingest_params: KnnParams | None,
    ingest_evidence: bool = False,
    ingest_served: bool = False,
    calibrator_min_tokens: int = MIN_TUNE_TOKENS,
    k_max: int,
    index_kind: str = "auto",
    rerank_depth: int | None = None,
    ingest_rerank_depth: int | None = None,
    pointers: PointerConfig | None = None,
    on_day: Callable[[DayStats], None] | None = None,
    trime: TrimeSpec | None = None,
    served_grid: TuneGrid = SERVED_GRID,
    served_default: KnnParams = SERVED_DEFAULT,
    served_min_tokens: int = MIN_TUNE_TOKENS,
    resume: bool = False,
    rescore: Rescore | None = None,
    crash_at: int | None = None,
    ood: Mapping[str, Sequence[Document]] | None = None,
    name: str | None = None,
    consolidation: ConsolidationConfig | None = None,
    memory: RunMemory = FAISS,
) -> PolicyRun:
    """Ingest the stream with ``policy`` (None: the bare LM) and search the held-out tokens.

    ``ingest_params``: the constant MoNIM scores with; None: the interpolation the service
    would serve, ``served_default`` until the dev tokens of the days so far (each searched
    against its evening's memory, as the service's held-out tokens are) choose one from
    ``served_grid`` after an evening's build, as the service does at its nightly build.
    ``ingest_evidence``: lambda per token from the retrieval evidence instead of the
    constant's (the prior, then fitted each evening on the dev tokens so far).
    ``ingest_served``: lambda and T per token from what the service's build would serve
    each evening (memlm.evaluate.served.EveningBuilds: the evidence, and the calibrator
    trained on the dev tokens so far where the combination beats it,
    ``calibrator_min_tokens`` at least), as the service's worker decides.

    Every finished day is checkpointed (memlm.evaluate.checkpoint); ``resume`` goes on
    from the last one.  ``rescore``: at the end of each month of the plan, every test
    document of the plan is searched again against the memory of that evening (the
    learning and forgetting table).  ``crash_at``: raise after that day's checkpoint.
    ``ood``: out-of-domain documents searched against the memory after the last day.
    ``consolidation``: re-test stored entries and keep a budget every evening before the
    build (memlm.memory.consolidation), with the LM's log-probability of each stored token
    (kept beside the datastore) and the usage counted from MoNIM's searches.
    ``rerank_depth`` / ``ingest_rerank_depth``: the re-rank depth of the held-out (and
    out-of-domain, month-end) searches / of the policy's searches (None: the index's).
    ``pointers``: the policy's and the held-out tokens' searches follow RetoMaton's
    pointers (memlm.memory.pointers) and search only where they fail; the threshold is
    learned within this call (a resumed run learns it again).
    ``memory``: where the entries live (memlm.evaluate.memories: the faiss files in
    ``workdir`` by default, or a Milvus collection); the run reaches it only through
    memlm.memory.MemoryBackend.
    """
    name = name or (policy.name if policy is not None else "bare")
    state = checkpoint.load(workdir) if resume else None
    if state is None:
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir(parents=True)
        state = RunState(
            served={
                "params": ingest_params or served_default,
                "source": "fixed" if ingest_params is not None else "default",
            }
        )
    dev, test = checkpoint.load_eval(workdir, len(state.days))
    if state.finished:
        return PolicyRun(
            name,
            state.days,
            dev.arrays(k_max),
            test.arrays(k_max),
            state.days[-1].entries if state.days else 0,
            state.seen,
            state.stored,
            ood=_load_ood(workdir, ood),
        )
    mem = memory.open(workdir, cache.encoder.dim, fresh=not state.days)
    try:
        return _run_days(
            policy,
            plans,
            cache,
            workdir,
            name,
            state,
            dev,
            test,
            mem,
            memory,
            ingest_params=ingest_params,
            ingest_evidence=ingest_evidence,
            ingest_served=ingest_served,
            calibrator_min_tokens=calibrator_min_tokens,
            k_max=k_max,
            index_kind=index_kind,
            rerank_depth=rerank_depth,
            ingest_rerank_depth=ingest_rerank_depth,
            pointers=pointers,
            on_day=on_day,
            trime=trime,
            served_grid=served_grid,
            served_default=served_default,
            served_min_tokens=served_min_tokens,
            rescore=rescore,
            crash_at=crash_at,
            ood=ood,
            consolidation=consolidation,
        )
    finally:
        mem.close()


def _run_days(
    policy: Policy | None,
    plans: Sequence[DayPlan],
    cache: TokenCache,
    workdir: Path,
    name: str,
    state: RunState,
    dev: EvalTokens,
    test: EvalTokens,
    mem: MemoryBackend,
    memory: RunMemory,
    *,
    ingest_params: KnnParams | None,
    ingest_evidence: bool,
    ingest_served: bool,
    calibrator_min_tokens: int,
    k_max: int,
    index_kind: str,
    rerank_depth: int | None,
    ingest_rerank_depth: int | None,
    pointers: PointerConfig | None,
    on_day: Callable[[DayStats], None] | None,
    trime: TrimeSpec | None,
    served_grid: TuneGrid,
    served_default: KnnParams,
    served_min_tokens: int,
    rescore: Rescore | None,
    crash_at: int | None,
    ood: Mapping[str, Sequence[Document]] | None,
    consolidation: ConsolidationConfig | None,
) -> PolicyRun:
    """``run_policy``'s days from the checkpoint's on, with the memory ``mem`` open."""
    if state.days:
        restore(mem, state)
    end = state.datastore_len  # past the last entry id stored (faiss: the datastore length)
    lexical = LexicalStats.load(workdir / "lexical.npz", cache.encoder.vocab_size)
    usage = Usage.load(workdir)
    lm_lp = entry_logprobs(workdir, end)
    follow: dict[tuple[str, int], PointerSearch] = {}
    evenings = None
    if ingest_served and policy is not None and policy.needs_augmented:
        evenings = EveningBuilds(
            workdir / "served",
            cache.encoder.vocab_size,
            served_grid,
            served_default,
            min_tokens=calibrator_min_tokens,
        )
        if state.served.get("version") is not None:
            evenings.load(int(state.served["version"]))
    day_counts = (0, 0)  # (searched, tokens) of the pointers up to the last day

    def neighbours_of(
        kind: str, o: TokenOutputs, k: int, depth: int | None
    ) -> tuple[Any, Any, Any]:
        """(distances, ids, values) of one document's tokens: the full search, or the
        pointers."""
        if pointers is None:
            return mem.search(o.keys, k, depth=depth)
        ps = follow.get((kind, k))
        if ps is None:
            ps = follow[(kind, k)] = PointerSearch(
                lambda q, kk: mem.search(q, kk, depth=depth), mem.successors, k, pointers
            )
        dist, ids, vals, _ = ps.document(o.keys, o.targets)
        return dist, ids, vals

    for day_index in range(len(state.days), len(plans)):
        plan = plans[day_index]
        t0, w0 = time.perf_counter(), cache.wait_seconds
        dnum = day_number(plan.day)
        day_seen = day_stored = day_alone = 0
        usage_s = 0.0
        night: dict[str, object] | None = None
        knn: KnnParams = state.served["params"]
        asked = {
            "k": knn.k,
            "temperature": knn.temperature,
            "lambda": knn.lmbda,
            "source": state.served["source"],
        }
        evidence = None
        if evenings is not None:
            knn = evenings.served.params
            asked |= {"k": knn.k, "temperature": knn.temperature, "lambda": "served"}
            asked["lambda_source"] = evenings.served.lambda_source
        elif ingest_evidence and policy is not None and policy.needs_augmented:
            evidence = EvidenceModel.from_json(state.served.get("evidence") or PRIOR.to_json())
            asked["lambda"] = "evidence"
            asked["evidence"] = evidence.to_json()
        outs = cache.get_many([d.text for d in plan.train])
        for o in outs:
            state.doc_no += 1
            n = len(o)
            lexical.update(np.concatenate([o.prev_tokens[:1], o.targets]))
            day_seen += n
            if policy is None or n == 0:
                continue
            if evenings is not None:
                # the service worker's scores (memlm.engine.core ``_scores``)
                scores, _, _, (dist, nb_ids, vals) = evenings.served.scores(
                    cache.encoder,
                    o,
                    functools.partial(neighbours_of, "ingest", o, depth=ingest_rerank_depth),
                    lexical,
                )
                if consolidation is not None:
                    t_usage = time.perf_counter()
                    usage.add(nb_ids, vals, o.targets)
                    usage_s += time.perf_counter() - t_usage
                lm_alone = TokenScores(o.target_logprob, o.top_logprob, o.key_ce)
                day_alone += int(policy.decide(lm_alone).sum())
            elif policy.needs_augmented:
                dist, nb_ids, vals = neighbours_of("ingest", o, knn.k, ingest_rerank_depth)
                if consolidation is not None:
                    t_usage = time.perf_counter()
                    usage.add(nb_ids, vals, o.targets)
                    usage_s += time.perf_counter() - t_usage
                lam = None
                if evidence is not None:
                    qnorm = (o.keys.astype(np.float64) ** 2).sum(axis=1)
                    lam = evidence.lambdas(dist, vals, qnorm, knn.temperature, o.positions)
                scores = token_scores(cache.encoder, o, dist, vals, knn, lmbda=lam)
                lm_alone = TokenScores(o.target_logprob, o.top_logprob, o.key_ce)
                day_alone += int(policy.decide(lm_alone).sum())
            else:
                nan = np.full(n, np.nan)
                scores = TokenScores(nan, nan, o.key_ce)
            mask = policy.decide(scores)
            if mask.any():
                # float16 keys on every backend (the faiss datastore's precision; Milvus
                # holds them as float32): the backends store the same vectors
                ids = mem.append(
                    o.keys[mask].astype(np.float16),
                    o.targets[mask].astype(np.int32),
                    np.full(int(mask.sum()), state.doc_no, np.int64),
                    o.positions[mask],
                    np.full(int(mask.sum()), dnum, np.int32),
                )
                end = max(end, int(ids.max()) + 1)
                lm_lp.add(ids, o.target_logprob[mask])
            day_stored += int(mask.sum())
        t_build, w_build = time.perf_counter(), cache.wait_seconds
        if consolidation is not None and policy is not None and end > 0:
            assert len(lm_lp) == state.stored + day_stored, (len(lm_lp), state.stored)
            lm_lp.save(workdir)
            rep = consolidate(mem, consolidation, knn, usage, state=workdir, lm_logprob=lm_lp.of)
            night = rep.to_json() | {"usage": usage.totals()}
            usage.save(workdir)
        if policy is not None and end > 0:
            params = (
                IndexParams.exact()
                if index_kind == "flat"
                else memory.auto_params(mem.count(), mem.dim)
            )
            mem.build(params)
            mem.reload()
            mem.prune(keep=2)  # this evening's and the checkpointed one
        t_search = time.perf_counter()
        day_dev, day_test = EvalTokens(), EvalTokens()
        for split, docs in (("dev", plan.dev), ("test", plan.test)):
            target = day_dev if split == "dev" else day_test
            for i, o in enumerate(cache.get_many([d.text for d in docs])):
                dist, _, vals = neighbours_of("heldout", o, k_max, rerank_depth)
                cols = None if trime is None else trime.columns(o, cache.window)
                target.add(o, dist, vals, dnum, i, lexical.features(o.prev_tokens), cols)
        extend(dev, day_dev)
        extend(test, day_test)
        last_of_month = day_index + 1 == len(plans) or _month(plans[day_index + 1].day) != _month(
            plan.day
        )
        if rescore is not None and policy is not None and last_of_month:
            rescore.run(mem, cache, workdir / "rescore" / f"{_month(plan.day)}.npz", rerank_depth)
        if ingest_params is None and policy is not None and policy.needs_augmented:
            dev_rows = dev.arrays(k_max)  # one copy of the dev tokens so far, k_max wide
            choice = choose_constant(
                dev_rows, served_grid, served_default, min_tokens=served_min_tokens
            )
            state.served = {"params": choice.params, "source": choice.source}
            if evenings is not None:  # the service's build on the dev tokens so far
                rows = with_seen_view(dev_rows, plans[: day_index + 1], cache)
                version = int(rows["day"].max()) if len(rows["day"]) else None
                if version is not None:
                    evenings.build(rows, version)
                    state.served["version"] = version
            elif ingest_evidence:  # fitted on the dev tokens so far, as a build would
                model, temperature = fit_best(
                    views(dev_rows), choice.params.k, served_grid.temperatures
                )
                state.served["params"] = replace(choice.params, temperature=temperature)
                state.served["evidence"] = model.to_json()
        counted = (
            sum(ps.stats.searched for ps in follow.values()),
            sum(ps.stats.tokens for ps in follow.values()),
        )
        state.seen += day_seen
        state.stored += day_stored
        stats = DayStats(
            plan.day.isoformat(),
            day_seen,
            day_stored,
            mem.count(),
            time.perf_counter() - t0,
            asked if policy is not None and policy.needs_augmented else {},
            ingest_seconds=round(t_build - t0 - (w_build - w0), 3),
            build_seconds=round(t_search - t_build, 3),
            search_seconds=round(
                time.perf_counter() - t_search - (cache.wait_seconds - w_build), 3
            ),
            wait_seconds=round(cache.wait_seconds - w0, 3),
            stored_lm_alone=day_alone if policy is not None and policy.needs_augmented else None,
            consolidation=night,
            usage_seconds=round(usage_s, 3),
            searched=None
            if pointers is None
            else {"searched": counted[0] - day_counts[0], "tokens": counted[1] - day_counts[1]},
        )
        day_counts = counted
        state.days.append(stats)
        state.datastore_len, state.index_version = end, mem.served_version
        state.finished = day_index + 1 == len(plans)
        if state.finished and ood:
            _search_ood(ood, mem, cache, lexical, dnum, k_max, workdir, rerank_depth)
        checkpoint.save_day(workdir, day_index, day_dev, day_test, k_max)
        lexical.save(workdir / "lexical.npz")
        checkpoint.save(workdir, state)
        if on_day:
            on_day(stats)
        if crash_at == day_index:
            raise SimulatedInterruption(f"{name}: interrupted after day {day_index}")
    return PolicyRun(
        name,
        state.days,
        dev.arrays(k_max),
        test.arrays(k_max),
        mem.count(),
        state.seen,
        state.stored,
        ood=_load_ood(workdir, ood),
    )


def _search_ood(
    ood: Mapping[str, Sequence[Document]],
    memory: MemoryBackend,
    cache: TokenCache,
    lexical: LexicalStats,
    last_day: int,
    k_max: int,
    workdir: Path,
    rerank_depth: int | None = None,
) -> None:
    """Search each out-of-domain corpus against the final memory (one day after the stream)."""
    for i, (name, docs) in enumerate(ood.items()):
        part = EvalTokens()
        for j, o in enumerate(cache.get_many([d.text for d in docs])):
            dist, _, vals = memory.search(o.keys, k_max, depth=rerank_depth)
            part.add(o, dist, vals, last_day + 1 + i, j, lexical.features(o.prev_tokens))
        checkpoint.save_arrays(workdir / "eval" / f"ood-{name}.npz", part.arrays(k_max))


def _load_ood(
    workdir: Path, ood: Mapping[str, Sequence[Document]] | None
) -> dict[str, dict[str, np.ndarray]]:
    return {
        name: checkpoint.load_arrays(workdir / "eval" / f"ood-{name}.npz") for name in ood or {}
    }
