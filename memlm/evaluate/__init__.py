"""Streaming evaluation: how well each memorisation policy learns a dated stream.

Each day of the stream: a seeded share of the day's documents is held out as dev and
test; the rest is ingested with the policy (every token scored against the memory served
at that moment: built index + fresh entries); at the end of the day the index is rebuilt
and that day's dev and test documents are searched against the memory of that evening.
Afterwards k, T and lambda are tuned on the dev tokens of all days and applied, unchanged,
to the test tokens.  The frozen LM's per-token outputs are cached on disk, so comparing
policies never re-encodes the stream.

Modules: ``plan`` (the per-day split), ``cache`` (LM outputs on disk), ``run`` (one policy
over the stream), ``config`` (the settings), ``report`` (tuning, tables, plots) and
``harness`` (the whole evaluation).
"""

from memlm.calibrator.constant import TuneGrid, ppl, token_logprobs, tune
from memlm.evaluate.cache import TokenCache
from memlm.evaluate.config import EvalConfig
from memlm.evaluate.harness import evaluate
from memlm.evaluate.plan import (
    EPOCH,
    DayPlan,
    SplitError,
    day_number,
    plan_from_split,
    plan_stream,
    split_of,
)
from memlm.evaluate.report import plans_day_month, render_markdown
from memlm.evaluate.run import DayStats, EvalTokens, PolicyRun, TrimeSpec, run_policy

__all__ = [
    "EPOCH",
    "DayPlan",
    "DayStats",
    "EvalConfig",
    "EvalTokens",
    "PolicyRun",
    "SplitError",
    "TokenCache",
    "TrimeSpec",
    "TuneGrid",
    "day_number",
    "evaluate",
    "plan_from_split",
    "plan_stream",
    "plans_day_month",
    "ppl",
    "render_markdown",
    "run_policy",
    "split_of",
    "token_logprobs",
    "tune",
]
